#!/usr/bin/env bash
# Installs what building, running and testing Fission need on a fresh Debian machine.
# Idempotent: each step is skipped when its tool is already there.
set -euo pipefail

# A CI runner may start us with a bare environment: no PATH or HOME (cargo and rustup need
# HOME, and `set -u` would stop at the first use of either).
# (`env -i bash` sets a PATH of its own that ends in `.`: drop that entry.)
PATH="${PATH:-/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin}"
PATH="${PATH%:.}"
export PATH
if [ -z "${HOME:-}" ]; then
  HOME="$( (getent passwd "$(id -u)" || true) | cut -d: -f6)"
  if [ -z "$HOME" ]; then
    # No passwd entry (an arbitrary-uid container): root's home, or a fresh one.
    if [ "$(id -u)" -eq 0 ]; then HOME=/root; else HOME="$(mktemp -d)"; fi
  fi
  export HOME
fi

need_apt=()
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)
command -v protoc >/dev/null 2>&1 || need_apt+=(protobuf-compiler)
# etcd-client's build needs protobuf's well-known .proto files too.
[ -f /usr/include/google/protobuf/descriptor.proto ] || need_apt+=(libprotobuf-dev)
command -v cc >/dev/null 2>&1 || need_apt+=(build-essential)
command -v pkg-config >/dev/null 2>&1 || need_apt+=(pkg-config)
command -v curl >/dev/null 2>&1 || need_apt+=(curl ca-certificates)
command -v python3 >/dev/null 2>&1 || need_apt+=(python3 python3-venv)
# `ip netns` and veth pairs: deploy/tests/multi_host.rs gives each process its own address.
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
# python3 can be present without its venv module (Debian splits it out).
python3 -c 'import venv, ensurepip' 2>/dev/null || need_apt+=(python3-venv)

if [ ${#need_apt[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "installing with apt: ${need_apt[*]}" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null 2>&1; then
  if [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
  else
    echo "installing the Rust toolchain with rustup" >&2
    curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --component rustfmt,clippy
    export PATH="$HOME/.cargo/bin:$PATH"
  fi
fi
# The tests run clippy: a toolchain installed without it gets it here.
if ! cargo clippy --version >/dev/null 2>&1 && command -v rustup >/dev/null 2>&1; then
  echo "adding clippy to the Rust toolchain" >&2
  rustup component add clippy
fi
