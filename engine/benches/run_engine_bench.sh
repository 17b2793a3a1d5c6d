#!/usr/bin/env bash
# Engine speed against transformers and llama.cpp on the same weights and prompts (issue 14).
#
#   engine/benches/run_engine_bench.sh            # ROUNDS=5, both models
#   ROUNDS=7 MODELS=smollm2 engine/benches/run_engine_bench.sh
#   INT8=0 engine/benches/run_engine_bench.sh    # without the int8 rows
#   ISA=avx2 engine/benches/run_engine_bench.sh  # every engine on AVX2 without AVX-512
#   KQUANT=0 engine/benches/run_engine_bench.sh  # without the GGUF rows
#   L1B=0 engine/benches/run_engine_bench.sh     # without the Llama-3.2-1B-shaped GGUF rows
#   KL=0 engine/benches/run_engine_bench.sh      # without the Q4_K_M KL row
#   F32=0 engine/benches/run_engine_bench.sh     # without the f32 rows (Fission, llama.cpp, transformers)
#   MODELS=" " F32=0 INT8=0 engine/benches/run_engine_bench.sh  # the 1B GGUF rows and the KL rows only
#   MODELS=smollm2 F32=0 INT8=0 PREFILL=128 BATCH=1,8 L1B_PREFILL=128 L1B_BATCH=1 ROUNDS=1 \
#     engine/benches/run_engine_bench.sh         # a smoke run of the GGUF rows (figures not comparable)
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
# With L1B=1 (the default) each round also runs both engines on a random Llama-3.2-1B-shaped model
# (16 layers, hidden 2048, FFN 8192, 32/8 heads, SmolLM2's 49152 vocabulary: llama32_1b_bench.json)
# as Q4_K_M and Q8_0 (llama-quantize from convert_hf_to_gguf.py's f32 file; made once, then the
# f32 files are deleted): prefill 512 and decode batch 1 and 32 only (L1B_PREFILL, L1B_BATCH),
# alternating like the rest. Its weights (0.67 and 1.1 GB) do not fit in any cache.
# With KL=1 (the default) the run first measures Q4_K_M's KL divergence from f32 on SmolLM2's
# files against llama-perplexity's (engine/tests/kl_llama_cpp.rs, written to $OUT/kl.json); it is
# deterministic, so once per run (the 1B file's, measured when its files are made, is copied in).
# PREFILL and BATCH (comma-separated) replace the prompt lengths and batch sizes Fission and
# llama.cpp run on the other models (transformers keeps its own).
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
# BUILD=0 runs the binaries already in target/release (when the tree does not build right now).
[[ "${BUILD:-1}" == 0 ]] || cargo build --release --workspace --all-targets
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
L1B="${L1B:-1}"
KL="${KL:-1}"
F32="${F32:-1}"
L1B_PREFILL="${L1B_PREFILL:-512}"
L1B_BATCH="${L1B_BATCH:-1,32}"
BIN=".peers/llama.cpp/$LLAMA_BUILD/bin"
declare -A MODEL_DIRS=([stories260K]=../shared/models/stories260K [smollm2]="$M")
MODELS="${MODELS:-stories260K smollm2}"

kl_test() { # f32.gguf q4_k_m.gguf out.json log: engine/tests/kl_llama_cpp.rs on these files
  FISSION_KL_F32_GGUF="$1" FISSION_KL_Q4KM_GGUF="$2" FISSION_LLAMA_CPP_BIN="$BIN" FISSION_KL_OUT="$3" \
    "$(ls -t target/release/deps/kl_llama_cpp-* | grep -v '\.d$' | head -1)" --nocapture >"$4" 2>&1 \
    || echo "the KL test failed: see $4" >&2
  grep -E "positions|skipped" "$4" >&2 || true
}

# The Llama-3.2-1B-shaped GGUF files, made once; the Q4_K_M file's KL from the f32 one is measured
# then (llama-quantize's Q4_K and Q6_K throughout, where SmolLM2's 576 columns make it mostly
# Q5_0), before the f32 files go.
L1B_DIR=.models/llama32-1b-bench
L1B_GGUF=.peers/gguf/llama32-1b-bench
if [[ "$L1B" == 1 && ! ( -f "$L1B_GGUF-q4_k_m.gguf" && -f "$L1B_GGUF-q8_0.gguf" ) ]]; then
  target/release/fission make-random-model --spec-json engine/benches/llama32_1b_bench.json --out "$L1B_DIR"
  $PY .peers/llama.cpp/convert_hf_to_gguf.py "$L1B_DIR" --outtype f32 --outfile "$L1B_GGUF-f32.gguf"
  for t in q4_k_m q8_0; do
    "$BIN/llama-quantize" "$L1B_GGUF-f32.gguf" "$L1B_GGUF-$t.gguf.tmp" "${t^^}" 2
    mv "$L1B_GGUF-$t.gguf.tmp" "$L1B_GGUF-$t.gguf"
  done
  [[ "$KL" == 1 ]] && kl_test "$L1B_GGUF-f32.gguf" "$L1B_GGUF-q4_k_m.gguf" "$L1B_GGUF-kl.json" "$L1B_GGUF-kl.log"
  rm -f "$L1B_GGUF-f32.gguf" "$L1B_DIR/model.safetensors" # 4.3 GB each: the rows run the quantised files
