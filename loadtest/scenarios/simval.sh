#!/usr/bin/env bash
# The simulator against real runs (issue 15): a cost profile calibrated on this machine, the
# same seeded workload against a real 1P+1D cluster and a real cluster of 2 colocated nodes,
# then simulated with the same flags; prints p50/p90 TTFT and TPOT, real and simulated.
# The recipe of loadtest/README.md ("Checking the simulator against real runs"), as one script.
#
#   loadtest/scenarios/simval.sh            # OUT=.bench/simval-DATE, RATE=1, DURATION=60s
#
# Needs `cargo build --release` (fission, fission-loadtest) and jq. Each real run is bounded
# by DURATION and stops its cluster; ports are free ones on loopback.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.bench/simval-$(date +%Y%m%d-%H%M%S)}
M=${MODEL:-.models/smollm2-135m-random}
RATE=${RATE:-1}
DURATION=${DURATION:-60s}
BLOCKS=${BLOCKS:-1024}
BIN=target/release
mkdir -p "$OUT"
lscpu > "$OUT/lscpu.txt"
[ -f "$M/config.json" ] || $BIN/fission make-random-model --shape smollm2-135m --out "$M"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

echo "== calibrating a node alone (2 threads), and the QUIC push beside its prefill steps"
$BIN/fission-loadtest simulate calibrate --model "$M" --kv-blocks "$BLOCKS" --measure-link quic \
  --out "$OUT/local.json" 2>&1 | tee "$OUT/calibrate.txt"

W=(--workload sharegpt --input-len 128 --output-len 64 --max-input-len 1024 --max-output-len 256
   --seed 1 --duration "$DURATION" --slo-ttft-ms 2000 --slo-tpot-ms 200)

real() {
  local name=$1; shift
  local port; port=$(free_port)
  $BIN/fission up --model "$M" --port "$port" "$@" --node-arg=--num-kv-blocks="$BLOCKS" \
    > "$OUT/$name-up.log" 2>&1 &
  local up=$!
  local i=0
  until curl -sf "127.0.0.1:$port/health" > /dev/null; do
    i=$((i + 1)); [ $i -lt 240 ] || { echo "cluster $name not up"; kill $up; exit 1; }
    sleep 0.5
  done
  echo "== real $name"
  $BIN/fission-loadtest --url "http://127.0.0.1:$port" --rate "$RATE" "${W[@]}" \
    --json "$OUT/real-$name.json" > "$OUT/real-$name.txt"
  kill -INT $up; wait $up || true
}
real 1p1d --prefill 1 --decode 1
real 2c --prefill 0 --decode 2

H=(--shared-host-cores 2 --threads-per-node 2)
$BIN/fission-loadtest simulate --profile "$OUT/local.json" --cluster 1P+1D --rate "$RATE" "${W[@]}" \
  "${H[@]}" --json "$OUT/sim-1p1d.json" > "$OUT/sim-1p1d.txt"
$BIN/fission-loadtest simulate --profile "$OUT/local.json" --cluster 2C --rate "$RATE" "${W[@]}" \
  "${H[@]}" --json "$OUT/sim-2c.json" > "$OUT/sim-2c.txt"

q='.levels[0].summary | [.ttft_ms.p50, .ttft_ms.p90, .tpot_ms.p50, .tpot_ms.p90]'
{
  echo "| config | figure | real ms | sim ms | sim / real |"
  echo "|---|---|---:|---:|---:|"
  for c in 1p1d 2c; do
    paste <(jq -r "$q | .[]" "$OUT/real-$c.json") <(jq -r "$q | .[]" "$OUT/sim-$c.json") \
      <(printf 'TTFT p50\nTTFT p90\nTPOT p50\nTPOT p90\n') |
      awk -v c=$c -F'\t' '{ printf "| %s | %s | %.1f | %.1f | %.2f |\n", c, $3, $1, $2, $2 / $1 }'
  done
} | tee "$OUT/table.md"
