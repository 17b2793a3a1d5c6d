#!/usr/bin/env bash
# Fuzzes the trust boundary with libFuzzer (cargo fuzz), one target at a time.
#
#   fuzz/run.sh [TARGET...]         run each target (all by default) for FUZZ_SECONDS (60)
#   fuzz/run.sh cmin [TARGET...]    fold what the runs found into the committed corpus, minimised
#
# A run starts from the committed corpus (fuzz/corpus/TARGET) and the inputs that once broke
# the target (fuzz/regressions/TARGET), and writes what it finds to fuzz/work/corpus/TARGET,
# which git ignores; crashes land in fuzz/artifacts/TARGET. Commit a crash's input to
# fuzz/regressions/TARGET once it is fixed, and the corpus after `cmin`:
# `cargo test --release -p fuzz-harness` replays both.
#
# Settings: FUZZ_SECONDS (60 per target), FUZZ_SANITIZER (none: the code is safe Rust, where a
# bug is a panic, and AddressSanitizer halves the executions; "address" turns it on),
# FUZZ_TOOLCHAIN (nightly), FUZZ_ARGS (more libFuzzer flags).
set -euo pipefail
cd "$(dirname "$0")"

FUZZ_SECONDS=${FUZZ_SECONDS:-60}
FUZZ_SANITIZER=${FUZZ_SANITIZER:-none}
FUZZ_TOOLCHAIN=${FUZZ_TOOLCHAIN:-nightly}
# Its own target directory: instrumented builds never touch the workspace's.
export CARGO_TARGET_DIR="$PWD/target"

if ! cargo "+$FUZZ_TOOLCHAIN" fuzz --version >/dev/null 2>&1; then
  echo "cargo fuzz on $FUZZ_TOOLCHAIN is missing: rustup toolchain install $FUZZ_TOOLCHAIN && cargo install cargo-fuzz" >&2
  exit 1
fi
# The workspace's versions, so that the fuzzed code is the code that ships (cargo then adds
# libfuzzer-sys, which makes the copy newer until the workspace's lock changes again).
if [[ ! -f Cargo.lock || ../Cargo.lock -nt Cargo.lock ]]; then
  cp ../Cargo.lock Cargo.lock
fi

mode=run
if [[ ${1:-} == cmin ]]; then
  mode=cmin
  shift
fi
if (($# > 0)); then
  targets=("$@")
else
  mapfile -t targets < <(cargo "+$FUZZ_TOOLCHAIN" fuzz list)
fi
# -a: debug assertions and overflow checks, so that arithmetic overflow is a crash too.
build_flags=(-s "$FUZZ_SANITIZER" -a)

dict_for() {
  case $1 in
    http_* | chat_template) echo "-dict=http.dict" ;;
  esac
}

corpus_dirs() {
  local dirs=("corpus/$1")
  [[ -d regressions/$1 ]] && dirs+=("regressions/$1")
  echo "${dirs[@]}"
}

bytes() {
  find "$1" -type f -printf '%s\n' | awk '{ sum += $1 } END { print sum + 0 }'
}

if [[ $mode == cmin ]]; then
  for target in "${targets[@]}"; do
    merged="work/cmin/$target"
    rm -rf "$merged"
    mkdir -p "$merged" "corpus/$target"
    find "corpus/$target" "work/corpus/$target" -maxdepth 1 -type f -exec cp -t "$merged" {} + 2>/dev/null || true
    # The smallest set of files that covers every edge (not every hit count of every edge,
    # which keeps thousands): a corpus small enough to commit and to replay in CI.
    cargo "+$FUZZ_TOOLCHAIN" fuzz cmin "${build_flags[@]}" "$target" "$merged" -- \
      -timeout=20 -set_cover_merge=1 -use_counters=0
    rm -f "corpus/$target"/*
    cp "$merged"/* "corpus/$target/"
    echo "$target: $(find "corpus/$target" -type f | wc -l) files, $(bytes "corpus/$target") bytes"
  done
  echo "committed corpus: $(find corpus -type f | wc -l) files, $(bytes corpus) bytes in all"
  exit 0
fi

cargo "+$FUZZ_TOOLCHAIN" fuzz build "${build_flags[@]}"

summary=()
failed=()
for target in "${targets[@]}"; do
  mkdir -p "work/corpus/$target"
  log="work/$target.log"
  echo "== $target: ${FUZZ_SECONDS}s"
  # shellcheck disable=SC2046 # corpus_dirs and dict_for give whole words
  if ! cargo "+$FUZZ_TOOLCHAIN" fuzz run "${build_flags[@]}" "$target" \
    "work/corpus/$target" $(corpus_dirs "$target") -- \
    -max_total_time="$FUZZ_SECONDS" -timeout=20 -rss_limit_mb=4096 -print_final_stats=1 \
    $(dict_for "$target") ${FUZZ_ARGS:-} >"$log" 2>&1; then
    failed+=("$target")
    echo "   FAILED: see $log and fuzz/artifacts/$target/"
    grep -m1 -A12 "panicked at\|ERROR: libFuzzer" "$log" | sed 's/^/   /' || true
  fi
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
  rate=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
  start_cov=$(grep -m1 'INITED' "$log" | grep -o 'cov: [0-9]*' | grep -o '[0-9]*' || echo "?")
  last=$(grep ' cov: ' "$log" | tail -1)
  cov=$(grep -o 'cov: [0-9]*' <<<"$last" | grep -o '[0-9]*' || echo "?")
  ft=$(grep -o 'ft: [0-9]*' <<<"$last" | grep -o '[0-9]*' || echo "?")
  corp=$(grep -o 'corp: [0-9]*/[0-9a-zA-Z]*' <<<"$last" | cut -d' ' -f2 || echo "?")
  summary+=("$(printf '%-18s %12s %8s %14s %8s %12s' "$target" "$execs" "$rate" "$start_cov -> $cov" "$ft" "$corp")")
done

echo
printf '%-18s %12s %8s %14s %8s %12s\n' target execs exec/s "cov (edges)" features corpus
printf '%s\n' "${summary[@]}"
if ((${#failed[@]} > 0)); then
  echo "crashed: ${failed[*]}"
  exit 1
fi