fi

# Per model key: its directory (HF models) and the sets Fission and llama.cpp run.
sets() { # model_key
  if [[ "$1" == llama32-1b ]]; then echo "--prefill $L1B_PREFILL --batch $L1B_BATCH"
  else echo "${PREFILL:+--prefill $PREFILL} ${BATCH:+--batch $BATCH}"; fi
}
gguf_of() { # model_key type: the GGUF file both engines run (HF models: converted once, cached)
  if [[ "$1" == llama32-1b ]]; then echo "$L1B_GGUF-$2.gguf"
  else $PY engine/benches/peers/bench_llamacpp.py --build "$LLAMA_BUILD" --model "${MODEL_DIRS[$1]}" --outtype "$2" --convert-only --out /dev/null; fi
}
run_one() { # engine model_key out.json
  local dir="${MODEL_DIRS[$2]:-}" llama=(--build "$LLAMA_BUILD" --repeats 1 --out "$3")
  # shellcheck disable=SC2046 # sets are words
  case "$1" in
    fission) target/release/fission bench engine --model "$dir" $(sets "$2") --repeats 1 --out "$3" >/dev/null ;;
    fission_int8) target/release/fission bench engine --model "$dir" --quantize int8 $(sets "$2") --repeats 1 --out "$3" >/dev/null ;;
    llamacpp) $PY engine/benches/peers/bench_llamacpp.py --model "$dir" $(sets "$2") "${llama[@]}" >/dev/null ;;
    llamacpp_q8_0|llamacpp_q4_k_m)
      $PY engine/benches/peers/bench_llamacpp.py --gguf "$(gguf_of "$2" "${1#llamacpp_}")" $(sets "$2") "${llama[@]}" >/dev/null ;;
    fission_gguf_q8_0|fission_gguf_q4_k_m)
      target/release/fission bench engine --model "$(gguf_of "$2" "${1#fission_gguf_}")" $(sets "$2") --repeats 1 --out "$3" >/dev/null ;;
    transformers) $PY engine/benches/peers/bench_transformers.py --model "$dir" --repeats 1 --out "$3" >/dev/null ;;
  esac
}
name_of() { # model_key: the name in the result files
  if [[ "$1" == llama32-1b ]]; then echo llama32-1b-bench; else basename "${MODEL_DIRS[$1]}"; fi
}

if [[ "$KL" == 1 ]]; then
  echo "KL: Q4_K_M from f32 on smollm2, Fission and llama-perplexity" >&2
  kl_test "$(gguf_of smollm2 f32)" "$(gguf_of smollm2 q4_k_m)" "$OUT/kl.json" "$OUT/kl.log"
  if [[ "$L1B" == 1 && -f "$L1B_GGUF-kl.json" ]]; then cp "$L1B_GGUF-kl.json" "$OUT/kl-llama32-1b.json"; fi
fi

target/release/fission bench limits --out "$OUT/limits-0.json" >/dev/null
for r in $(seq 1 "$ROUNDS"); do
  order=""
  if [[ "$F32" == 1 ]]; then
    if (( r % 2 )); then order="fission llamacpp transformers"; else order="transformers llamacpp fission"; fi
  fi
  if [[ "$INT8" == 1 ]]; then
    if (( r % 2 )); then order="$order fission_int8 llamacpp_q8_0"; else order="llamacpp_q8_0 fission_int8 $order"; fi
  fi
  if [[ "$KQUANT" == 1 ]]; then
    # llama.cpp's Q8_0 run is the int8 rows' (the same file); without them it runs here.
    q8=$([[ "$INT8" == 1 ]] || echo llamacpp_q8_0)
    if (( r % 2 )); then order="$order fission_gguf_q4_k_m llamacpp_q4_k_m fission_gguf_q8_0 $q8";
    else order="$q8 fission_gguf_q8_0 llamacpp_q4_k_m fission_gguf_q4_k_m $order"; fi
  fi
  l1b_order="fission_gguf_q4_k_m llamacpp_q4_k_m fission_gguf_q8_0 llamacpp_q8_0"
  (( r % 2 )) || l1b_order="llamacpp_q8_0 fission_gguf_q8_0 llamacpp_q4_k_m fission_gguf_q4_k_m"
  keys="$MODELS"
  [[ "$L1B" == 1 ]] && keys="$keys llama32-1b"
  for key in $keys; do
    name=$(name_of "$key")
    engines="$order"
    [[ "$key" == llama32-1b ]] && engines="$l1b_order"
    for engine in $engines; do
      echo "round $r/$ROUNDS: $engine on $name" >&2
      run_one "$engine" "$key" "$OUT/$engine-$name-r$r.json"
    done
  done
done
target/release/fission bench limits --out "$OUT/limits-1.json" >/dev/null
python3 engine/benches/make_table.py "$OUT" | tee "$OUT/table.md"
