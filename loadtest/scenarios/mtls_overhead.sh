#!/usr/bin/env bash
# Issue 12's cost check: a 1P+1D cluster whose gRPC is mutual TLS with role checks (every
# process holds a certificate from one CA, `fission certs`), against the same cluster with
# plaintext gRPC (`--insecure`), both running side by side, measured in short alternating
# windows (ABBA) so that adjacent windows see the same machine. The KV path is
# TCP in both, so the only difference is the gRPC channels (gateway -> nodes, prefill ->
# decode). Per window: closed-loop tokens/s (8 clients, 64-token prompts, 32 new tokens,
# WINDOW_S=8 s), the cluster's CPU per request from /proc, and sequential TTFT medians (64- and
# 512-token prompts). The tiny random model keeps per-request work small, so per-call
# TLS costs show as much as they can; MODEL=DIR measures another model. RUNS=N windows per mode (12).
# Output: .bench/mtls-<time>/results.csv and a summary with medians and ratios.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -p deploy -p loadtest
BIN=target/release
M=${MODEL:-.models/tiny-49k}
source loadtest/scenarios/tiny_model.sh
[ -n "${MODEL:-}" ] || tiny_model "$BIN/fission" "$M"
OUT=.bench/mtls-$(date +%Y%m%d-%H%M%S)
mkdir -p "$OUT"
lscpu > "$OUT/lscpu.txt"
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
cpu_ticks() { local t=0 p; for p in "$@"; do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done; echo $t; }
hz=$(getconf CLK_TCK)

"$BIN/fission" certs init --out "$OUT/tls" >/dev/null
for r in gateway prefill decode; do
  "$BIN/fission" certs issue --ca-cert "$OUT/tls/ca.pem" --ca-key "$OUT/tls/ca.key" \
    --role $r --name $r --out "$OUT/tls" >/dev/null
done
# A process's credentials; `--insecure` on the nodes in both modes, for the TCP KV path.
creds() { # mode role
  if [ "$1" = mtls ]; then
    echo "--tls-ca $OUT/tls/ca.pem --tls-cert $OUT/tls/$2.pem --tls-key $OUT/tls/$2.key"
    [ "$2" = gateway ] || echo "--insecure"
  else echo "--insecure"; fi
}

ETCD_PORT=$(port); ETCD_PEER=$(port)
etcd --data-dir "$OUT/etcd" --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
  --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
  --listen-peer-urls "http://127.0.0.1:$ETCD_PEER" >"$OUT/etcd.log" 2>&1 &
ETCD_PID=$!
ETCD="http://127.0.0.1:$ETCD_PORT"
PIDS=()
stop_cluster() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done; PIDS=(); }
trap 'stop_cluster; kill $ETCD_PID 2>/dev/null || true' EXIT

