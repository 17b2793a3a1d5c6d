#!/usr/bin/env bash
# KV-transfer overlap: TTFT of 1K- and 2K-token prompts on a 1P+1D cluster (QUIC KV push) when
# the prefill node pushes each layer as soon as it is computed (the default) against the same
# cluster with `--push-after-prefill` (every layer held until the prompt is done, then sent).
# Both clusters run side by side for the whole script, so the machine's drift hits both; the
# measurements alternate A B B A per round, sequential requests only (one prompt in flight).
# Model: the SmolLM2-135M-shaped random model (30 layers: the overlap has 30 layers to hide).
# Prefix caching is off on both: the repeated prompts would otherwise be served from the cache.
# Usage: kv_overlap.sh [FISSION]   (a `fission` binary; this tree's release build by default).
# RUNS=N rounds (4), REPEATS=N requests per prompt length per measurement (3).
# Output: .bench/kv-overlap-<time>/ with results.csv, lscpu.txt and summary.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
FISSION=$(realpath "${1:-target/release/fission}")
RUNS=${RUNS:-4}
REPEATS=${REPEATS:-3}
cargo build --release -p loadtest
LOADTEST=target/release/fission-loadtest
M=${MODEL:-.models/smollm2-135m}
[ -f "$M/model.safetensors" ] || "$FISSION" make-random-model --shape smollm2-135m --out "$M"
OUT=.bench/kv-overlap-$(date +%Y%m%d-%H%M%S)
mkdir -p "$OUT"
lscpu > "$OUT/lscpu.txt"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

pids=()
cleanup() { for p in "${pids[@]}"; do kill -INT "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

start() { # var name extra-args...: starts a cluster, sets $var to its port. Not called
  # in $(...): its pid must reach the parent's cleanup.
  local var=$1 name=$2 port log
  shift 2
  port=$(free_port)
  log="$OUT/up-$name.log"
  "$FISSION" up --model "$M" --port "$port" --prefill 1 --decode 1 \
    --node-arg=--num-kv-blocks=1024 --node-arg=--disable-prefix-caching "$@" > "$log" 2>&1 &
  pids+=($!)
  until grep -q "Fission is up" "$log"; do
    kill -0 "${pids[-1]}" 2>/dev/null || { echo "fission up failed" >&2; cat "$log" >&2; exit 1; }
    sleep 0.5
  done
  printf -v "$var" '%s' "$port"
}
start LAYERWISE layerwise
start AFTER after --prefill-arg=--push-after-prefill

echo "round,mode,prompt_tokens,ttft_ms_median,e2e_ms_median" > "$OUT/results.csv"
measure() { # round mode port
  "$LOADTEST" --url "http://127.0.0.1:$3" --vocab 49152 ttft --prompt-tokens 1024,2048 \
    --repeats "$REPEATS" --max-new-tokens 4 |
    awk -F, -v r="$1" -v m="$2" 'NR > 1 { print r "," m "," $1 "," $2 "," $3 }' >> "$OUT/results.csv"
}
# One warm-up request per cluster and length, not recorded.
"$LOADTEST" --url "http://127.0.0.1:$LAYERWISE" --vocab 49152 ttft --prompt-tokens 1024,2048 --repeats 1 --max-new-tokens 4 > /dev/null
"$LOADTEST" --url "http://127.0.0.1:$AFTER" --vocab 49152 ttft --prompt-tokens 1024,2048 --repeats 1 --max-new-tokens 4 > /dev/null
for round in $(seq 1 "$RUNS"); do
  if [ $((round % 2)) -eq 1 ]; then
    measure "$round" layerwise "$LAYERWISE"; measure "$round" after "$AFTER"
  else
    measure "$round" after "$AFTER"; measure "$round" layerwise "$LAYERWISE"
  fi
done

python3 - "$OUT" <<'PY' | tee "$OUT/summary.md"
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1] + "/results.csv")))
# TTFT: the prefill node answers the first token before its push ends, so the push shows in
# what follows it: first token -> last token (e2e - TTFT), which waits for the decode node to
# hold every layer.
figures = {"TTFT": lambda r: float(r["ttft_ms_median"]),
           "first token -> last": lambda r: float(r["e2e_ms_median"]) - float(r["ttft_ms_median"])}
print("| prompt tokens | figure | layer-wise ms (median, min-max) | push after prefill | per-round ratio after/layer-wise (median, min-max) |")
print("|---|---|---|---|---|")
for n in sorted({int(r["prompt_tokens"]) for r in rows}):
    for name, get in figures.items():
        by = lambda m: {r["round"]: get(r) for r in rows if r["mode"] == m and int(r["prompt_tokens"]) == n}
        a, b = by("layerwise"), by("after")
        ratios = [b[k] / a[k] for k in a if k in b]
        fmt = lambda v: f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"
        print(f"| {n} | {name} | {fmt(list(a.values()))} | {fmt(list(b.values()))} | {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |")
PY
echo "results: $OUT"
