#!/usr/bin/env bash
# Reproduces BENCHMARKS.md's engine table: Fission, HF transformers and llama.cpp on the same
# weights (stories260K and a random SmolLM2-135M-shaped model), same prompts and batch sizes,
# one engine at a time on an otherwise idle machine. Output: .bench/engine-<time>/table.md
set -euo pipefail
cd "$(dirname "$0")/../.."
bash engine/benches/peers/setup.sh
cargo build --release -p deploy
M=.models/smollm2-135m-bench
[ -f "$M/model.safetensors" ] || target/release/fission make-random-model --shape smollm2-135m --out "$M"
OUT=.bench/engine-$(date +%Y%m%d-%H%M%S)
mkdir -p "$OUT"
PY=.peers/venv/bin/python
for model in ../shared/models/stories260K "$M"; do
  name=$(basename "$model")
  target/release/fission bench engine --model "$model" --repeats "${REPEATS:-3}" --out "$OUT/fission-$name.json" >/dev/null
  $PY engine/benches/peers/bench_transformers.py --model "$model" --out "$OUT/transformers-$name.json"
  $PY engine/benches/peers/bench_llamacpp.py --model "$model" --out "$OUT/llamacpp-$name.json"
done
python3 engine/benches/make_table.py "$OUT" | tee "$OUT/table.md"
