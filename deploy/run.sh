#!/usr/bin/env bash
# The main job: build Fission and start a local cluster (1 prefill node, 1 decode node and a
# gateway, as separate processes) serving a model on http://127.0.0.1:8080. Ctrl-C stops it.
#
# MODEL is a local model directory or a hub repo id (`org/name[@revision]`, downloaded). With no
# MODEL it serves the embedded default, stories260K (deploy/default-model/stories260K/SOURCE.md):
# a tiny story model that needs no network, with a stand-in chat template.
set -euo pipefail
cd "$(dirname "$0")/.."
source deploy/install-deps.sh
export PATH="$HOME/.cargo/bin:$PATH"

cargo build --release -p deploy
exec target/release/fission up ${MODEL:+--model "$MODEL"} --prefill "${PREFILL:-1}" --decode "${DECODE:-1}" --port "${PORT:-8080}" "$@"
