"""The CUDA-stream bridge (serving in stream order through cudaLaunchHostFunc) on a machine
without a GPU: a stand-in runtime (tests/fake_cuda/fake_cudart.cpp, built here with g++) runs
each stream's host callbacks in order on its own thread, as CUDA does. KT_JIT_CUDART points the
bridge at it in a fresh interpreter. The results must equal the plain host path bit for bit.

Tests with real CUDA tensors need a GPU and skip (with that reason) where there is none."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest
import torch

from conftest import run_python

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fake_cudart(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "a C++ compiler is needed to build the stand-in CUDA runtime"
    out = tmp_path_factory.mktemp("fakecuda") / "libfakecudart.so"
    src = ROOT / "tests" / "fake_cuda" / "fake_cudart.cpp"
    subprocess.run(
        [cxx, "-shared", "-fPIC", "-O1", str(src), "-o", str(out), "-pthread"], check=True
    )
    return str(out)


PRELUDE = """
import torch, kt_jit
from kt_jit import _core
import sys
sys.path.insert(0, {tests!r})
from conftest import make_weights, make_routing, make_wrapper
assert _core.cuda_runtime() is not None, _core.cuda_runtime_error()
E, K, H, I = 8, 4, 128, 64
w3 = make_weights(E, H, I, seed=3)
def wrappers(d=None, n=3):
    ws = []
    for L in range(n):
        wr = make_wrapper(E, K, H, I, max_deferred_experts_per_token=d)
        wr.layer_idx = L
        wr.load_weights_from_tensors(*w3, torch.arange(E))
        ws.append(wr)
    return ws
def steps(ws, stream, n_steps=4, T=3):
    outs = []
    for step in range(n_steps):
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
        for wr in ws:
            ids, w = make_routing(T, E, K, seed=step * 10 + wr.layer_idx, invalid=True)
            wr.submit_forward(x, ids, w, stream)
            y = wr.sync_forward(x, stream)
            outs.append(y)
            x = (x.float() + y.float()).to(torch.bfloat16)
    return outs
"""


def _run(code, fake):
    r = run_python(
        PRELUDE.format(tests=str(ROOT / "tests" / "python")) + code,
        env_extra={"KT_JIT_CUDART": fake, "KT_JIT_LOG_LEVEL": "WARNING"},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.mark.parametrize("deferred", [None, 2])
def test_stream_ordered_forwards_equal_the_host_path(fake_cudart, deferred):
    out = _run(
        f"""
host = steps(wrappers({deferred!r}), None)
kt_jit.KTMoEWrapper.clear_buffer_cache()
on_stream = steps(wrappers({deferred!r}), 0x1234)
assert len(host) == len(on_stream)
for i, (a, b) in enumerate(zip(host, on_stream)):
    assert a.dtype == b.dtype == torch.bfloat16
    assert torch.equal(a.view(torch.int16), b.view(torch.int16)), i
print("same", len(host))
""",
        fake_cudart,
    )
    assert "same 12" in out


def test_stream_capture_sizes_reuse_the_same_callbacks(fake_cudart):
    """Capture batch sizes keep one StreamForward per (slot, kind): a graph replay would call
    the same host functions with the same data."""
    out = _run(
        """
kt_jit.KTMoEWrapper.set_capture_batch_sizes([3])
ws = wrappers(None, n=2)
steps(ws, 0x77, n_steps=1)
first = {k: id(e.fwd) for k, e in ws[0]._stream_forwards.items()}
steps(ws, 0x77, n_steps=3)
again = {k: id(e.fwd) for k, e in ws[0]._stream_forwards.items()}
assert first == again and len(first) == 1, (first, again)
print("reused")
""",
        fake_cudart,
    )
    assert "reused" in out


def test_stream_errors_are_clear(fake_cudart):
    out = _run(
        """
import pytest
ws = wrappers(None, n=1)
x = torch.randn(2, H)
ids, w = make_routing(2, E, K, seed=1, invalid=False)
with pytest.raises(RuntimeError, match="illegal memory access"):
    ws[0].submit_forward(x, ids, w, 0xbad)   # the runtime refuses the callback
# a forward that fails inside its task: an unloaded native layer behind the wrapper
ws[0].moe = _core.MoELayer(E, K, H, I, "AMXINT8")
ws[0].submit_forward(x, ids, w, 0x55)
with pytest.raises(RuntimeError, match="not loaded"):
    ws[0].sync_forward(x, 0x55)
print("errors ok")
""",
        fake_cudart,
    )
    assert "errors ok" in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this host)")
def test_cuda_tensors_in_stream_order():  # pragma: no cover - GPU hosts only
    from conftest import make_routing, make_weights, make_wrapper

    E, K, H, I = 8, 4, 128, 64
    wr = make_wrapper(E, K, H, I)
    wr.load_weights_from_tensors(*make_weights(E, H, I, seed=3), torch.arange(E))
    x = torch.randn(5, H)
    ids, w = make_routing(5, E, K, seed=2, invalid=True)
    host = wr.forward(x, ids, w)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        wr.submit_forward(x.cuda(), ids.cuda(), w.cuda(), s.cuda_stream)
        y = wr.sync_forward(x.cuda(), s.cuda_stream)
    s.synchronize()
    assert y.device.type == "cuda" and torch.equal(y.cpu(), host)
