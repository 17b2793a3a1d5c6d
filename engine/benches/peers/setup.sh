#!/usr/bin/env bash
# Sets up the peer engines for the engine benchmark, under <repo>/.peers (git-ignored):
#   .peers/venv                  python venv: torch, transformers, safetensors, tokenizers, numpy,
#                                gguf, sentencepiece, protobuf (+ cmake, ninja when the system lacks them)
#   .peers/sdist/                the llama-cpp-python sdist (source only, no wheel)
#   .peers/llama.cpp/            the llama.cpp tree vendored in that sdist (convert_hf_to_gguf.py lives here)
#   .peers/llama.cpp/build/bin/  llama-bench, llama-batched-bench, llama-quantize, llama-perplexity
#   .peers/llama.cpp/build-avx2/bin/  the same, built for AVX2 without AVX-512 (LLAMA_ISA=avx2)
#
# Idempotent: every step is skipped when its output already exists. Safe to re-run after a failure.
# Environment knobs:
#   PEERS_DIR            (default <repo>/.peers)
#   LLAMA_CPP_PY_VERSION (default: latest on PyPI; BASELINES.md used 0.3.36)
#   JOBS                 (default 2: the build machine is shared)
#   LLAMA_ISA            native (default: GGML_NATIVE, whatever this CPU has) or avx2 (AVX2, FMA,
#                        F16C and BMI2, no AVX-512: the build a CPU without AVX-512 would run)
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/../../.." && pwd)"
PEERS_DIR="${PEERS_DIR:-$REPO_ROOT/.peers}"
VENV="$PEERS_DIR/venv"
SDIST_DIR="$PEERS_DIR/sdist"
LLAMA_DIR="$PEERS_DIR/llama.cpp"
LLAMA_ISA="${LLAMA_ISA:-native}"
case "$LLAMA_ISA" in
    native) BUILD_NAME=build; ISA_FLAGS=(-DGGML_NATIVE=ON) ;;
    avx2) BUILD_NAME=build-avx2
          ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                     -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF) ;;
    *) echo "LLAMA_ISA must be native or avx2, not $LLAMA_ISA" >&2; exit 2 ;;
esac
BUILD_DIR="$LLAMA_DIR/$BUILD_NAME"
JOBS="${JOBS:-2}"
PY="${PYTHON:-python3}"

log() { printf '[peers-setup] %s\n' "$*" >&2; }

mkdir -p "$PEERS_DIR"

# 1. venv ---------------------------------------------------------------------------------------
if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating venv at $VENV"
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

if [[ ! -f "$VENV/.deps-ok" ]]; then
    log "installing python packages (torch from PyPI is ~5 GB; takes a few minutes)"
    "${PIP[@]}" install -q --upgrade pip
    "${PIP[@]}" install -q torch transformers safetensors tokenizers numpy gguf sentencepiece protobuf
    "$VENV/bin/python" -c 'import torch, transformers, safetensors, tokenizers, numpy, gguf, sentencepiece'
    touch "$VENV/.deps-ok"
else
    log "python packages already installed"
fi

# 2. build tools --------------------------------------------------------------------------------
# Prefer the system's cmake/ninja; otherwise take them from PyPI into the venv (no root needed).
export PATH="$VENV/bin:$PATH"
if ! command -v cmake >/dev/null 2>&1 || ! command -v ninja >/dev/null 2>&1; then
    log "installing cmake and ninja from PyPI into the venv"
    "${PIP[@]}" install -q cmake ninja
fi
log "cmake: $(command -v cmake) ($(cmake --version | head -1)); ninja: $(command -v ninja)"

# 3. llama-cpp-python sdist -> vendored llama.cpp -----------------------------------------------
shopt -s nullglob
sdists=("$SDIST_DIR"/llama_cpp_python-*.tar.gz)
if (( ${#sdists[@]} == 0 )); then
    log "downloading the llama-cpp-python sdist"
    mkdir -p "$SDIST_DIR"
    spec="llama-cpp-python${LLAMA_CPP_PY_VERSION:+==$LLAMA_CPP_PY_VERSION}"
    # --no-binary for this one package only: with `--no-binary :all:` pip also builds the sdist's
    # build requirements (scikit-build-core -> cmake) from source just to read its metadata, which
    # bootstraps CMake from scratch (tens of minutes on 2 cores). The downloaded file is the same.
    "${PIP[@]}" download -q --no-deps --no-binary llama-cpp-python "$spec" -d "$SDIST_DIR"
    sdists=("$SDIST_DIR"/llama_cpp_python-*.tar.gz)
fi
SDIST="${sdists[-1]}"
log "sdist: $(basename "$SDIST")"

if [[ ! -f "$LLAMA_DIR/convert_hf_to_gguf.py" ]]; then
    log "extracting vendored llama.cpp to $LLAMA_DIR"
    tmp="$(mktemp -d "$PEERS_DIR/extract.XXXXXX")"
    tar -xzf "$SDIST" -C "$tmp"
    src=("$tmp"/llama_cpp_python-*/vendor/llama.cpp)
    if [[ ! -d "${src[0]:-}" ]]; then
        log "error: no vendor/llama.cpp in $SDIST"; rm -rf "$tmp"; exit 1
    fi
    rm -rf "$LLAMA_DIR"
    mv "${src[0]}" "$LLAMA_DIR"
    basename "$SDIST" > "$LLAMA_DIR/.from-sdist"
    rm -rf "$tmp"
fi

# 4. build llama-bench, llama-batched-bench, llama-quantize, llama-perplexity (KL, issue 33) ---
if [[ -x "$BUILD_DIR/bin/llama-bench" && -x "$BUILD_DIR/bin/llama-batched-bench" && -x "$BUILD_DIR/bin/llama-quantize"
      && -x "$BUILD_DIR/bin/llama-perplexity" ]]; then
    log "llama.cpp tools already built in $BUILD_DIR/bin"
else
    log "building llama.cpp (Release, ${ISA_FLAGS[*]}, -j$JOBS); this takes several minutes"
    (
        cd "$LLAMA_DIR"
        if [[ ! -f "$BUILD_NAME/build.ninja" ]]; then
            cmake -B "$BUILD_NAME" -G Ninja -DCMAKE_BUILD_TYPE=Release "${ISA_FLAGS[@]}" -DLLAMA_CURL=OFF
        fi
        nice -n 10 cmake --build "$BUILD_NAME" --target llama-batched-bench llama-bench llama-quantize llama-perplexity -j"$JOBS"
    )
fi

log "done"
log "  python:  $VENV/bin/python"
log "  llama.cpp: $LLAMA_DIR ($(cat "$LLAMA_DIR/.from-sdist" 2>/dev/null || echo '?'))"
log "  tools:   $BUILD_DIR/bin/llama-bench $BUILD_DIR/bin/llama-batched-bench"
