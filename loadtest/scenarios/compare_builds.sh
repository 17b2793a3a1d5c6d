#!/usr/bin/env bash
# Two builds of Fission side by side in one session, ABBA order, on two paths:
#   - end to end: closed-loop tokens/s, requests/s, TTFT and TPOT medians, and cluster CPU per
#     request of `fission up` (1P+1D, QUIC) on a tiny random model (2 layers, SmolLM2's vocab),
#     8 clients, 64-token prompts, 32 new tokens, 20 s windows after a 3 s warm-up;
#   - the engine: `fission bench engine` on stories260K (prefill 128, decode single stream and
#     batch 1 and 32), medians of 5 repeats per run.
# Use an even RUNS: each build then goes first as often as second (on these machines the
# second run of a back-to-back pair is often the slower one, whichever build it is), and a
# pause (PAUSE_S, 5) lets the previous cluster's processes and sockets go.
# Usage: compare_builds.sh BASE_FISSION NEW_FISSION   (paths of the two `fission` binaries; the
# load generator is this tree's). RUNS=N pairs per path (4). LOADTEST=PATH uses that load
# generator as it is, without building this tree first (on a machine others are building on).
# Output: .bench/compare-<time>/ with results.csv, load-*.json (every request), engine-*.json
# and a summary of medians, per-pair ratios and their spread.
set -euo pipefail
cd "$(dirname "$0")/../.."
BASE=$(realpath "$1")
NEW=$(realpath "$2")
if [ -z "${LOADTEST:-}" ]; then
  # A workspace build: `-p loadtest` alone would resolve features differently and rebuild.
  cargo build --release --workspace --all-targets
  LOADTEST=target/release/fission-loadtest
fi
LOADTEST=$(realpath "$LOADTEST")
M=${MODEL:-.models/tiny-49k}
source loadtest/scenarios/tiny_model.sh
[ -n "${MODEL:-}" ] || tiny_model "$NEW" "$M"
STORIES=${STORIES:-../shared/models/stories260K}
OUT=.bench/compare-$(date +%Y%m%d-%H%M%S)
mkdir -p "$OUT"
lscpu > "$OUT/lscpu.txt"
echo "run,build,req_per_s,tokens_per_s,ttft_p50_ms,tpot_p50_ms,cpu_ms_per_req" > "$OUT/results.csv"
cpu_ticks() { local t=0 p; for p in "$@"; do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done; echo $t; }
hz=$(getconf CLK_TCK)
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

e2e() { # build-name binary run
  local name=$1 bin=$2 run=$3 port up pids t0 t1 json vals ok rps tps ttft tpot cpu
  port=$(free_port)
  "$bin" up --model "$M" --port "$port" --node-arg=--num-kv-blocks=1024 > "$OUT/up-$name-$run.log" 2>&1 &
  up=$!
  until grep -qs "Fission is up" "$OUT/up-$name-$run.log"; do
    kill -0 $up 2>/dev/null || { echo "fission up failed"; cat "$OUT/up-$name-$run.log"; exit 1; }
    sleep 0.2
  done
  pids=$(pgrep -P $up | tr '\n' ' ')
  $LOADTEST --url "http://127.0.0.1:$port" closed-loop --concurrency 8 --warmup-s 0 --duration-s 3 \
    --prompt-tokens 64 --max-new-tokens 32 >/dev/null
  # The measured window: the same closed loop and requests (TGI's stream, `<extra_N>`
  # prompts), through the mode that records every request, so TTFT and TPOT come with it.
  json="$OUT/load-$name-$run.json"
  t0=$(cpu_ticks $pids)
  $LOADTEST --url "http://127.0.0.1:$port" --api tgi --prompt-style extra --concurrency 8 \
    --duration 20s --input-len 64 --output-len 32 --warmup-requests 0 --quiet --json "$json" \
    > "$OUT/load-$name-$run.log"
  t1=$(cpu_ticks $pids)
  kill -TERM $up; wait $up || true
  sleep "${PAUSE_S:-5}"
  vals=$(python3 - "$json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))["levels"][0]["summary"]
if s["failed"]:
    sys.exit(f"{s['failed']} requests failed: {s['errors']}")
print(s["ok"], f"{s['throughput_rps']:.2f}", f"{s['output_tokens_per_s']:.1f}",
      f"{s['ttft_ms']['p50']:.2f}", f"{s['tpot_ms']['p50']:.3f}")
PY
)
  read -r ok rps tps ttft tpot <<< "$vals"
  cpu=$(python3 -c "print(f'{($t1 - $t0) * 1000 / $hz / max($ok, 1):.3f}')")
  echo "$run,$name,$rps,$tps,$ttft,$tpot,$cpu" >> "$OUT/results.csv"
  echo "e2e run $run $name: $tps tokens/s, $rps req/s, TTFT p50 $ttft ms, TPOT p50 $tpot ms, $cpu ms CPU/request"
}

