#!/usr/bin/env bash
# Issue 5's overhead check: closed-loop throughput of a 1P+1D cluster with tracing off against
# the same cluster exporting OTLP to a closed port (a dead collector), alternating runs, in one
# session. A tiny random model (2 layers, hidden 64, SmolLM2's vocab) keeps per-request work
# small, so per-span costs show as much as they can. MODEL=DIR measures another model instead.
# Output: .bench/otlp-<time>/results.csv and a summary line with medians and their ratio.
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
echo "run,mode,req_per_s,tokens_per_s" > "$OUT/results.csv"
closed_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
for run in 1 2 3; do
  for mode in off dead; do
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
    line=$(target/release/fission-loadtest --url "http://127.0.0.1:$port" closed-loop \
      --concurrency 8 --duration-s 20 --prompt-tokens 64 --max-new-tokens 32 | grep throughput)
    kill -TERM $up; wait $up || true
    rps=$(echo "$line" | awk '{print $3}'); tps=$(echo "$line" | awk '{print $5}')
    echo "$run,$mode,$rps,$tps" >> "$OUT/results.csv"
    echo "run $run $mode: $line"
  done
done
python3 - "$OUT/results.csv" <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
med = {m: statistics.median(float(r["tokens_per_s"]) for r in rows if r["mode"] == m) for m in ("off", "dead")}
print(f"median tokens/s: tracing off {med['off']:.1f}, OTLP to a closed port {med['dead']:.1f}, ratio {med['dead']/med['off']:.3f}")
PY
