#!/usr/bin/env bash
# Goodput under SLO (issue 15): the same workload, SLOs and rate sweep against
#   disagg     fission up --prefill 1 --decode 1
#   coloc2     fission up --prefill 0 --decode 2   (two colocated nodes: the DistServe baseline)
#   coloc1     fission up --prefill 0 --decode 1   (one process, as llama-server is)
#   llama      llama.cpp's llama-server --parallel $PARALLEL on the same weights in GGUF f32
# one target at a time (each has the machine to itself), in the order given by TARGETS, each
# swept by `fission-loadtest --sweep` with the same seed, so every target sees the same requests.
# Model: the SmolLM2-135M-shaped random model, f32. Two cores: the disaggregated cluster's two
# nodes and the colocated pair each share them, so this measures scheduling, not the hardware
# split disaggregation is for; the summary says so.
# Usage: goodput.sh   (env: TARGETS, RATES, DURATION, WORKLOAD, SLO_TTFT_MS, SLO_TPOT_MS,
#        PARALLEL, MODEL). Output: .bench/goodput-<time>/ with each target's JSON, plots and
#        summary, lscpu.txt, and summary.md (one row per target).
set -euo pipefail
cd "$(dirname "$0")/../.."
TARGETS=${TARGETS:-"disagg coloc2 coloc1 llama"}
RATES=${RATES:-"0.25:1.5:8"}
DURATION=${DURATION:-30s}
WORKLOAD=${WORKLOAD:-sharegpt}
SLO_TTFT_MS=${SLO_TTFT_MS:-3000}
SLO_TPOT_MS=${SLO_TPOT_MS:-150}
PARALLEL=${PARALLEL:-8}
FISSION=$(realpath "${FISSION:-target/release/fission}")
cargo build --release -p loadtest
LOADTEST=target/release/fission-loadtest
M=${MODEL:-.models/smollm2-135m}
[ -f "$M/model.safetensors" ] || "$FISSION" make-random-model --shape smollm2-135m --out "$M"
OUT=.bench/goodput-$(date +%Y%m%d-%H%M%S)
mkdir -p "$OUT"
lscpu > "$OUT/lscpu.txt"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

server=""
stop() { [ -n "$server" ] && kill -INT "$server" 2>/dev/null && wait "$server" 2>/dev/null; server=""; }
trap stop EXIT

start() { # target port
  local log="$OUT/$1.server.log"
  case $1 in
    disagg) "$FISSION" up --model "$M" --port "$2" --prefill 1 --decode 1 --node-arg=--num-kv-blocks=2048 > "$log" 2>&1 & ;;
    coloc2) "$FISSION" up --model "$M" --port "$2" --prefill 0 --decode 2 --node-arg=--num-kv-blocks=2048 > "$log" 2>&1 & ;;
    coloc1) "$FISSION" up --model "$M" --port "$2" --prefill 0 --decode 1 --node-arg=--num-kv-blocks=2048 > "$log" 2>&1 & ;;
    llama) loadtest/peers/llama_server.sh serve "$M" "$2" "$PARALLEL" $((PARALLEL * 2048)) > "$log" 2>&1 & ;;
  esac
  server=$!
  local url="http://127.0.0.1:$2"
  for _ in $(seq 600); do
    kill -0 "$server" 2>/dev/null || { echo "$1 failed to start" >&2; tail -20 "$log" >&2; exit 1; }
    curl -sf "$url/v1/models" > /dev/null 2>&1 && [ "$(curl -s -o /dev/null -w '%{http_code}' "$url/health")" = 200 ] && return 0
    sleep 1
  done
  echo "$1 did not become ready" >&2; exit 1
}

for target in $TARGETS; do
  port=$(free_port)
  start "$target" "$port"
  # llama-server answers `ignore_eos` on /v1/completions, as Fission does: outputs are as long
  # as the workload asks.
  "$LOADTEST" --url "http://127.0.0.1:$port" --api openai-completions --workload "$WORKLOAD" \
    --prompt-style words --max-input-len 1024 --max-output-len 256 \
    --sweep "$RATES" --duration "$DURATION" --seed 7 --warmup-requests 2 \
    --slo-ttft-ms "$SLO_TTFT_MS" --slo-tpot-ms "$SLO_TPOT_MS" \
    --json "$OUT/$target.json" --plot "$OUT/$target-plots" --quiet > "$OUT/$target.md"
  stop
done

python3 - "$OUT" $TARGETS <<'PY' | tee "$OUT/summary.md"
import json, sys
out, targets = sys.argv[1], sys.argv[2:]
print("| target | goodput req/s | first miss req/s | peak output tok/s | TTFT p50 / p99 ms at goodput | TPOT p50 / p99 ms at goodput |")
print("|---|---:|---:|---:|---|---|")
for t in targets:
    d = json.load(open(f"{out}/{t}.json"))
    sweep = d.get("sweep") or {}
    g = sweep.get("goodput_rps")
    levels = [l["summary"] for l in d.get("levels", [])]
    # The level run at the goodput's rate (levels are reported sorted by rate).
    at = next((lv for lv in levels if g is not None and lv["shape"].get("rate_rps") == g), None)
    lat = lambda k: "-" if at is None else f'{at[k]["p50"]:.0f} / {at[k]["p99"]:.0f}'
    peak = max((s["output_tokens_per_s"] for s in levels), default=0.0)
    fmt = lambda v: "none" if v is None else f"{v:.2f}"
    print(f"| {t} | {fmt(g)} | {fmt(sweep.get('first_miss_rps'))} | {peak:.0f} | {lat('ttft_ms')} | {lat('tpot_ms')} |")
PY
echo "results: $OUT"
