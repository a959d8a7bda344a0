#!/usr/bin/env bash
# AArch64 proof on an x86-64 host: cross-build the C++ core and its GoogleTest suite with
# aarch64-linux-gnu-g++ and run the suite under qemu-aarch64 on two CPU models that dispatch
# differently:
#   -cpu max         has dotprod and BF16: kt-jit must select neon_bf16 (sdot kernels)
#   -cpu cortex-a72  plain ARMv8.0 NEON:   kt-jit must select neon (smull/sadalp kernels)
# Every NEON kernel the sweep uses is checked bit for bit against gemm_ref at every level the CPU
# model runs (A64Gemm.*), and the MoE executor runs on the NEON kernels (MoELayer.*).
#
#   bash tests/emu/run_aarch64.sh [BUILD_DIR]     (default: build-aarch64)
#
# Installs nothing: tools/setup.sh installs g++-aarch64-linux-gnu, libasmjit-dev:arm64 (after
# dpkg --add-architecture arm64), googletest sources and qemu-user.
#   JOBS=2             parallel compile jobs
#   QEMU=qemu-aarch64  the emulator
#   KT_JIT_A64_GTEST_FILTER='A64*'   run a subset (default: the whole suite)
# Ends with "aarch64: N passed, M failed"; exits non-zero on any failure.
set -uo pipefail
BUILD_DIR="build-aarch64"
if [ -n "${1:-}" ]; then BUILD_DIR="$(realpath -m -- "$1")"; fi
cd "$(dirname "$0")/../.."

QEMU="${QEMU:-qemu-aarch64}"
JOBS="${JOBS:-2}"
SYSROOT="/usr/aarch64-linux-gnu"
FILTER="${KT_JIT_A64_GTEST_FILTER:-*}"

EMU_TAG="aarch64"
# shellcheck source=tests/emu/lib.sh
. tests/emu/lib.sh

need() {  # command, what installs it
    if ! command -v "$1" >/dev/null 2>&1; then
        echo "aarch64: $1 not found ($2; tools/setup.sh installs it)" >&2
        failed=$((failed + 1))
        finish
    fi
}
need aarch64-linux-gnu-g++ "apt-get install g++-aarch64-linux-gnu"
need "$QEMU" "apt-get install qemu-user"
need cmake "apt-get install cmake"
if [ ! -f /usr/lib/aarch64-linux-gnu/cmake/asmjit/asmjit-config.cmake ]; then
    echo "aarch64: asmjit for arm64 not found (dpkg --add-architecture arm64 && apt-get update &&" \
         "apt-get install libasmjit-dev:arm64; tools/setup.sh does)" >&2
    failed=$((failed + 1))
    finish
fi

# --- cross build ------------------------------------------------------------------------------
echo "== aarch64: cross build into $BUILD_DIR"
t0=$(date +%s)
gen=()
command -v ninja >/dev/null 2>&1 && [ ! -f "$BUILD_DIR/CMakeCache.txt" ] && gen=(-G Ninja)
if ! cmake -S . -B "$BUILD_DIR" "${gen[@]}" -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
        -DKT_JIT_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release >"$BUILD_DIR.cmake.log" 2>&1; then
    cat "$BUILD_DIR.cmake.log"
    echo "aarch64: cmake configure failed"
    failed=$((failed + 1))
    finish
fi
rm -f "$BUILD_DIR.cmake.log"
if ! cmake --build "$BUILD_DIR" --target ktjit_tests -j"$JOBS"; then
    echo "aarch64: cross build failed"
    failed=$((failed + 1))
    finish
fi
echo "aarch64: cross build $(($(date +%s) - t0)) s"
if ! readelf -h "$BUILD_DIR/ktjit_tests" 2>/dev/null | grep -q "Machine:.*AArch64"; then
    echo "aarch64: $BUILD_DIR/ktjit_tests is not an AArch64 executable"
    failed=$((failed + 1))
    finish
fi

# The engine must choose its level itself; an inherited cap would hide a wrong choice.
unset KT_JIT_ISA
echo "aarch64: $("$QEMU" --version | head -1)"

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
selected=()

# --- the suite under one CPU model -------------------------------------------------------------
run_model() {  # cpu model, the level it must select
    local cpu="$1" want="$2"
    echo "== aarch64: $QEMU -L $SYSROOT -cpu $cpu $BUILD_DIR/ktjit_tests --gtest_filter=$FILTER" \
         "(KT_JIT_EXPECT_ISA=$want)"
    local t0 rc ok bad skipped got
    t0=$(date +%s)
    KT_JIT_EXPECT_ISA="$want" "$QEMU" -L "$SYSROOT" -cpu "$cpu" "$BUILD_DIR/ktjit_tests" \
        --gtest_filter="$FILTER" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    count_gtest "$log" "$rc" "ktjit_tests under -cpu $cpu"
    got=$(sed -n 's/^a64: selected isa \([a-z0-9_]*\)$/\1/p' "$log" | head -1)
    if [ "$FILTER" = "*" ] || grep -q "^a64: selected isa" "$log"; then
        if [ "$got" != "$want" ]; then
            echo "aarch64: -cpu $cpu selected '${got:-nothing}', expected $want"
            failed=$((failed + 1))
        fi
    fi
    selected+=("$got")
    echo "aarch64: -cpu $cpu: isa ${got:-?}, gtest $ok passed, $bad failed, $skipped skipped," \
         "status $rc, $(($(date +%s) - t0)) s"
}

run_model max neon_bf16
run_model cortex-a72 neon

# Both models must have run and dispatched differently.
if [ "${#selected[@]}" -eq 2 ] && [ -n "${selected[0]}" ] && [ "${selected[0]}" = "${selected[1]}" ]; then
    echo "aarch64: both CPU models selected ${selected[0]}: no dispatch difference"
    failed=$((failed + 1))
fi

finish
