#!/usr/bin/env bash
# Runs every test of the workspace: installs what they need, checks formatting, builds and tests.
set -euo pipefail
cd "$(dirname "$0")/.."
source deploy/install-deps.sh
export PATH="$HOME/.cargo/bin:$PATH"
# The observability tests' real backends: Arize Phoenix (OTLP traces) and promtool. With them
# required, a missing tool fails those tests instead of skipping them.
./deploy/install-test-tools.sh
export FISSION_REQUIRE_TEST_TOOLS=1

if cargo fmt --version >/dev/null 2>&1; then
  cargo fmt --all -- --check
fi
# Tests run in release: the engine tests execute real model forwards. Clippy checks the same
# profile, so it shares the build's dependencies.
cargo build --workspace --release --all-targets
cargo clippy --workspace --all-targets --release -- -D warnings
cargo test --workspace --release --no-fail-fast