for run in $(seq "${RUNS:-4}"); do
  # ABBA: whatever drifts across the session hits both builds alike.
  if [ $((run % 2)) = 1 ]; then order="base new"; else order="new base"; fi
  for name in $order; do
    bin=$BASE; [ "$name" = new ] && bin=$NEW
    e2e "$name" "$bin" "$run"
  done
done
for run in $(seq "${RUNS:-4}"); do
  if [ $((run % 2)) = 1 ]; then order="base new"; else order="new base"; fi
  for name in $order; do
    bin=$BASE; [ "$name" = new ] && bin=$NEW
    "$bin" bench engine --model "$STORIES" --prefill 128 --batch 1,32 --repeats 5 \
      --out "$OUT/engine-$name-$run.json" > "$OUT/engine-$name-$run.log" 2>&1
    echo "engine run $run $name done"
  done
done
python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import csv, glob, json, statistics, sys
out = sys.argv[1]
rows = list(csv.DictReader(open(f"{out}/results.csv")))
def med(build, col):
    return statistics.median(float(r[col]) for r in rows if r["build"] == build)
def spread(build, col):
    v = [float(r[col]) for r in rows if r["build"] == build]
    return f"{min(v):.2f}-{max(v):.2f}"
for col, label in [("tokens_per_s", "tokens/s"), ("req_per_s", "requests/s"),
                   ("ttft_p50_ms", "TTFT p50 ms"), ("tpot_p50_ms", "TPOT p50 ms"),
                   ("cpu_ms_per_req", "cluster CPU ms/request")]:
    b, n = med("base", col), med("new", col)
    pairs = sorted(float(x[col]) / float(y[col]) for x in rows if x["build"] == "new"
                   for y in rows if y["build"] == "base" and y["run"] == x["run"])
    print(f"end to end {label}: base {b:.2f} ({spread('base', col)}), new {n:.2f} "
          f"({spread('new', col)}), ratio of medians {n/b:.3f}; "
          f"per-run ratios {', '.join(f'{p:.3f}' for p in pairs)}")
def figures(path):
    flat = {}
    for k, v in json.load(open(path)).items():
        if isinstance(v, dict):
            flat.update({f"{k}[{kk}]": vv for kk, vv in v.items()})
        elif isinstance(v, (int, float)):
            flat[k] = v
    return flat
eng = {b: [figures(p) for p in sorted(glob.glob(f"{out}/engine-{b}-*.json"))] for b in ("base", "new")}
for key in sorted(eng["base"][0]) if eng["base"] else []:
    if key not in eng["new"][0]:
        continue
    b = [r[key] for r in eng["base"]]; n = [r[key] for r in eng["new"]]
    ratios = sorted(x / y for x, y in zip(n, b) if y)
    print(f"engine {key}: base median {statistics.median(b):.1f}, new median {statistics.median(n):.1f}, "
          f"ratio {statistics.median(n)/statistics.median(b):.3f}, per-run ratios {min(ratios):.3f}-{max(ratios):.3f}")
PY
