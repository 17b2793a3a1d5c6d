#!/usr/bin/env bash
# Issue 5's overhead check: closed-loop throughput of a 1P+1D cluster with tracing off against
# the same cluster exporting OTLP to a closed port (a dead collector), alternating runs, in one
# session. A tiny random model (2 layers, hidden 64, SmolLM2's vocab) keeps per-request work
# small, so per-span costs show as much as they can. MODEL=DIR measures another model instead.
# Besides throughput (which swings by about ±5% between runs on a shared machine), each run
# records the CPU time the cluster's processes spent per request, read from /proc: the cost
# that tracing adds, whatever else the machine is doing. RUNS=N sets the runs per mode (3).
# Output: .bench/otlp-<time>/results.csv and a summary line with medians and their ratios.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -p deploy -p loadtest
M=${MODEL:-.models/tiny-49k}
if [ ! -f "$M/model.safetensors" ] && [ -z "${MODEL:-}" ]; then
  spec=$(mktemp)
  cat > "$spec" <<'JSON'
{"architecture":"LlamaForCausalLM","hidden":64,"layers":2,"heads":4,"kv_heads":2,"head_dim":16,"ffn":128,
 "vocab":49152,"max_pos":2048,"rope_theta":10000.0,"rope_scaling":null,"rope_layout":"top_level",
 "attention_bias":false,"tie_word_embeddings":true,"sliding_window":null,"dtype":"float32",
 "init_std":0.02,"seed":0}
JSON
  target/release/fission make-random-model --spec-json "$spec" --out "$M" \
    --tokenizer-from ../shared/models/stories260K
fi
OUT=.bench/otlp-$(date +%Y%m%d-%H%M%S)
mkdir -p "$OUT"
echo "run,mode,req_per_s,tokens_per_s,cpu_ms_per_req" > "$OUT/results.csv"
# CPU ticks (user + system) of the given processes.
cpu_ticks() { local t=0 p; for p in "$@"; do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done; echo $t; }
hz=$(getconf CLK_TCK)
closed_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
for run in $(seq "${RUNS:-3}"); do
  # ABBA order: whatever drifts across a session (or the run before) hits both modes alike.
  order="off dead"
  [ $((run % 2)) = 0 ] && order="dead off"
  for mode in $order; do
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    env_args=(env -u OTEL_EXPORTER_OTLP_ENDPOINT)
    [ "$mode" = dead ] && env_args=(env OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:$closed_port")
    "${env_args[@]}" target/release/fission up --model "$M" --port "$port" \
      --node-arg=--num-kv-blocks=1024 > "$OUT/up-$mode-$run.log" 2>&1 &
    up=$!
    until grep -q "Fission is up" "$OUT/up-$mode-$run.log"; do
      kill -0 $up 2>/dev/null || { echo "fission up failed"; cat "$OUT/up-$mode-$run.log"; exit 1; }
      sleep 0.2
    done
    # The gateway and the nodes are `fission up`'s children; warm up, then measure 20 s.
    pids=$(pgrep -P $up | tr '\n' ' ')
    target/release/fission-loadtest --url "http://127.0.0.1:$port" closed-loop \
      --concurrency 8 --warmup-s 0 --duration-s 3 --prompt-tokens 64 --max-new-tokens 32 >/dev/null
    t0=$(cpu_ticks $pids)
    out=$(target/release/fission-loadtest --url "http://127.0.0.1:$port" closed-loop \
      --concurrency 8 --warmup-s 0 --duration-s 20 --prompt-tokens 64 --max-new-tokens 32)
    t1=$(cpu_ticks $pids)
    kill -TERM $up; wait $up || true
    line=$(echo "$out" | grep throughput)
    ok=$(echo "$out" | grep -oE 'requests ok [0-9]+' | awk '{print $3}')
    rps=$(echo "$line" | awk '{print $3}'); tps=$(echo "$line" | awk '{print $5}')
    cpu=$(python3 -c "print(f'{($t1 - $t0) * 1000 / $hz / max($ok, 1):.3f}')")
    echo "$run,$mode,$rps,$tps,$cpu" >> "$OUT/results.csv"
    echo "run $run $mode: $line, cluster CPU $cpu ms per request"
  done
done
python3 - "$OUT/results.csv" <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
def med(mode, col):
    return statistics.median(float(r[col]) for r in rows if r["mode"] == mode)
tps = {m: med(m, "tokens_per_s") for m in ("off", "dead")}
cpu = {m: med(m, "cpu_ms_per_req") for m in ("off", "dead")}
print(f"median tokens/s: tracing off {tps['off']:.1f}, OTLP to a closed port {tps['dead']:.1f}, ratio {tps['dead']/tps['off']:.3f}")
print(f"median cluster CPU per request: tracing off {cpu['off']:.2f} ms, OTLP to a closed port {cpu['dead']:.2f} ms, ratio {cpu['dead']/cpu['off']:.3f}")
# Each run's pair ran back to back, so its ratio cancels the drift between runs.
pairs = sorted(
    float(d["tokens_per_s"]) / float(o["tokens_per_s"])
    for d in rows if d["mode"] == "dead"
    for o in rows if o["mode"] == "off" and o["run"] == d["run"]
)
print("per-run tokens/s ratios (dead/off): " + ", ".join(f"{r:.3f}" for r in pairs)
      + f"; median {statistics.median(pairs):.3f}")
PY
