#!/usr/bin/env bash
# AVX2-only proof: run the one build on an emulated Haswell (CPUID has AVX2/FMA, no AVX-512; QEMU's
# TCG has no AVX-512 at all, so any AVX-512 instruction is SIGILL) and check that kt-jit selects
# avx2 there and its results match the references.
#
#   bash tests/emu/run_haswell.sh [BUILD_DIR]     (default: build)
#
# 1. qemu-x86_64 -cpu Haswell BUILD_DIR/ktjit_tests          (the GoogleTest suite)
# 2. qemu-x86_64 -cpu Haswell <python3> tests/emu/haswell_smoke.py   (the installed kt_jit package)
#
# Needs qemu-user (Debian package; `tools/setup.sh` installs it), the C++ build with
# -DKT_JIT_BUILD_TESTS=ON and the Python package installed (pip install --no-build-isolation .).
#   PYTHON=python3.11   the interpreter to emulate (its real binary is found via sys.executable,
#                       since pyenv/venv shims are scripts that qemu cannot load)
#   QEMU=qemu-x86_64    the emulator; QEMU_CPU=Haswell the CPU model
# Ends with "haswell: N passed, M failed"; exits non-zero on any failure.
set -uo pipefail
# A BUILD_DIR argument is relative to the caller's directory; the default is the repository's build.
BUILD_DIR="build"
if [ -n "${1:-}" ]; then BUILD_DIR="$(realpath -m -- "$1")"; fi
cd "$(dirname "$0")/../.."

QEMU="${QEMU:-qemu-x86_64}"
QEMU_CPU="${QEMU_CPU:-Haswell}"
PYTHON="${PYTHON:-python3}"
SMOKE="tests/emu/haswell_smoke.py"

# Tests that cannot pass under user-mode emulation, as a gtest negative filter.
#   Cpu.ProbeAgreesWithKernelFlags compares the probe with /proc/cpuinfo; qemu-user passes the
#   host's /proc/cpuinfo through unchanged (it only fakes it for a few non-x86 targets), so on an
#   AVX-512 host the emulated CPUID (no AVX-512) and the file disagree by construction. The probe
#   itself is checked under emulation by the smoke test (cpu_features()["avx512f"] is False).
GTEST_EXCLUDE="Cpu.ProbeAgreesWithKernelFlags"

EMU_TAG="haswell"
# shellcheck source=tests/emu/lib.sh
. tests/emu/lib.sh

if [ "$(uname -m)" != "x86_64" ]; then
    echo "haswell: this check needs an x86-64 host (qemu-x86_64 runs the same binaries)" >&2
    failed=$((failed + 1))
    finish
fi
if ! command -v "$QEMU" >/dev/null 2>&1; then
    echo "haswell: $QEMU not found (apt-get install qemu-user)" >&2
    failed=$((failed + 1))
    finish
fi
if [ ! -x "$BUILD_DIR/ktjit_tests" ]; then
    echo "haswell: $BUILD_DIR/ktjit_tests not found (cmake -S . -B $BUILD_DIR -DKT_JIT_BUILD_TESTS=ON && cmake --build $BUILD_DIR)" >&2
    failed=$((failed + 1))
    finish
fi
PY_BIN="$("$PYTHON" -c 'import sys; print(sys.executable)' 2>/dev/null)"
if [ -z "$PY_BIN" ] || [ ! -x "$PY_BIN" ]; then
    echo "haswell: cannot find the real binary of $PYTHON" >&2
    failed=$((failed + 1))
    finish
fi

# QEMU's TCG emulates AVX/AVX2/FMA only from 7.2 on; an older one drops them from CPUID, so the
# engine would (rightly) pick the ref level and the proof could not be made.
qemu_ver="$("$QEMU" --version | sed -n 's/.*version \([0-9][0-9]*\)\.\([0-9][0-9]*\).*/\1 \2/p' | head -1)"
read -r qv_major qv_minor <<<"${qemu_ver:-0 0}"
if [ "$qv_major" -lt 7 ] || { [ "$qv_major" -eq 7 ] && [ "$qv_minor" -lt 2 ]; }; then
    echo "haswell: $QEMU is version ${qv_major}.${qv_minor}; AVX2 emulation needs QEMU >= 7.2" >&2
    failed=$((failed + 1))
    finish
fi

# The engine must choose its level itself; an inherited cap would hide a wrong choice.
unset KT_JIT_ISA
# The tests' x86-64 interpreter (AVX-512/AMX kernels on CPUs without them) already ran natively in
# this same binary; under qemu it would cost minutes for nothing new.
export KT_JIT_TEST_INTERPRET=0
echo "haswell: $("$QEMU" --version | head -1), -cpu $QEMU_CPU"

# QEMU's TCG prints a warning for each Haswell CPUID bit it cannot emulate (pcid, x2apic, hle, rtm,
# ...): harmless for user-mode programs, so dropped from the output.
qemu_filter() { grep -v "warning: TCG doesn't support requested feature" || true; }

# --- 1. GoogleTest --------------------------------------------------------------------------
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
echo "== haswell: $QEMU -cpu $QEMU_CPU $BUILD_DIR/ktjit_tests --gtest_filter=-$GTEST_EXCLUDE"
t0=$(date +%s)
"$QEMU" -cpu "$QEMU_CPU" "$BUILD_DIR/ktjit_tests" --gtest_filter="-$GTEST_EXCLUDE" 2>&1 |
    qemu_filter | tee "$log"
rc=${PIPESTATUS[0]}
count_gtest "$log" "$rc" ktjit_tests
echo "haswell: gtest $ok passed, $bad failed, $skipped skipped, status $rc, $(($(date +%s) - t0)) s"

# --- 2. Python smoke test (the whole interpreter, torch included, is emulated) -------------
echo "== haswell: $QEMU -cpu $QEMU_CPU $PY_BIN $SMOKE"
t0=$(date +%s)
"$QEMU" -cpu "$QEMU_CPU" "$PY_BIN" "$SMOKE" 2>&1 | qemu_filter | tee "$log"
rc=${PIPESTATUS[0]}
count_checks "$log" "$rc" python
echo "haswell: smoke $ok passed, $bad failed, status $rc, $(($(date +%s) - t0)) s"

finish
