#!/usr/bin/env bash
# llama.cpp's `llama-server`, the serving peer of the goodput comparison (issue 15), on the same
# weights as Fission: builds it from the llama.cpp tree vendored in the `llama-cpp-python` sdist
# (engine/benches/peers/setup.sh fetches and unpacks it into the ignored .peers/), converts a
# Hugging Face model directory to GGUF f32 with the vendored convert_hf_to_gguf.py, and serves it.
# Nothing vendored is committed: everything lands under .peers/ (git-ignored).
#
# Usage:
#   loadtest/peers/llama_server.sh build                 # build .peers/llama.cpp/build/bin/llama-server
#   loadtest/peers/llama_server.sh gguf MODEL_DIR        # print the GGUF path (converting once)
#   loadtest/peers/llama_server.sh serve MODEL_DIR PORT [PARALLEL] [CTX]
#       continuous batching with PARALLEL slots (8) sharing a CTX-token KV cache (8192 per
#       slot), 2 threads (this machine's cores), on 127.0.0.1 only; runs in the foreground.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS="${PEERS_DIR:-$REPO/.peers}"
LLAMA="$PEERS/llama.cpp"
BIN="$LLAMA/build/bin/llama-server"
THREADS="${THREADS:-$(nproc)}"

build() {
  [ -x "$BIN" ] && return 0
  "$REPO/engine/benches/peers/setup.sh"
  export PATH="$PEERS/venv/bin:$PATH"
  (cd "$LLAMA" && nice -n 10 cmake --build build --target llama-server -j"${JOBS:-2}")
  [ -x "$BIN" ]
}

gguf() { # MODEL_DIR: converts once per model directory content, prints the path
  local dir key out
  dir=$(realpath "$1")
  key=$(cat "$dir/config.json" "$dir/model.safetensors" | sha256sum | cut -c1-12)
  out="$PEERS/gguf/$(basename "$dir")-$key.gguf"
  if [ ! -f "$out" ]; then
    mkdir -p "$PEERS/gguf"
    "$PEERS/venv/bin/python" "$LLAMA/convert_hf_to_gguf.py" "$dir" --outtype f32 \
      --outfile "$out.tmp" >&2
    mv "$out.tmp" "$out"
  fi
  echo "$out"
}

case "${1:-}" in
  build) build ;;
  gguf) build >&2; gguf "$2" ;;
  serve)
    build >&2
    model=$(gguf "$2")
    parallel=${4:-8}
    ctx=${5:-$((8192 * parallel))}
    # --cont-batching is llama-server's default; stated for the reader. No --jinja: the
    # completions route takes raw prompts, as Fission's does.
    exec "$BIN" -m "$model" --host 127.0.0.1 --port "$3" -t "$THREADS" \
      --parallel "$parallel" -c "$ctx" --cont-batching --no-webui
    ;;
  *) sed -n '2,14p' "$0" >&2; exit 2 ;;
esac
