"""AVX2-only proof: the one build runs right on a CPU without AVX-512.

Runs tests/emu/run_haswell.sh, which runs the GoogleTest suite and a MoE smoke test under
``qemu-x86_64 -cpu Haswell`` (CPUID without AVX-512; any AVX-512 instruction is SIGILL there).
Skipped when qemu-user or the C++ test binary is missing. Takes about a minute (torch's import
is emulated too). Build directory: ``KT_JIT_BUILD_DIR`` (default ``build`` in the repository).
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "tests", "emu", "run_haswell.sh")
BUILD_DIR = os.environ.get("KT_JIT_BUILD_DIR", os.path.join(REPO, "build"))


def _skip_reason():
    if platform.machine() != "x86_64":
        return "the Haswell emulation check runs x86-64 binaries under qemu-x86_64"
    if shutil.which("qemu-x86_64") is None:
        return "qemu-x86_64 is not installed (apt-get install qemu-user; tools/setup.sh does)"
    ver = subprocess.run(
        ["qemu-x86_64", "--version"], capture_output=True, text=True, check=False
    ).stdout
    m = re.search(r"version (\d+)\.(\d+)", ver)
    if m is None or (int(m.group(1)), int(m.group(2))) < (7, 2):
        return f"qemu-x86_64 emulates AVX2 only from QEMU 7.2 on; found {ver.splitlines()[:1]}"
    if not os.access(os.path.join(BUILD_DIR, "ktjit_tests"), os.X_OK):
        return (
            f"no C++ test binary at {BUILD_DIR}/ktjit_tests "
            "(cmake -S . -B build -DKT_JIT_BUILD_TESTS=ON && cmake --build build)"
        )
    return None


@pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))
def test_runs_right_on_emulated_haswell():
    env = dict(os.environ)
    env.pop("KT_JIT_ISA", None)
    env["PYTHON"] = sys.executable  # emulate the interpreter that runs this test
    proc = subprocess.run(
        ["bash", SCRIPT, BUILD_DIR],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    tail = "\n".join(out.splitlines()[-60:])
    closing = re.findall(r"^haswell: (\d+) passed, (\d+) failed$", proc.stdout, re.M)
    assert proc.returncode == 0, f"run_haswell.sh exited {proc.returncode}:\n{tail}"
    assert closing, f"no 'haswell: N passed, M failed' line:\n{tail}"
    n_pass, n_fail = (int(v) for v in closing[-1])
    assert n_fail == 0 and n_pass > 0, f"haswell: {n_pass} passed, {n_fail} failed:\n{tail}"
    assert "PASS isa is avx2" in proc.stdout, tail
