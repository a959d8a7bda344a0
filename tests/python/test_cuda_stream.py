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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this host)")
def test_cuda_graph_capture_and_replay():  # pragma: no cover - GPU hosts only
    """SGLang's CUDA-graph path: capture submit_forward + sync_forward on static CUDA buffers
    once, then replay with new inputs copied in; every replay equals the host path bit for bit."""
    import kt_jit
    from conftest import make_routing, make_weights, make_wrapper

    E, K, H, I, T = 8, 4, 128, 64, 4
    wr = make_wrapper(E, K, H, I)
    wr.load_weights_from_tensors(*make_weights(E, H, I, seed=5), torch.arange(E))
    kt_jit.KTMoEWrapper.set_capture_batch_sizes([T])
    sx = torch.zeros(T, H, dtype=torch.bfloat16, device="cuda")
    sids = torch.zeros(T, K, dtype=torch.int64, device="cuda")
    sw = torch.zeros(T, K, dtype=torch.float32, device="cuda")

    def step():
        h = torch.cuda.current_stream().cuda_stream
        wr.submit_forward(sx, sids, sw, h)
        return wr.sync_forward(sx, h)

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):  # warm-up outside the capture, as torch asks
        step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        out = step()
    for seed in range(3):
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        ids, w = make_routing(T, E, K, seed=seed, invalid=True)
        sx.copy_(x.cuda())
        sids.copy_(ids.to(torch.int64).cuda())
        sw.copy_(w.to(torch.float32).cuda())
        g.replay()
        torch.cuda.synchronize()
        host = wr.forward(x, ids, w)
        assert torch.equal(out.cpu().view(torch.int16), host.view(torch.int16)), seed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this host)")
def test_write_back_into_cuda_tensors(tmp_path):  # pragma: no cover - GPU hosts only
    """write_weight_scale_to_buffer with device pointers (CUDA tensors' data_ptr(), some host
    pointers mixed in) equals the write-back into host memory, byte for byte."""
    from conftest import make_weights, make_wrapper

    E, K, H, I, tp = 8, 4, 128, 64, 2
    bf = make_wrapper(E, K, H, I, method="BF16")
    bf.load_weights_from_tensors(*make_weights(E, H, I, seed=7), torch.arange(E))
    cases = [(bf, [(2 * I // tp, H), None, (H, I // tp), None], torch.bfloat16)]
    import test_loader_int4 as t4

    t4.write_model(tmp_path, "RAWINT4", 32, seed=4)
    ri = t4.wrapper_for(__import__("conftest"), tmp_path, "RAWINT4")
    ri.load_weights(torch.arange(t4.E))
    sizes = ri.moe.write_expert_bytes(1)
    cases.append((ri, [(s,) for s in sizes], torch.uint8))
    for wr, shapes, dt in cases:
        n = tp if wr is bf else 1
        host = [[torch.zeros(sh, dtype=dt) if sh else None for sh in shapes] for _ in range(n)]
        dev = [
            [
                (torch.zeros(sh, dtype=dt, device="cuda" if j != 3 else "cpu") if sh else None)
                for j, sh in enumerate(shapes)
            ]
            for _ in range(n)
        ]
        for bufs in (host, dev):
            ptrs = [[b[j].data_ptr() if b[j] is not None else 0 for b in bufs] for j in range(4)]
            wr.submit_write_weight_scale_to_buffer(n, 1, *ptrs)
            wr.sync_write_weight_scale_to_buffer()
        for h, d in zip(host, dev):
            for a, b in zip(h, d):
                if a is not None:
                    assert bool((a.view(torch.uint8) != 0).any()), "host write-back is empty"
                    assert torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8))
