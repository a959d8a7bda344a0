#!/usr/bin/env bash
# AArch64 proof of the Python package: cross-build the kt_jit extension (_core) for AArch64 and run
# tests/emu/aarch64_smoke.py with an arm64 CPython, numpy and torch under qemu-aarch64, on two CPU
# models that dispatch differently (-cpu max: neon_bf16; -cpu cortex-a72: neon).
#
#   bash tests/emu/run_aarch64_python.sh [BUILD_DIR]     (default: build-aarch64)
#
# BUILD_DIR is the AArch64 cross build of tests/emu/run_aarch64.sh; it is reconfigured with
# -DKT_JIT_BUILD_PYTHON=ON (the core's objects are reused) and everything the run needs is kept
# under BUILD_DIR/python-aarch64 and reused by later runs:
#   root/   Debian's arm64 CPython and the libraries it loads, unpacked from `apt-get download`
#           (not installed: an arm64 python3 package would replace the host's)
#   site/   arm64 wheels from PyPI (pip install --target --platform): torch (CPU), numpy, pytest
#           (tests/python/conftest.py, whose torch reference the smoke test uses, imports it),
#           gguf and safetensors (with their dependencies) for the pytest files below
#   pyinc/  that CPython's headers with its AArch64 pyconfig.h
#   pkg/    python/kt_jit plus the cross-built _core
# Needs what tools/setup.sh installs (g++-aarch64-linux-gnu, libasmjit-dev:arm64 with the arm64
# architecture added to dpkg, qemu-user, pybind11) and the network for the first run.
#   QEMU=qemu-aarch64                 the emulator
#   KT_JIT_A64_TORCH=torch==2.7.1     the arm64 torch wheel (PyPI's later aarch64 wheels are CUDA
#                                     builds that do not import without the NVIDIA libraries)
# After the smoke test, the pytest files of the formats whose NEON kernels came last (GGUF and the
# other k-group integer methods, MX: $PYTEST_FILES) run under -cpu max.
# Ends with "aarch64-python: N passed, M failed"; exits non-zero on any failure.
set -uo pipefail
BUILD_DIR="build-aarch64"
if [ -n "${1:-}" ]; then BUILD_DIR="$(realpath -m -- "$1")"; fi
cd "$(dirname "$0")/../.."
BUILD_DIR="$(realpath -m -- "$BUILD_DIR")"

QEMU="${QEMU:-qemu-aarch64}"
TORCH_SPEC="${KT_JIT_A64_TORCH:-torch==2.7.1}"
HOST_PYTHON="${PYTHON:-python3}"
WORK="$BUILD_DIR/python-aarch64"
ROOT="$WORK/root"
SITE="$WORK/site"
PYINC="$WORK/pyinc"
PKG="$WORK/pkg"
SMOKE="tests/emu/aarch64_smoke.py"
PYTEST_FILES=(tests/python/test_moe_qgroup.py tests/python/test_moe_mx.py
    tests/python/test_loader_gguf.py tests/python/test_gguf_format.py)

EMU_TAG="aarch64-python"
# shellcheck source=tests/emu/lib.sh
. tests/emu/lib.sh

for tool in aarch64-linux-gnu-g++ "$QEMU" cmake apt-get apt-cache dpkg-deb; do
    command -v "$tool" >/dev/null 2>&1 || fail "$tool not found (tools/setup.sh installs it)"
done
[ -f /usr/lib/aarch64-linux-gnu/cmake/asmjit/asmjit-config.cmake ] ||
    fail "asmjit for arm64 not found (tools/setup.sh installs libasmjit-dev:arm64)"
PYBIND11_DIR="$("$HOST_PYTHON" -m pybind11 --cmakedir 2>/dev/null)" ||
    fail "pybind11 not found for $HOST_PYTHON (pip install pybind11)"

# --- 1. Debian's arm64 CPython, unpacked -----------------------------------------------------
# The version Debian ships for arm64 (python3-minimal:arm64 pre-depends on python3.X-minimal).
PYVER="$(apt-cache depends python3-minimal:arm64 2>/dev/null |
         sed -n 's/.*Depends: python\(3\.[0-9]*\)-minimal.*/\1/p' | head -1)"
