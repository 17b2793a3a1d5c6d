#!/usr/bin/env bash
# Soak under faults (not in CI): open-loop load for DURATION_S (600 by default) on a cluster of
# 2 prefill + 2 decode nodes (a tiny random model, KV over TCP, etcd leases of 3 s), with a fault every
# FAULT_EVERY_S (30) chosen at random from:
#   kill-prefill   SIGKILL a prefill node, start it again
#   kill-decode    SIGKILL a decode node, start it again
#   stop-decode    SIGSTOP a decode node for 10 s, then SIGCONT
#   stop-prefill   SIGSTOP a prefill node for 10 s, then SIGCONT
#   stop-etcd      SIGSTOP etcd for 15 s, then SIGCONT
# It reports the load's outcomes (fission-loadtest open-loop), each fault with its recovery time
# (until the gateway lists every node ready again), the nodes' RSS at the start and the end,
# and the KV blocks still held once the load is over (must be 0).
#
# Usage: loadtest/scenarios/soak.sh [OUT_DIR]   (env: DURATION_S, FAULT_EVERY_S, RATE, SEED)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-.bench/soak-$(date +%Y%m%d-%H%M%S)}
DURATION_S=${DURATION_S:-600}
FAULT_EVERY_S=${FAULT_EVERY_S:-30}
RATE=${RATE:-8}
SEED=${SEED:-$$}
RANDOM=$SEED
mkdir -p "$OUT"
cargo build --release -p deploy -p loadtest >/dev/null
BIN=target/release
# The load generator's prompts are `<extra_N>` tokens of a padded 49k vocab: the same tiny
# random model as compare_builds.sh (loadtest/scenarios/tiny_model.sh).
MODEL=${MODEL:-.models/tiny-49k}
source loadtest/scenarios/tiny_model.sh
tiny_model "$BIN/fission" "$MODEL"
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

ETCD_PORT=$(port); ETCD_PEER=$(port)
etcd --data-dir "$OUT/etcd" --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
  --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
  --listen-peer-urls "http://127.0.0.1:$ETCD_PEER" >"$OUT/etcd.log" 2>&1 &