declare -A URLS CLUSTER_PIDS
start_cluster() { # mode: both clusters run side by side, idle while the other is measured
  local mode=$1 cluster="c$1" role first=${#PIDS[@]}
  for role in prefill decode; do
    "$BIN/fission" node start --role $role --model "$M" --etcd "$ETCD" --cluster "$cluster" \
      --node-id "$role-0" --num-kv-blocks 1024 --kv-transport tcp \
      --grpc-addr "127.0.0.1:$(port)" --metrics-addr "127.0.0.1:$(port)" $(creds "$mode" $role) \
      >"$OUT/$role-$mode.out" 2>"$OUT/$role-$mode.log" &
    PIDS+=($!)
  done
  GW_PORT=$(port)
  "$BIN/fission" gateway --addr "127.0.0.1:$GW_PORT" --model-dir "$M" --etcd "$ETCD" \
    --cluster "$cluster" $(creds "$mode" gateway) >/dev/null 2>"$OUT/gateway-$mode.log" &
  PIDS+=($!)
  URLS[$mode]="http://127.0.0.1:$GW_PORT"
  CLUSTER_PIDS[$mode]="${PIDS[*]:$first}"
  local t0=$SECONDS
  until [ "$(curl -s "${URLS[$mode]}/info" | grep -o '"ready":true' | wc -l)" -ge 2 ]; do
    [ $((SECONDS - t0)) -lt 120 ] || { echo "cluster $mode did not come up"; tail "$OUT"/*-"$mode".log; exit 1; }
    sleep 0.2
  done
}
start_cluster plain
start_cluster mtls
for mode in plain mtls; do # warm-up
  "$BIN/fission-loadtest" --url "${URLS[$mode]}" closed-loop --concurrency 8 --warmup-s 0 \
    --duration-s 3 --prompt-tokens 64 --max-new-tokens 32 >/dev/null
done

# Short windows alternating ABBA: the shared machine's speed drifts over minutes, and a pair
# of adjacent windows sees the same machine.
echo "run,mode,req_per_s,tokens_per_s,cpu_ms_per_req,ttft64_ms,ttft512_ms" > "$OUT/results.csv"
for run in $(seq "${RUNS:-12}"); do
  order="plain mtls"
  [ $((run % 2)) = 0 ] && order="mtls plain"
  for mode in $order; do
    URL=${URLS[$mode]}
    read -ra pids <<< "${CLUSTER_PIDS[$mode]}"
    t0=$(cpu_ticks "${pids[@]}")
    out=$("$BIN/fission-loadtest" --url "$URL" closed-loop --concurrency 8 --warmup-s 0 \
      --duration-s "${WINDOW_S:-8}" --prompt-tokens 64 --max-new-tokens 32)
    t1=$(cpu_ticks "${pids[@]}")
    ttft=$("$BIN/fission-loadtest" --url "$URL" ttft --prompt-tokens 64,512 --repeats 5 --max-new-tokens 4)
    line=$(echo "$out" | grep throughput)
    ok=$(echo "$out" | grep -oE 'requests ok [0-9]+' | awk '{print $3}')
    failed=$(echo "$out" | grep -oE 'failed [0-9]+' | awk '{print $2}')
    [ "$failed" = 0 ] || { echo "run $run $mode: $failed requests failed"; exit 1; }
    rps=$(echo "$line" | awk '{print $3}'); tps=$(echo "$line" | awk '{print $5}')
    cpu=$(python3 -c "print(f'{($t1 - $t0) * 1000 / $hz / max($ok, 1):.3f}')")
    t64=$(echo "$ttft" | awk -F, '$1==64 {print $2}'); t512=$(echo "$ttft" | awk -F, '$1==512 {print $2}')
    echo "$run,$mode,$rps,$tps,$cpu,$t64,$t512" >> "$OUT/results.csv"
    echo "run $run $mode: $line, cluster CPU $cpu ms/request, TTFT 64: $t64 ms, 512: $t512 ms"
  done
done
python3 - "$OUT/results.csv" <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
def col(mode, c):
    return [float(r[c]) for r in rows if r["mode"] == mode]
for c, name in [("tokens_per_s", "tokens/s"), ("cpu_ms_per_req", "cluster CPU ms/request"),
                ("ttft64_ms", "TTFT 64 ms"), ("ttft512_ms", "TTFT 512 ms")]:
    p, m = col("plain", c), col("mtls", c)
    print(f"{name}: plaintext median {statistics.median(p):.2f} (range {min(p):.2f}-{max(p):.2f}), "
          f"mTLS median {statistics.median(m):.2f} (range {min(m):.2f}-{max(m):.2f}), "
          f"ratio mTLS/plaintext {statistics.median(m)/statistics.median(p):.3f}")
pairs = sorted(float(m["tokens_per_s"]) / float(p["tokens_per_s"])
               for m in rows if m["mode"] == "mtls"
               for p in rows if p["mode"] == "plain" and p["run"] == m["run"])
print("per-run tokens/s ratios (mTLS/plaintext): " + ", ".join(f"{r:.3f}" for r in pairs)
      + f"; median {statistics.median(pairs):.3f}")
cpairs = sorted(float(m["cpu_ms_per_req"]) / float(p["cpu_ms_per_req"])
                for m in rows if m["mode"] == "mtls"
                for p in rows if p["mode"] == "plain" and p["run"] == m["run"])
print("per-run CPU/request ratios (mTLS/plaintext): " + ", ".join(f"{r:.3f}" for r in cpairs)
      + f"; median {statistics.median(cpairs):.3f}")
PY
echo "results: $OUT/results.csv"
