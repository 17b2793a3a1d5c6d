#!/usr/bin/env bash
# The one GPU run of issue 35, prepared here and run there in a single device call.
#
#   deploy/gpu-check.sh build   here: the CUDA binaries (PyPI's CUDA 13 toolkit,
#                               ../shared/cuda/README.md), stripped, into .gpu-check/ (git-ignored
#                               through .git/info/exclude), at most 64 MiB with the files the
#                               run needs (the binaries xz-compressed; `run` unpacks them with
#                               python3's lzma). About 15 min on 2 cores (candle's kernels: 5.5).
#   deploy/gpu-check.sh run     there (`run` with carry [".gpu-check"]), at most 8 min; results
#                               under $OUT: check.log, summary.txt, the bench JSONs.
#   deploy/gpu-check.sh cpu     here, with the CPU build in target/release: every step a CPU
#                               allows, the same commands with --device cpu --path tensor and a
#                               small bench shape, so the script itself is tested before the
#                               GPU run. Results under $OUT (default .gpu-check/cpu-out).
#
# Steps of `run` (each logged, none stops the others; summary.txt says pass/fail per step):
#   1. the CUDA kernel tests against their CPU references (kernels/tests/cuda_kernels.rs), and
#      the push's copies device -> pinned host -> device in GB/s (push_copies_bandwidth);
#      then the engine's push staging on the GPU (engine/tests/push_staging.rs with
#      FISSION_TEST_DEVICE=cuda): each finished layer gathered into pinned memory on a copy
#      stream, handed to the push one layer late from two alternating buffers, bytes equal to
#      a direct gather, and a windowed model's push (pinned upload + scatter on the decode
#      side) generating the colocated ids; and push_overlap_timing: a 2048-token bf16 prefill
#      step of a SmolLM2-135M-shaped model with every layer pushed against the plain step
#      (medians; the ratio is what the overlap leaves of the copies);
#   2. stories260K greedy parity in f32 on the GPU: `fission generate --device cuda` against
#      transformers' reference ids, then through a 1P+1D cluster (`fission up --device cuda`)
#      whose nodes must both log their KV cache on the device;
#   3. the engine bench, bf16, on a random Llama-3.2-1B-shaped model (prefill 512 and 2048,
#      decode batch 1..128) beside engine/benches/peers/gpu_transformers.py on the same shapes.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:?usage: gpu-check.sh build|run|cpu}
STAGE=.gpu-check
REFS=${FISSION_SHARED_DIR:-../shared}/models/stories260K/reference_greedy.json

build() {
  set -e
  CUDA_DIR=${CUDA_DIR:-/work/cuda-toolkit}
  [ -f "$CUDA_DIR/env.sh" ] || { cargo fetch; ../shared/cuda/setup-cuda-toolkit.sh "$CUDA_DIR"; }
  # shellcheck disable=SC1091
  source "$CUDA_DIR/env.sh"
  mkdir -p .git/info
  grep -qxF "/$STAGE/" .git/info/exclude 2>/dev/null || echo "/$STAGE/" >>.git/info/exclude
  rm -rf "$STAGE" && mkdir -p "$STAGE"
  # A target dir of its own: the cuda feature in target/ would rebuild everyone's CPU crates.
  export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}
  local t0=$(date +%s)
  cargo build --release --features cuda -p deploy --bin fission
  cp "$CARGO_TARGET_DIR/release/fission" "$STAGE/fission"
  cp "$(test_exe kernels cuda_kernels --features cuda)" "$STAGE/cuda_kernels"
  cp "$(test_exe engine push_staging --features cuda)" "$STAGE/push_staging"
  strip "$STAGE/fission" "$STAGE/cuda_kernels" "$STAGE/push_staging"
  cp "$REFS" "$STAGE/reference_greedy.json"
  # The engine tests read stories260K and its references from FISSION_SHARED_DIR.
  mkdir -p "$STAGE/shared/models" && cp -r "$(dirname "$REFS")" "$STAGE/shared/models/"
  cp engine/benches/peers/gpu_transformers.py engine/benches/peers/prompts.py "$STAGE/"
  # `fission up` starts a local etcd, and the GPU machine has none.
  cp "$(command -v etcd)" "$STAGE/etcd" && strip "$STAGE/etcd" 2>/dev/null || true
  # Stripped binaries still pass 64 MiB together; xz takes them to about a third.
  for f in fission cuda_kernels push_staging etcd; do
    if [ -f "$STAGE/$f" ]; then xz -T2 -6 "$STAGE/$f"; fi
  done
  local size
  size=$(du -sm "$STAGE" | cut -f1)
  echo "built in $(($(date +%s) - t0)) s; $STAGE is $size MiB"
  [ "$size" -le 64 ] || { echo "$STAGE is over 64 MiB"; exit 1; }
}