ETCD_PID=$!
ETCD="http://127.0.0.1:$ETCD_PORT"
# Mutual-TLS gRPC, as in production: a CA and a certificate per process (`fission certs`).
"$BIN/fission" certs init --out "$OUT/tls" >/dev/null
certs() { # role name: prints the process's --tls-* flags
  "$BIN/fission" certs issue --ca-cert "$OUT/tls/ca.pem" --ca-key "$OUT/tls/ca.key" \
    --role "$1" --name "$2" --out "$OUT/tls" >/dev/null
  echo "--tls-ca $OUT/tls/ca.pem --tls-cert $OUT/tls/$2.pem --tls-key $OUT/tls/$2.key"
}
declare -A PID METRICS
cleanup() {
  kill -CONT "$ETCD_PID" 2>/dev/null || true
  for n in "${!PID[@]}"; do kill -CONT "${PID[$n]}" 2>/dev/null || true; kill "${PID[$n]}" 2>/dev/null || true; done
  kill "$ETCD_PID" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap cleanup EXIT
sleep 2

start_node() { # role id
  local role=$1 id=$2 m
  m=$(port)
  "$BIN/fission" node start --role "$role" --model "$MODEL" --etcd "$ETCD" --node-id "$id" \
    --num-kv-blocks 512 --kv-transport tcp --insecure --lease-ttl-s 3 --metrics-addr "127.0.0.1:$m" \
    $(certs "$role" "$id") \
    >>"$OUT/$id.out" 2>>"$OUT/$id.log" &
  PID[$id]=$!
  METRICS[$id]="http://127.0.0.1:$m/metrics"
}
for id in prefill-0 prefill-1; do start_node prefill "$id"; done
for id in decode-0 decode-1; do start_node decode "$id"; done
GW_PORT=$(port)
"$BIN/fission" gateway --addr "127.0.0.1:$GW_PORT" --model-dir "$MODEL" --etcd "$ETCD" \
  $(certs gateway gateway) \
  >"$OUT/gateway.out" 2>"$OUT/gateway.log" &
PID[gateway]=$!
URL="http://127.0.0.1:$GW_PORT"

ready_count() {
  curl -s "$URL/info" | python3 -c 'import json,sys
try: print(sum(1 for n in json.load(sys.stdin)["backend"]["nodes"] if n["ready"]))
except Exception: print(0)'
}
wait_ready() { # timeout_s; prints seconds taken
  local t0 now
  t0=$(date +%s.%N)
  while [ "$(ready_count)" -lt 4 ]; do
    now=$(date +%s.%N)
    if (( $(echo "$now - $t0 > $1" | bc) )); then echo "timeout"; return; fi
    sleep 0.2
  done
  echo "$(date +%s.%N) - $t0" | bc
}
echo "cluster ready after $(wait_ready 120) s" | tee "$OUT/faults.log"
rss() { for n in prefill-0 prefill-1 decode-0 decode-1 gateway; do
  printf '%s=%s ' "$n" "$(ps -o rss= -p "${PID[$n]}" 2>/dev/null | tr -d ' ')"; done; echo; }
echo "rss_kib_start $(rss)" | tee -a "$OUT/faults.log"

"$BIN/fission-loadtest" --url "$URL" open-loop --rate "$RATE" \
  --duration-s "$DURATION_S" --prompt-tokens 96 --max-new-tokens 64 >"$OUT/load.txt" 2>&1 &
LOAD=$!

faults=(kill-prefill kill-decode stop-decode stop-prefill stop-etcd)
t_end=$(( $(date +%s) + DURATION_S - FAULT_EVERY_S ))
while [ "$(date +%s)" -lt "$t_end" ]; do
  sleep "$FAULT_EVERY_S"
  f=${faults[$((RANDOM % ${#faults[@]}))]}
  i=$((RANDOM % 2))
  at=$(date +%s.%N)
  case $f in
    kill-prefill) kill -KILL "${PID[prefill-$i]}"; sleep 1; start_node prefill "prefill-$i" ;;
    kill-decode) kill -KILL "${PID[decode-$i]}"; sleep 1; start_node decode "decode-$i" ;;
    stop-decode) kill -STOP "${PID[decode-$i]}"; sleep 10; kill -CONT "${PID[decode-$i]}" ;;
    stop-prefill) kill -STOP "${PID[prefill-$i]}"; sleep 10; kill -CONT "${PID[prefill-$i]}" ;;
    stop-etcd) kill -STOP "$ETCD_PID"; sleep 15; kill -CONT "$ETCD_PID" ;;
  esac
  recovered=$(wait_ready 25)
  took=$(echo "$(date +%s.%N) - $at" | bc)
  echo "fault $f node=$i recovered_after_fault_s=$took (ready $recovered s after the fault ended)" | tee -a "$OUT/faults.log"
done
wait "$LOAD" || true
echo "rss_kib_end $(rss)" | tee -a "$OUT/faults.log"
sleep 5
echo "kv gauges after the load:" | tee -a "$OUT/faults.log"
for n in prefill-0 prefill-1 decode-0 decode-1; do
  curl -s "${METRICS[$n]}" | grep -E '^fission_(decode|prefill)_(kv_blocks_used|kv_blocks_reserved|reservations_outstanding) ' \
    | sed "s/^/$n /" | tee -a "$OUT/faults.log"
done
curl -s "$URL/metrics" | grep -E '^fission_gateway_(migrations_total|prefill_retries_total|suspect_nodes_total|errors_total|queue_rejected_total)' \
  | tee -a "$OUT/faults.log" || true
{ echo "lscpu:"; lscpu; } >"$OUT/lscpu.txt"
cat "$OUT/load.txt"
# A soak whose requests all fail (a prompt the model refuses) measures nothing.
grep -qE 'requests [0-9]+ ok [1-9]' "$OUT/load.txt" || { echo "no request succeeded"; exit 1; }
