"""tools/ab_layer.py: each layer is built under its own environment setting, and the A/B runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kt_jit import _core

TOOL = Path(__file__).resolve().parents[2] / "tools" / "ab_layer.py"


def _run(*args):
    env = dict(os.environ)
    env.pop("KT_JIT_QGROUP_FOLDS", None)
    return subprocess.run(
        [sys.executable, str(TOOL), *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.skipif(_core.isa() != "avx2", reason="the super-block folds are avx2 kernels")
@pytest.mark.skipif(not hasattr(_core.MoELayer, "load_experts_grouped"), reason="no LLAMAFILE")
def test_each_layer_takes_its_own_setting():
    p = _run(
        "--gguf-type", "Q4_K", "--dims", "8,2,256,256", "--tokens", "16", "--pairs", "3",
        "--a", "KT_JIT_QGROUP_FOLDS=1", "--b", "KT_JIT_QGROUP_FOLDS=0", "--order", "BA",
        "--threads", "2",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    a = next(line for line in lines if line.startswith("A ("))
    b = next(line for line in lines if line.startswith("B ("))
    assert "iwls_" in a and "iwls_" not in b and "iws_" in b, p.stdout
    summary = next(line for line in lines if "per-pair B/A median" in line)
    # the pool the tool made has the threads asked for (it once made 1 thread and 2 pools)
    assert "3 pairs" in summary and "2 thread(s)" in summary, p.stdout
    # the folds round differently: the outputs differ, slightly
    diff = float(next(line for line in lines if "relative L1" in line).split(":")[1])
    assert 0 < diff < 1e-4, p.stdout


def test_bad_arguments_are_refused():
    p = _run("--a", "NOEQUALS", "--dims", "8,2,256,256")
    assert p.returncode != 0 and "NAME=VALUE" in p.stderr + p.stdout
    p = _run("--dims", "8,2,256")
    assert p.returncode != 0 and "E,TOPK,H,I" in p.stderr + p.stdout
    p = _run("--threads", "0", "--dims", "8,2,256,256")
    assert p.returncode != 0 and "--threads" in p.stderr + p.stdout
    p = _run("--shape", "nope")
    assert p.returncode != 0 and "--shape must be one of" in p.stderr + p.stdout
