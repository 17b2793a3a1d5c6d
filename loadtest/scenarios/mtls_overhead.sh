#!/usr/bin/env bash
# Issue 12's cost check: a 1P+1D cluster whose gRPC is mutual TLS with role checks (every
# process holds a certificate from one CA, `fission certs`), against the same cluster with
# plaintext gRPC (`--insecure`), alternating runs in ABBA order in one session. The KV path is
# TCP in both, so the only difference is the gRPC channels (gateway -> nodes, prefill ->
# decode). Per run: closed-loop tokens/s (8 clients, 64-token prompts, 32 new tokens, 20 s
# after a 3 s warm-up), the cluster's CPU per request from /proc, and sequential TTFT medians
# (64- and 512-token prompts). The tiny random model keeps per-request work small, so per-call
# TLS costs show as much as they can; MODEL=DIR measures another model. RUNS=N runs per mode (3).
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

start_cluster() { # mode run -> sets URL
  local mode=$1 run=$2 cluster="c$run$1" role
  for role in prefill decode; do
    "$BIN/fission" node start --role $role --model "$M" --etcd "$ETCD" --cluster "$cluster" \
      --node-id "$role-0" --num-kv-blocks 1024 --kv-transport tcp \
      --grpc-addr "127.0.0.1:$(port)" --metrics-addr "127.0.0.1:$(port)" $(creds "$mode" $role) \
      >"$OUT/$role-$mode-$run.out" 2>"$OUT/$role-$mode-$run.log" &
    PIDS+=($!)
  done
  GW_PORT=$(port)
  "$BIN/fission" gateway --addr "127.0.0.1:$GW_PORT" --model-dir "$M" --etcd "$ETCD" \
    --cluster "$cluster" $(creds "$mode" gateway) >/dev/null 2>"$OUT/gateway-$mode-$run.log" &
  PIDS+=($!)
  URL="http://127.0.0.1:$GW_PORT"
  local t0=$SECONDS
  until [ "$(curl -s "$URL/info" | grep -o '"ready":true' | wc -l)" -ge 2 ]; do
    [ $((SECONDS - t0)) -lt 120 ] || { echo "cluster $mode did not come up"; tail "$OUT"/*-"$mode-$run".log; exit 1; }
    sleep 0.2
  done
}

echo "run,mode,req_per_s,tokens_per_s,cpu_ms_per_req,ttft64_ms,ttft512_ms" > "$OUT/results.csv"
for run in $(seq "${RUNS:-3}"); do
  order="plain mtls"
  [ $((run % 2)) = 0 ] && order="mtls plain"
  for mode in $order; do
    start_cluster "$mode" "$run"
    "$BIN/fission-loadtest" --url "$URL" closed-loop --concurrency 8 --warmup-s 0 \
      --duration-s 3 --prompt-tokens 64 --max-new-tokens 32 >/dev/null
    t0=$(cpu_ticks "${PIDS[@]}")
    out=$("$BIN/fission-loadtest" --url "$URL" closed-loop --concurrency 8 --warmup-s 0 \
      --duration-s 20 --prompt-tokens 64 --max-new-tokens 32)
    t1=$(cpu_ticks "${PIDS[@]}")
    ttft=$("$BIN/fission-loadtest" --url "$URL" ttft --prompt-tokens 64,512 --repeats 9 --max-new-tokens 4)
    stop_cluster
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
PY
echo "results: $OUT/results.csv"
