#!/usr/bin/env bash
# Installs the peers `kt-jit bench --ktkernel-peer --onednn-peer` compares against (bench only; CI's
# tools/setup.sh does not need them):
#   - kt-kernel from PyPI in its own virtual environment (default /opt/ktk-venv), made with
#     --system-site-packages so it uses the machine's torch and safetensors; kt-kernel is installed
#     with --no-deps (its other dependencies - triton, the CLI's - are not needed by the extension
#     API the bench drives), never into the main site-packages;
#   - oneDNN (Debian's libdnnl-dev) and g++, for tools/peers/onednn_bench.cpp, which the bench
#     builds on demand;
#   - llama.cpp's ggml (ggml, ggml-base, ggml-cpu shared libraries and headers) in $GGML_PREFIX
#     (default /opt/ggml-peer), built with CMake (GGML_NATIVE, as llama.cpp users build it) from
#     the llama.cpp that PyPI's llama-cpp-python sdist vendors, for tools/peers/ggml_bench.cpp
#     (kt-jit bench --llamacpp-peer builds it on demand).
# Then lists which kt-kernel classes run on this CPU (tools/peers/ktkernel_bench.py --probe; a few
# minutes).
#   bash tools/peers/setup_peers.sh                 (root: apt-get; KTK_VENV=... to move the venv)
#   SKIP_PROBE=1 bash tools/peers/setup_peers.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"
KTK_VENV="${KTK_VENV:-/opt/ktk-venv}"
KTK_VERSION="${KTK_VERSION:-}" # e.g. ==0.7.2; empty = newest
GGML_PREFIX="${GGML_PREFIX:-/opt/ggml-peer}"
LCPP_VERSION="${LCPP_VERSION:-0.3.36}" # the llama-cpp-python sdist whose llama.cpp is built

echo "== oneDNN (libdnnl-dev) and g++"
if ! [ -f /usr/include/oneapi/dnnl/dnnl.hpp ] || ! command -v g++ >/dev/null; then
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y --no-install-recommends libdnnl-dev g++
fi
dpkg-query -W -f='${Package} ${Version}\n' libdnnl-dev 2>/dev/null || true

echo "== llama.cpp's ggml (llama-cpp-python $LCPP_VERSION sdist) in $GGML_PREFIX"
if ! [ -f "$GGML_PREFIX/include/ggml.h" ] || [ "$(cat "$GGML_PREFIX/VERSION" 2>/dev/null)" != "$LCPP_VERSION" ]; then
  work=$(mktemp -d)
  "$PYTHON" -m pip download --no-deps --no-binary :all: --no-build-isolation \
    "llama-cpp-python==$LCPP_VERSION" -d "$work"
  tar xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
  src=$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)
  cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_OPENMP=ON \
    -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF >/dev/null
  cmake --build "$work/build" -j"$(nproc)" --target ggml ggml-base ggml-cpu >/dev/null
  mkdir -p "$GGML_PREFIX/lib" "$GGML_PREFIX/include"
  cp -a "$work/build/bin/"libggml*.so* "$GGML_PREFIX/lib/"
  cp "$src"/ggml/include/*.h "$GGML_PREFIX/include/"
  echo "$LCPP_VERSION" >"$GGML_PREFIX/VERSION"
  rm -rf "$work"
fi
ls "$GGML_PREFIX/lib"

echo "== kt-kernel in $KTK_VENV"
if ! [ -x "$KTK_VENV/bin/python" ]; then
  "$PYTHON" -m venv --system-site-packages "$KTK_VENV"
fi
"$KTK_VENV/bin/python" -m pip install --no-deps "kt-kernel$KTK_VERSION"
"$KTK_VENV/bin/python" -c "import torch, safetensors, numpy" # from the system site-packages
KT_KERNEL_DEBUG=1 "$KTK_VENV/bin/python" -c \
  "import kt_kernel as k; print('kt-kernel', k.__version__, 'extension', k.__cpu_variant__)"

if [ "${SKIP_PROBE:-0}" != 1 ]; then
  echo "== kt-kernel classes on this CPU (each in its own process)"
  "$KTK_VENV/bin/python" tools/peers/ktkernel_bench.py --probe >/dev/null
fi
echo "peers ready: kt-jit bench --ktkernel-peer $KTK_VENV/bin/python --onednn-peer" \
  "(LLAMAFILE: --llamacpp-peer $GGML_PREFIX)"
