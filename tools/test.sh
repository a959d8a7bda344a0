#!/usr/bin/env bash
# Build and run the C++ tests, install the Python package, run the Python tests.
# Expects the dependencies from tools/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-2}"
export PIP_BREAK_SYSTEM_PACKAGES=1

echo "== C++ build and tests"
cmake -S . -B build -DKT_JIT_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$JOBS"
(cd build && ctest --output-on-failure)

echo "== AArch64: cross build, the C++ suite under qemu-aarch64 -cpu max and -cpu cortex-a72"
JOBS="$JOBS" bash tests/emu/run_aarch64.sh build-aarch64

echo "== AArch64: the Python package (cross-built _core, arm64 CPython and torch) under qemu-aarch64"
JOBS="$JOBS" PYTHON="$PYTHON" bash tests/emu/run_aarch64_python.sh build-aarch64

echo "== Python package"
"$PYTHON" -m pip install --no-build-isolation -v .

echo "== Python tests"
"$PYTHON" -m pytest -q tests/python
