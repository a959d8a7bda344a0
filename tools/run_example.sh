#!/usr/bin/env bash
# Install kt-jit with its dependencies and run the example (python -m kt_jit.example).
#   KT_JIT_SKIP_SETUP=1   skip tools/setup.sh (dependencies already installed)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
export PIP_BREAK_SYSTEM_PACKAGES=1

if [ "${KT_JIT_SKIP_SETUP:-0}" != "1" ]; then
    bash tools/setup.sh
fi
"$PYTHON" -m pip install --no-build-isolation .
cd /tmp  # import the installed package, not the source tree
"$PYTHON" -m kt_jit.example "$@"
