#!/usr/bin/env bash
# Compiles every kernels/cuda/*.cu to PTX with nvcc from PyPI, so that a kernel that does not
# compile fails CI even though CI has no GPU and no apt CUDA. `.ci/run` calls this when
# FISSION_CHECK_CUDA=1.
#
# nvcc comes from the `nvidia-cuda-nvcc` CUDA 13 wheel (the CUDA 12 wheels have no nvcc driver),
# installed once into a venv under CUDA_DIR (default .peers/cuda-venv, which git ignores), with
# the wheels nvcc needs beside it: cicc (nvidia-nvvm), the crt headers and the runtime headers.
# The flags are those of kernels/build.rs; FISSION_CUDA_ARCH overrides compute_90. PTX goes to
# a temporary folder: this checks, it does not build.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
CUDA_DIR=${CUDA_DIR:-.peers/cuda-venv}
ARCH=${FISSION_CUDA_ARCH:-compute_90}

if [ ! -x "$CUDA_DIR/bin/python" ]; then
  python3 -m venv "$CUDA_DIR"
fi
NVCC="$CUDA_DIR/wheels/nvidia/cu13/bin/nvcc"
if [ ! -x "$NVCC" ]; then
  echo "installing nvcc from PyPI into $CUDA_DIR"
  "$CUDA_DIR/bin/pip" install -q --target "$CUDA_DIR/wheels" \
    'nvidia-cuda-nvcc==13.0.*' 'nvidia-nvvm==13.0.*' 'nvidia-cuda-crt==13.0.*' \
    'nvidia-cuda-runtime==13.0.*' 'nvidia-cuda-cccl==13.0.*'
fi
[ -x "$NVCC" ] || { echo "nvcc not found at $NVCC after installing nvidia-cuda-nvcc"; exit 1; }
echo "nvcc: $("$NVCC" --version | tail -1)"

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
failed=0
for cu in kernels/cuda/*.cu; do
  name=$(basename "$cu" .cu)
  t0=$(date +%s)
  # --Werror all-warnings: a warning in a kernel is as good as a bug report.
  if "$NVCC" --ptx -O3 -std=c++17 -arch="$ARCH" --Werror all-warnings \
      -o "$out/$name.ptx" "$cu"; then
    echo "ok   $cu ($(( $(date +%s) - t0 )) s, $(grep -c '^.visible .entry' "$out/$name.ptx") kernels)"
  else
    echo "FAIL $cu"
    failed=1
  fi
done
echo "check-cuda: PTX in $(( $(date +%s) - start )) s"

# Then the Rust side: `cargo check --features cuda` of the crates that launch the kernels
# (engine's device ops, node-common's GPU memory sizing, the binaries), against the full PyPI
# toolkit of ../shared/cuda (cudarc and candle's build scripts need cublas, curand and nvrtc
# too). Measured 507 s from an empty target dir on 2 shared cores (candle's kernels are most
# of it), so it stays out of ./deploy/test.sh. FISSION_CHECK_CUDA_CARGO=0 skips it.
if [ "${FISSION_CHECK_CUDA_CARGO:-1}" = 1 ]; then
  t0=$(date +%s)
  TOOLKIT=${CUDA_TOOLKIT_DIR:-.peers/cuda-toolkit}
  if [ ! -f "$TOOLKIT/env.sh" ]; then
    cargo fetch
    ../shared/cuda/setup-cuda-toolkit.sh "$TOOLKIT"
  fi
  # shellcheck disable=SC1091
  if (source "$TOOLKIT/env.sh" && CARGO_TARGET_DIR=target/cuda-check \
        cargo check --release --features cuda -p kernels -p engine -p node-common -p deploy); then
    echo "ok   cargo check --features cuda ($(( $(date +%s) - t0 )) s)"
  else
    echo "FAIL cargo check --features cuda"
    failed=1
  fi
fi
echo "check-cuda: $(( $(date +%s) - start )) s"
exit $failed
