#!/usr/bin/env bash
# The main job: build Fission and serve a model. Until the cluster lands (`fission up`), this
# runs the engine on one prompt with `fission generate`.
# MODEL may be a local directory or a hub repo id; machines without network use the default.
set -euo pipefail
cd "$(dirname "$0")/.."
source deploy/install-deps.sh
export PATH="$HOME/.cargo/bin:$PATH"

MODEL="${MODEL:-../shared/models/stories260K}"
PROMPT="${PROMPT:-Once upon a time}"
cargo build --release -p deploy
exec target/release/fission generate --model "$MODEL" --prompt "$PROMPT" --max-new-tokens "${MAX_NEW_TOKENS:-64}" "$@"
