#!/usr/bin/env bash
# Install everything kt-jit needs to build and test, on Debian/Ubuntu (run as root or with sudo).
#   KT_JIT_SKIP_APT=1   skip the apt-get part (system packages already there)
#   PYTHON=python3.11   the interpreter to install the Python packages into
set -euo pipefail

PYTHON="${PYTHON:-python3}"
SUDO=""
if [ "$(id -u)" != "0" ] && command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
fi

if [ "${KT_JIT_SKIP_APT:-0}" != "1" ] && command -v apt-get >/dev/null 2>&1; then
    echo "== apt-get: build tools and libraries"
    $SUDO apt-get update
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        libxbyak-dev libhwloc-dev libfmt-dev libgtest-dev libzydis-dev binutils cmake g++ make pkg-config \
        qemu-user libasmjit-dev g++-aarch64-linux-gnu binutils-aarch64-linux-gnu
    # The AArch64 cross build (tests/emu/run_aarch64.sh) links Debian's arm64 asmjit.
    if [ "$(dpkg --print-architecture)" = "amd64" ]; then
        echo "== apt-get: arm64 asmjit for the AArch64 cross build"
        if ! { $SUDO dpkg --add-architecture arm64 && $SUDO apt-get update &&
               $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
                   libasmjit-dev:arm64; }; then
            echo "warning: libasmjit-dev:arm64 could not be installed; tests/emu/run_aarch64.sh will fail" >&2
        fi
    fi
fi

echo "== pip: torch (CPU build, pinned), test and build tools"
# Debian's system Python refuses pip installs without this (PEP 668); harmless elsewhere.
export PIP_BREAK_SYSTEM_PACKAGES=1
"$PYTHON" -m pip install torch==2.13.0 numpy pytest pybind11 scikit-build-core ninja safetensors tqdm \
    gguf==0.19.0 \
    transformers==5.23.0
