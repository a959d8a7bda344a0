#!/usr/bin/env bash
# Developer loop without `pip install`: builds the extension into build-dev-<name> and lays out a
# private package tree at /tmp/ktjit-<name> (the Python sources copied, _core beside them), so
# several people (or sessions) can test their own trees at once without touching site-packages:
#   bash tools/dev_py.sh mine && PYTHONPATH=/tmp/ktjit-mine python3 -m pytest -q tests/python
set -euo pipefail
cd "$(dirname "$0")/.."
name="${1:-dev}"
build="build-dev-$name"
out="/tmp/ktjit-$name"
cmake -S . -B "$build" -G Ninja -DKT_JIT_BUILD_PYTHON=ON -DKT_JIT_BUILD_TESTS=ON \
  -DCMAKE_BUILD_TYPE=Release -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" >/dev/null
ninja -C "$build" _core ktjit_tests >/dev/null
rm -rf "$out"
mkdir -p "$out"
cp -r python/kt_jit python/kt_kernel_alias "$out/"
cp "$build"/_core*.so "$out/kt_jit/"
echo "PYTHONPATH=$out  (C++ tests: $build/ktjit_tests)"
