#!/usr/bin/env bash
# Engine speed against transformers and llama.cpp on the same weights and prompts (issue 14).
#
#   engine/benches/run_engine_bench.sh            # ROUNDS=5, both models
#   ROUNDS=7 MODELS=smollm2 engine/benches/run_engine_bench.sh
#   INT8=0 engine/benches/run_engine_bench.sh    # without the int8 rows
#   ISA=avx2 engine/benches/run_engine_bench.sh  # every engine on AVX2 without AVX-512
#   KQUANT=0 engine/benches/run_engine_bench.sh  # without the GGUF rows
#
# ISA=avx2 measures the path a CPU without AVX-512 takes, on one that has it: Fission under
# FISSION_MAX_ISA=avx2, llama.cpp built for AVX2 (setup.sh's LLAMA_ISA=avx2, .peers/llama.cpp/
# build-avx2), and torch with its own dispatch (ATen, MKL, oneDNN) capped at AVX2.
#
# Builds the peers into .peers/ (engine/benches/peers/setup.sh), then runs ROUNDS rounds; each
# round runs Fission, llama.cpp and transformers once per model (one repeat per figure), in an
# order that alternates from round to round (F L T, T L F, ...), so drift on a shared machine
# lands on every engine alike. With INT8=1 (the default) each round also runs Fission with
# --quantize int8 against llama.cpp's Q8_0 GGUF of the same checkpoint (convert_hf_to_gguf.py
# --outtype q8_0), next to each other in the same alternating order. The machine's ceilings (`fission bench limits`: read bandwidth
# and the packed GEMM's best GFLOP/s on the model's shapes) are measured in the same run.
# make_table.py prints, per figure, the median over rounds, the min-max spread, and the
# ratio of medians with the spread of per-round ratios; the table goes to $OUT/table.md and
# `lscpu` to $OUT/lscpu.txt.
# With KQUANT=1 (the default) each round also runs Fission and llama.cpp on the same GGUF files,
# Q4_K_M (llama-quantize from the f32 conversion) and Q8_0, alternating like the rest (issue 33):
# Fission keeps their blocks as stored (k-quant kernels; Q8_0 on the int8 panels).
set -euo pipefail
cd "$(dirname "$0")/../.."
ISA="${ISA:-native}"
case "$ISA" in
  native) LLAMA_BUILD=build ;;
  avx2) LLAMA_BUILD=build-avx2
        export FISSION_MAX_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ;;
  *) echo "ISA must be native or avx2, not $ISA" >&2; exit 2 ;;
esac
LLAMA_ISA="$ISA" bash engine/benches/peers/setup.sh
cargo build --release --workspace --all-targets
M=.models/smollm2-135m-bench
[ -f "$M/model.safetensors" ] || target/release/fission make-random-model --shape smollm2-135m --out "$M"
OUT=.bench/engine-$([[ "$ISA" == native ]] || echo "$ISA-")$(date +%Y%m%d-%H%M%S)
mkdir -p "$OUT"
lscpu > "$OUT/lscpu.txt"
echo "$ISA" > "$OUT/isa.txt"
PY=.peers/venv/bin/python
ROUNDS="${ROUNDS:-5}"
INT8="${INT8:-1}"
KQUANT="${KQUANT:-1}"
declare -A MODEL_DIRS=([stories260K]=../shared/models/stories260K [smollm2]="$M")
MODELS="${MODELS:-stories260K smollm2}"

run_one() { # engine model_dir out.json
  case "$1" in
    fission) target/release/fission bench engine --model "$2" --repeats 1 --out "$3" >/dev/null ;;
    fission_int8) target/release/fission bench engine --model "$2" --quantize int8 --repeats 1 --out "$3" >/dev/null ;;
    llamacpp) $PY engine/benches/peers/bench_llamacpp.py --build "$LLAMA_BUILD" --model "$2" --repeats 1 --out "$3" >/dev/null ;;
    llamacpp_q8_0) $PY engine/benches/peers/bench_llamacpp.py --build "$LLAMA_BUILD" --model "$2" --outtype q8_0 --repeats 1 --out "$3" >/dev/null ;;
    llamacpp_q4_k_m) $PY engine/benches/peers/bench_llamacpp.py --build "$LLAMA_BUILD" --model "$2" --outtype q4_k_m --repeats 1 --out "$3" >/dev/null ;;
    fission_gguf_q8_0|fission_gguf_q4_k_m)
      gguf=$($PY engine/benches/peers/bench_llamacpp.py --build "$LLAMA_BUILD" --model "$2" --outtype "${1#fission_gguf_}" --convert-only --out /dev/null)
      target/release/fission bench engine --model "$gguf" --repeats 1 --out "$3" >/dev/null ;;
    transformers) $PY engine/benches/peers/bench_transformers.py --model "$2" --repeats 1 --out "$3" >/dev/null ;;
  esac
}

target/release/fission bench limits --out "$OUT/limits-0.json" >/dev/null
for r in $(seq 1 "$ROUNDS"); do
  if (( r % 2 )); then order="fission llamacpp transformers"; else order="transformers llamacpp fission"; fi
  if [[ "$INT8" == 1 ]]; then
    if (( r % 2 )); then order="$order fission_int8 llamacpp_q8_0"; else order="llamacpp_q8_0 fission_int8 $order"; fi
  fi
  if [[ "$KQUANT" == 1 ]]; then
    if (( r % 2 )); then order="$order fission_gguf_q4_k_m llamacpp_q4_k_m fission_gguf_q8_0";
    else order="fission_gguf_q8_0 llamacpp_q4_k_m fission_gguf_q4_k_m $order"; fi
  fi
  for key in $MODELS; do
    model="${MODEL_DIRS[$key]}"
    name=$(basename "$model")
    for engine in $order; do
      echo "round $r/$ROUNDS: $engine on $name" >&2
      run_one "$engine" "$model" "$OUT/$engine-$name-r$r.json"
    done
  done
done
target/release/fission bench limits --out "$OUT/limits-1.json" >/dev/null
python3 engine/benches/make_table.py "$OUT" | tee "$OUT/table.md"
