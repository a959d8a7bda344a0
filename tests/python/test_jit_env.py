"""KT_JIT_DUMP, KT_JIT_PERF_MAP and KT_JIT_DEBUG: what a developer inspects generated code with."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from kt_jit import _core

RUN_LAYER = """
import torch
from kt_jit import _core
_core.init_pool(1, 1)
layer = _core.MoELayer(4, 2, 64, 48, "AMXINT8")
g = torch.randn(4, 48, 64); d = torch.randn(4, 64, 48)
layer.load_from_float(g.data_ptr(), g.data_ptr(), d.data_ptr(), "f32", 0)
x = torch.randn(3, 64); ids = torch.tensor([[0, 1], [2, 3], [1, -1]]); w = torch.rand(3, 2)
out = torch.empty(3, 64)
layer.forward(3, x.data_ptr(), ids.data_ptr(), w.data_ptr(), 0, out.data_ptr())
print("NAMES", ",".join(layer.kernel_names()))
import os; print("PID", os.getpid())
"""

needs_jit = pytest.mark.skipif(_core.isa() == "ref", reason="this CPU selects the reference path")


def _run(env_extra):
    env = dict(os.environ)
    env.pop("KT_JIT_ISA", None)
    env.update(env_extra)
    p = subprocess.run(
        [sys.executable, "-c", RUN_LAYER], capture_output=True, text=True, env=env, timeout=120
    )
    assert p.returncode == 0, p.stderr
    names = next(l for l in p.stdout.splitlines() if l.startswith("NAMES")).split()[1].split(",")
    pid = int(next(l for l in p.stdout.splitlines() if l.startswith("PID")).split()[1])
    return names, pid, p.stderr


@needs_jit
def test_dump_writes_every_kernel(tmp_path):
    names, _, _ = _run({"KT_JIT_DUMP": str(tmp_path)})
    for n in names:
        code = (tmp_path / f"{n}.bin").read_bytes()
        meta = json.loads((tmp_path / f"{n}.json").read_text())
        assert meta["name"] == n and meta["bytes"] == len(code) > 0


@needs_jit
def test_dump_makes_its_directory_or_says_it_cannot(tmp_path):
    nested = tmp_path / "a" / "b"  # missing: made
    names, _, err = _run({"KT_JIT_DUMP": str(nested)})
    assert all((nested / f"{n}.bin").stat().st_size > 0 for n in names)
    assert "KT_JIT_DUMP" not in err
    blocker = tmp_path / "file"  # a file where the directory should be: one warning, no crash
    blocker.write_text("")
    names, _, err = _run({"KT_JIT_DUMP": str(blocker / "dump")})
    assert names and err.count("KT_JIT_DUMP") == 1 and "cannot write" in err


@needs_jit
def test_perf_map_names_the_kernels():
    names, pid, _ = _run({"KT_JIT_PERF_MAP": "1"})
    path = f"/tmp/perf-{pid}.map"
    try:
        lines = open(path).read().splitlines()
    finally:
        if os.path.exists(path):
            os.unlink(path)
    mapped = {l.split()[2] for l in lines}
    assert set(names) <= mapped
    for l in lines:
        addr, size, _ = l.split()
        assert int(addr, 16) > 0 and int(size, 16) > 0


@needs_jit
def test_debug_logs_probe_choice_and_kernels():
    names, _, err = _run({"KT_JIT_DEBUG": "1"})
    assert "isa selected" in err
    for n in names:
        assert f"kernel {n}" in err


def test_pool_leaves_the_callers_affinity_alone():
    """The caller takes part in the work but is the application's thread: it must not be pinned
    (torch's threads created afterwards would inherit a one-core mask)."""
    code = (
        "import os; before = os.sched_getaffinity(0)\n"
        "from kt_jit import _core; _core.init_pool(2, 1)\n"
        "print(before == os.sched_getaffinity(0))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "True"


@needs_jit
def test_decode_prefetch_distance_is_tunable(tmp_path):
    """KT_JIT_DECODE_PREFETCH moves the decode kernels' prefetch (0 drops it) and nothing else:
    the decode kernels shrink by their prefetch instructions, the prefill ones stay byte for byte,
    and a bad value is refused with the variable named."""

    def dump(value):
        d = tmp_path / f"pf{value}"
        d.mkdir()
        names, _, _ = _run({"KT_JIT_DUMP": str(d), "KT_JIT_DECODE_PREFETCH": value})
        return {n: (d / f"{n}.bin").read_bytes() for n in names}

    default, none, near, far = dump(""), dump("0"), dump("2048"), dump("4096")
    assert set(default) == set(none) == set(near) == set(far)
    decode = [n for n in default if n.startswith("gemm_decode")]
    prefill = [n for n in default if n.startswith("gemm_prefill")]
    assert decode and prefill
    for n in decode:
        assert len(none[n]) < len(near[n])  # 0 drops the prefetcht0s
        assert len(near[n]) == len(far[n]) and near[n] != far[n]  # same code, new offsets
    for n in prefill:
        assert none[n] == default[n] == near[n] == far[n]
    # The default for these int8 kernels: on AMD CPUs none at the AVX-512 levels (on a Zen 5,
    # family 26 on, 8192 bytes for tiles of 4 rows or more) and 1536 bytes at avx2, 3072
    # elsewhere.
    feats = _core.cpu_features()
    amd = feats["vendor"] in ("AuthenticAMD", "HygonGenuine")
    zen5 = amd and feats["family"] >= 26
    zmm = _core.detected_isa() in ("avx512", "avx512_vnni", "avx512_bf16", "amx")
    dumps = {"0": none, "4096": far}
    for n in decode:
        rows = int(re.search(r"_m(\d+)n", n).group(1))
        want = ("8192" if zen5 and rows >= 4 else "0") if amd and zmm else "1536" if amd else "3072"
        if want not in dumps:
            dumps[want] = dump(want)
        assert default[n] == dumps[want][n] and default[n] != far[n], n
    env = dict(os.environ, KT_JIT_DECODE_PREFETCH="100")
    env.pop("KT_JIT_ISA", None)
    p = subprocess.run(
        [sys.executable, "-c", RUN_LAYER], capture_output=True, text=True, env=env, timeout=120
    )
    assert p.returncode != 0
    assert "KT_JIT_DECODE_PREFETCH: expected a byte count, a multiple of 64" in p.stderr


@needs_jit
def test_retired_kernels_keep_working_and_the_next_layer_generates_its_own():
    # _core.retire_kernels (tools/ab_layer.py --fresh-kernels): a layer built after it generates
    # its kernels again, and the layer built before keeps running on the ones it holds.
    import torch

    _core.init_pool(1, 1)
    g = torch.randn(4, 48, 64)
    d = torch.randn(4, 64, 48)
    x = torch.randn(3, 64)
    ids = torch.tensor([[0, 1], [2, 3], [1, -1]])
    w = torch.rand(3, 2)

    def build():
        layer = _core.MoELayer(4, 2, 64, 48, "AMXINT8")
        layer.load_from_float(g.data_ptr(), g.data_ptr(), d.data_ptr(), "f32", 0)
        return layer

    def run(layer):
        out = torch.empty(3, 64)
        layer.forward(3, x.data_ptr(), ids.data_ptr(), w.data_ptr(), 0, out.data_ptr())
        return out

    a = build()
    out_a = run(a)
    assert _core.retire_kernels() >= len(set(a.kernel_names())) > 0
    misses = _core.cache_stats()["misses"]
    b = build()
    # (at least its GEMM kernels; the row quantizers' come from the cache too)
    assert _core.cache_stats()["misses"] - misses >= len(set(b.kernel_names()))
    assert torch.equal(run(b), out_a)
    assert torch.equal(run(a), out_a)
