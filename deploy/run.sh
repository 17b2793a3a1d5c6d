#!/usr/bin/env bash
# The main job: build Fission and start a local cluster (1 prefill node, 1 decode node and a
# gateway, as separate processes) serving a model on http://127.0.0.1:8080. Ctrl-C stops it.
#
# MODEL is a local model directory or a hub repo id. The default is a small real chat model
# from the hub; on a machine without network, point MODEL at a local directory, for example
# MODEL=../shared/models/stories260K.
set -euo pipefail
cd "$(dirname "$0")/.."
source deploy/install-deps.sh
export PATH="$HOME/.cargo/bin:$PATH"

MODEL="${MODEL:-HuggingFaceTB/SmolLM2-135M-Instruct}"
cargo build --release -p deploy
exec target/release/fission up --model "$MODEL" --prefill "${PREFILL:-1}" --decode "${DECODE:-1}" --port "${PORT:-8080}" "$@"