[ -n "$PYVER" ] || fail "no arm64 python3 in apt (dpkg --add-architecture arm64 && apt-get update)"
PY="$ROOT/usr/bin/python$PYVER"
if [ ! -f "$ROOT/.ready-$PYVER" ]; then
    echo "== aarch64-python: unpacking Debian's arm64 python$PYVER into $ROOT"
    rm -rf "$ROOT" "$WORK/debs"
    mkdir -p "$ROOT" "$WORK/debs"
    debs=(python$PYVER-minimal libpython$PYVER-minimal libpython$PYVER-stdlib python$PYVER
          libpython$PYVER-dev libc6 libstdc++6 libgcc-s1 libexpat1 zlib1g libffi8 libbz2-1.0
          liblzma5 libssl3 libsqlite3-0 libuuid1 libncursesw6 libtinfo6 libreadline8 libcrypt1
          libnsl2 libtirpc3 libdb5.3 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0
          libcom-err2 libkeyutils1)
    (cd "$WORK/debs" && apt-get download "${debs[@]/%/:arm64}") ||
        fail "apt-get download of the arm64 python packages failed"
    for d in "$WORK"/debs/*.deb; do dpkg-deb -x "$d" "$ROOT" || fail "dpkg-deb -x $d"; done
    touch "$ROOT/.ready-$PYVER"
fi
[ -x "$PY" ] || fail "$PY missing after unpacking"

# --- 2. arm64 wheels -------------------------------------------------------------------------
ready="$SITE/.ready-$PYVER-$TORCH_SPEC-gguf"
if [ ! -f "$ready" ]; then
    echo "== aarch64-python: arm64 wheels ($TORCH_SPEC, numpy, pytest, gguf, safetensors) into $SITE"
    rm -rf "$SITE"
    # --no-deps with the list written out: the resolver would otherwise pull the CUDA
    # dependencies PyPI declares for Linux wheels of later versions.
    "$HOST_PYTHON" -m pip install -q --target "$SITE" --platform manylinux_2_28_aarch64 \
        --platform manylinux2014_aarch64 --python-version "$PYVER" --implementation cp \
        --only-binary=:all: --no-deps "$TORCH_SPEC" numpy typing_extensions sympy mpmath filelock \
        networkx jinja2 markupsafe fsspec pytest iniconfig pluggy packaging pygments \
        --platform any gguf pyyaml requests tqdm urllib3 idna certifi charset_normalizer \
        safetensors || fail "pip could not fetch the arm64 wheels"
    touch "$ready"
fi

# --- 3. cross build of the extension ---------------------------------------------------------
rm -rf "$PYINC"
mkdir -p "$PYINC"
cp -r "$ROOT/usr/include/python$PYVER/." "$PYINC/"
cp "$ROOT/usr/include/aarch64-linux-gnu/python$PYVER/pyconfig.h" "$PYINC/pyconfig.h" ||
    fail "no AArch64 pyconfig.h in libpython$PYVER-dev:arm64"
ext=".cpython-${PYVER/./}-aarch64-linux-gnu.so"
echo "== aarch64-python: cross build of _core$ext in $BUILD_DIR"
t0=$(date +%s)
gen=()
command -v ninja >/dev/null 2>&1 && [ ! -f "$BUILD_DIR/CMakeCache.txt" ] && gen=(-G Ninja)
if ! cmake -S . -B "$BUILD_DIR" "${gen[@]}" -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
        -DCMAKE_BUILD_TYPE=Release -DKT_JIT_BUILD_PYTHON=ON \
        -DPython_EXECUTABLE="$(command -v "$HOST_PYTHON")" -DPython_INCLUDE_DIR="$PYINC" \
        -Dpybind11_DIR="$PYBIND11_DIR" -DPYTHON_MODULE_EXTENSION="$ext" \
        >"$WORK/cmake.log" 2>&1; then
    cat "$WORK/cmake.log"
    fail "cmake configure failed"
fi
cmake --build "$BUILD_DIR" --target _core -j"${JOBS:-2}" || fail "cross build of _core failed"
so="$BUILD_DIR/_core$ext"
readelf -h "$so" 2>/dev/null | grep -q "Machine:.*AArch64" || fail "$so is not an AArch64 object"
echo "aarch64-python: cross build $(($(date +%s) - t0)) s"
rm -rf "$PKG"
mkdir -p "$PKG"
cp -r python/kt_jit "$PKG/"
find "$PKG" -name '__pycache__' -prune -exec rm -rf {} +
cp "$so" "$PKG/kt_jit/"

# --- 4. the smoke test under two CPU models --------------------------------------------------
unset KT_JIT_ISA  # the engine must choose its level itself
echo "aarch64-python: $("$QEMU" --version | head -1), python $PYVER ($PY), $TORCH_SPEC"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
selected=()
run_model() {  # cpu model, the level it must select
    local cpu="$1" want="$2" rc ok bad t0
    echo "== aarch64-python: $QEMU -L $ROOT -cpu $cpu python$PYVER $SMOKE (KT_JIT_EXPECT_ISA=$want)"
    t0=$(date +%s)
    KT_JIT_EXPECT_ISA="$want" PYTHONPATH="$PKG:$SITE" PYTHONDONTWRITEBYTECODE=1 \
        "$QEMU" -L "$ROOT" -cpu "$cpu" "$PY" "$SMOKE" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    count_checks "$log" "$rc" "python under -cpu $cpu"
    selected+=("$(sed -n 's/^PASS isa is \([a-z0-9_]*\).*/\1/p' "$log" | head -1)")
    echo "aarch64-python: -cpu $cpu: $ok passed, $bad failed, status $rc, $(($(date +%s) - t0)) s"
}
run_model max neon_bf16
run_model cortex-a72 neon
if [ "${selected[0]:-}" = "${selected[1]:-}" ]; then
    echo "aarch64-python: both CPU models selected '${selected[0]:-}': no dispatch difference"
    failed=$((failed + 1))
fi

# --- 5. the formats' pytest files under -cpu max ---------------------------------------------
echo "== aarch64-python: $QEMU -L $ROOT -cpu max python$PYVER -m pytest ${PYTEST_FILES[*]}"
t0=$(date +%s)
PYTHONPATH="$PKG:$SITE" PYTHONDONTWRITEBYTECODE=1 "$QEMU" -L "$ROOT" -cpu max "$PY" -m pytest -q \
    -p no:cacheprovider "${PYTEST_FILES[@]}" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
count_pytest "$log" "$rc" "pytest under -cpu max"
echo "aarch64-python: pytest under -cpu max: $ok passed, $bad failed, $skipped skipped," \
    "status $rc, $(($(date +%s) - t0)) s"
finish