# test_exe CRATE TEST [CARGO ARGS...]: builds an integration test and prints its executable.
test_exe() {
  local crate=$1 name=$2
  shift 2
  cargo test --release "$@" -p "$crate" --test "$name" --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$name"
}

# unpack: the xz-compressed binaries of the stage, decompressed in place (python3's lzma:
# the device machine may have no xz).
unpack() {
  local f
  for f in "$STAGE"/*.xz; do
    [ -e "$f" ] || continue
    python3 -c 'import lzma, shutil, sys
with lzma.open(sys.argv[1]) as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)' "$f" "${f%.xz}" && chmod +x "${f%.xz}" && rm -f "$f"
  done
}

# parity BIN DEVICE PATH: each reference prompt's greedy ids from `fission generate`.
parity() {
  local bin=$1 device=$2 path=$3 refs=$4 ok=0 bad=0
  while IFS=$'\t' read -r prompt want; do
    got=$("$bin" generate --model stories260K --prompt "$prompt" --max-new-tokens 32 \
          --ignore-eos --json --dtype f32 --device "$device" --path "$path" |
          python3 -c 'import json,sys; print(json.load(sys.stdin)["output_ids"])')
    if [ "$got" = "$want" ]; then ok=$((ok + 1)); else bad=$((bad + 1)); echo "differs: $prompt: $got != $want"; fi
  done < <(python3 -c '
import json, sys
for r in json.load(open(sys.argv[1]))["references"]:
    print(r["prompt"].replace("\t", " ") + "\t" + str(r["output_ids"]))' "$refs")
  echo "parity $device/$path: $ok identical, $bad differ"
  [ "$bad" -eq 0 ] && [ "$ok" -gt 0 ]
}

# cluster BIN DEVICE PATH PORT: 1P+1D through `fission up`; each prompt's greedy tokens via
# the gateway against the reference ids (a prefix of them where the model stops at EOS).
cluster() {
  local bin=$1 device=$2 path=$3 refs=$4 port=$5 log=$6 rc=0
  # Both nodes share one GPU: each may use 0.4 of it (its KV cache that share less its weights).
  local share=()
  [ "$device" = cpu ] || share=(--gpu-memory-utilization 0.4)
  setsid "$bin" up --device "$device" --path "$path" --port "$port" --node-arg=--dtype=f32 \
    "${share[@]}" >"$log" 2>&1 &
  local up=$!
  for _ in $(seq 240); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    sleep 0.5
  done
  python3 - "$refs" "$port" <<'PY' || rc=1
import json, sys, urllib.request
refs, port = json.load(open(sys.argv[1]))["references"], sys.argv[2]
ok = bad = 0
for r in refs:
    body = json.dumps({"inputs": r["prompt"], "parameters": {"max_new_tokens": 32, "details": True}})
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", body.encode(),
                                 {"Content-Type": "application/json"})
    out = json.load(urllib.request.urlopen(req, timeout=60))
    got = [t["id"] for t in out["details"]["tokens"]]
    if got and got == r["output_ids"][: len(got)]:
        ok += 1
    else:
        bad += 1
        print("differs:", r["prompt"], got, r["output_ids"])
print(f"cluster 1P+1D: {ok} identical, {bad} differ")
sys.exit(1 if bad or not ok else 0)
PY
  kill -INT -- -"$up" 2>/dev/null
  wait "$up" 2>/dev/null
  # Both nodes' KV caches must be device tensors (engine: "kv cache allocated ... kv_on_device").
  local on
  on=$(sed 's/\x1b\[[0-9;]*m//g' "$log" | grep -c 'kv cache allocated.*kv_on_device=true')
  echo "KV caches on the device: $on of 2"
  [ "$on" -eq 2 ] || rc=1
  return $rc
}

step() {
  local name=$1
  shift
  local t0=$(date +%s)
  if "$@" >>"$OUT/check.log" 2>&1; then r=pass; else r=FAIL; fi
  echo "$name: $r ($(($(date +%s) - t0)) s)" | tee -a "$OUT/summary.txt"
}

run_gpu() {
  : "${OUT:?run on the device machine, where OUT is set}"
  unpack
  local lib
  lib=$(python3 -c "import nvidia, os; print(os.path.dirname(nvidia.__file__))")/cu13/lib
  export LD_LIBRARY_PATH=$lib:${LD_LIBRARY_PATH:-} PATH=$PWD/$STAGE:$PATH
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/summary.txt"
  local bin=$STAGE/fission refs=$STAGE/reference_greedy.json
  step "kernel tests vs CPU references" "$STAGE/cuda_kernels" --test-threads=1 --nocapture
  # push_copies_bandwidth's line: the KV push device -> pinned host -> device in GB/s.
  grep -h "KV push copies" "$OUT/check.log" | tee -a "$OUT/summary.txt"
  step "push staging on the GPU (copy stream, pinned buffers, pinned upload)" \
    env FISSION_TEST_DEVICE=cuda FISSION_SHARED_DIR="$STAGE/shared" "$STAGE/push_staging" \
    --test-threads=1 --nocapture --include-ignored
  grep -hE "push staging on|push overlap on" "$OUT/check.log" | tee -a "$OUT/summary.txt"
  step "stories260K f32 greedy parity on the GPU" parity "$bin" cuda tensor "$refs"
  step "stories260K f32 greedy parity 1P+1D on the GPU" cluster "$bin" cuda tensor "$refs" 18080 "$OUT/up.log"
  step "random Llama-3.2-1B model" "$bin" make-random-model --shape llama-3.2-1b --out /tmp/l1b
  step "fission bench engine bf16" timeout 150 "$bin" bench engine --model /tmp/l1b --device cuda \
    --dtype bf16 --prefill 512,2048 --batch 1,8,32,64,128 --repeats 3 --out "$OUT/fission-gpu.json"
  step "transformers bf16 (gpu_transformers.py)" timeout 150 python3 "$STAGE/gpu_transformers.py" \
    --out "$OUT/gpu-transformers.json" --repeats 3
  cat "$OUT/summary.txt"
}

run_cpu() {
  OUT=${OUT:-$STAGE/cpu-out}
  mkdir -p "$OUT" && : >"$OUT/summary.txt" && : >"$OUT/check.log"
  local bin=target/release/fission
  echo "(CPU: the kernel tests need a GPU; skipped)" | tee -a "$OUT/summary.txt"
  # The same test binary the GPU run takes, built for the CPU: the same staging order, with
  # host copies for the pinned ones.
  local ps
  ps=$(test_exe engine push_staging)
  step "push staging, device cache on the CPU" "$ps" --test-threads=1 --nocapture --include-ignored
  grep -hE "push staging on|push overlap on" "$OUT/check.log" | tee -a "$OUT/summary.txt"
  step "stories260K f32 greedy parity, tensor path on the CPU" parity "$bin" cpu tensor "$REFS"
  step "stories260K f32 greedy parity 1P+1D, tensor path on the CPU" cluster "$bin" cpu tensor "$REFS" 18080 "$OUT/up.log"
  step "random tiny model" "$bin" make-random-model --shape tiny --out "$OUT/tiny"
  step "fission bench engine, tensor path on the CPU" timeout 120 "$bin" bench engine \
    --model "$OUT/tiny" --device cpu --path tensor --prefill 64 --batch 1,8 --repeats 1 \
    --out "$OUT/fission-cpu.json"
  rm -rf "$OUT/tiny"
  ! grep -q FAIL "$OUT/summary.txt"
}

case $MODE in
  build) build ;;
  run) mkdir -p "$OUT"; : >"$OUT/check.log"; run_gpu ;;
  cpu) run_cpu ;;
  *) echo "usage: gpu-check.sh build|run|cpu"; exit 2 ;;
esac
