"""Serving path: asynchronous submit/sync on the task queue, errors at sync, work in flight at
destruction, capture batch sizes, deferred experts, and SGLang's exact call sequence.

The deferral reference below is written from SPEC.md §3 / kt-kernel-api.md §1.2 in plain torch;
the MoE math reference is conftest's ``moe_reference_actq`` (same activation quantization).
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import kt_jit
from conftest import make_routing, make_weights, make_wrapper, moe_reference, moe_reference_actq
from conftest import rel_l1, run_python
from kt_jit import _core, serving

E, K, H, I = 8, 4, 128, 64


@pytest.fixture(scope="module")
def w3():
    return make_weights(E, H, I, seed=3)


def _loaded(w3, layer_idx=0, d=None, mask=None):
    wr = make_wrapper(E, K, H, I, mask=mask, max_deferred_experts_per_token=d)
    wr.layer_idx = layer_idx
    wr.load_weights_from_tensors(*w3, torch.arange(E))
    return wr


def _inputs(T, seed):
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(100 + seed))
    ids, w = make_routing(T, E, K, seed=seed, invalid=False)
    return x, ids, w


class _Gate:
    """A queue task that blocks the worker until released (to hold work in flight)."""

    def __init__(self):
        self.started = threading.Event()
        self.go = threading.Event()

    def __call__(self):
        self.started.set()
        assert self.go.wait(30), "gate never released"


# ------------------------------------------------------------------------------------------------
# the task queue


def test_queue_errors_raised_at_sync_with_message():
    q = _core.TaskQueue()

    def bad():
        raise ValueError("custom failure 42")

    q.submit(bad)
    with pytest.raises(RuntimeError, match="custom failure 42"):
        q.sync()
    q.sync()  # reported once
    # a C++ error inside a forward task: the layer has no weights
    layer = _core.MoELayer(E, K, H, I, "AMXINT8")
    x = torch.zeros(1, H)
    ids = torch.zeros(1, K, dtype=torch.int64)
    w = torch.ones(1, K)
    out = torch.zeros(1, H)
    seq = q.submit_forward(
        layer,
        1,
        x.data_ptr(),
        ids.data_ptr(),
        w.data_ptr(),
        0,
        out.data_ptr(),
        keepalive=(x, ids, w, out),
    )
    with pytest.raises(RuntimeError, match="not loaded"):
        q.wait(seq)
    assert q.pending == 0 and q.held == 0


def test_submit_is_asynchronous(w3):
    wr = _loaded(w3)
    x, ids, w = _inputs(3, seed=1)
    expected = wr.forward(x, ids, w)
    q = serving.get_queue()
    gate = _Gate()
    q.submit(gate)
    assert gate.started.wait(30)
    wr.submit_forward(x, ids, w, None)  # must return while the worker is blocked
    assert q.pending == 2
    x.fill_(7.0)  # the inputs were staged at submit: later edits do not matter
    gate.go.set()
    assert torch.equal(wr.sync_forward(x, None), expected)
    assert q.pending == 0


def test_wrapper_destroyed_with_work_in_flight(w3):
    q = serving.get_queue()
    gate = _Gate()
    q.submit(gate)
    x, ids, w = _inputs(5, seed=2)
    wr = _loaded(w3, d=2)
    wr.submit_forward(x, ids, w, 0)
    del wr
    gc.collect()
    other = _loaded(w3)
    x2, ids2, w2 = _inputs(2, seed=4)
    other.submit_forward(x2, ids2, w2, None)
    gate.go.set()
    out = other.sync_forward(x2, None)
    ref = moe_reference_actq(x2, ids2, w2, *w3)
    assert rel_l1(out, ref) <= 1e-3
    serving.drain()
    assert q.pending == 0 and q.held == 0


def test_exit_with_work_in_flight():
    code = r"""
import time, torch, kt_jit
from kt_jit import serving
E, K, H, I = 8, 2, 128, 64
wr = kt_jit.KTMoEWrapper(0, E, K, H, I, None, 1, 1, "", 64, method="AMXINT8",
                         max_deferred_experts_per_token=1)
wr.load_weights_from_tensors(torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I))
serving.get_queue().submit(lambda: time.sleep(0.3))
for _ in range(3):
    wr.submit_forward(torch.randn(4, H), torch.randint(0, E, (4, K)), torch.rand(4, K))
del wr
print("exiting", serving.get_queue().pending > 0)
"""
    r = run_python(code, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "exiting True" in r.stdout


def test_capture_batch_sizes_keep_buffers(w3):
    wr = _loaded(w3)
    kt_jit.KTMoEWrapper.set_capture_batch_sizes([1, 4])
    try:
        assert kt_jit.KTMoEWrapper.get_capture_batch_sizes() == [1, 4]
        for T in (1, 4, 3, 1):
            x, ids, w = _inputs(T, seed=T)
            out = wr.forward(x, ids, w)
            assert rel_l1(out, moe_reference_actq(x, ids, w, *w3)) <= 1e-3
        assert set(serving._cache) == {(1, H, K), (4, H, K)}
        assert serving._temp is not None and serving._temp.key == (3, H, K)
        kt_jit.KTMoEWrapper.clear_buffer_cache()
        assert not serving._cache and serving._temp is None
    finally:
        kt_jit.KTMoEWrapper.set_capture_batch_sizes([])
        kt_jit.KTMoEWrapper.clear_buffer_cache()


# ------------------------------------------------------------------------------------------------
# deferred experts: an independent reference of the selection rule


def reference_split(ids, weights, num_experts, d):
    """Spec: an expert is immediate if it is among the top K-d (by weight) of ANY token of the
    batch; every other (token, slot) pair is deferred. Returns (immediate ids, deferred ids) with
    -1 in the slots that are not in the set."""
    T, Kk = ids.shape
    keep = Kk - d
    protected = set()
    for t in range(T):
        order = sorted(range(Kk), key=lambda j: -float(weights[t, j]))
        for j in order[: max(keep, 0)]:
            protected.add(int(ids[t, j]))
    imm = ids.clone()
    dfr = ids.clone()
    for t in range(T):
        for j in range(Kk):
            e = int(ids[t, j])
            if 0 <= e < num_experts and e in protected:
                dfr[t, j] = -1
            else:
                imm[t, j] = -1
    return imm, dfr


@pytest.mark.parametrize("T,d", [(1, 1), (5, 2), (6, 3), (3, 4)])
def test_select_deferred_experts_matches_spec(T, d):
    ids, w = make_routing(T, E, K, seed=10 + T, invalid=True)
    imm, dfr = serving.select_deferred_experts(ids, w, E, K - d)
    rimm, rdfr = reference_split(ids, w, E, d)
    valid = (ids >= 0) & (ids < E)
    assert torch.equal(imm[valid], rimm[valid]) and torch.equal(dfr[valid], rdfr[valid])
    assert bool((imm[~valid] == -1).all()) and bool((dfr[~valid] == -1).all())
    # every valid slot is in exactly one set
    assert torch.equal((imm >= 0) ^ (dfr >= 0), valid)


# ------------------------------------------------------------------------------------------------
# SGLang's call sequence (kt_ep_wrapper.apply), replayed on CPU tensors


def test_sglang_call_sequence_with_deferred_experts():
    L, d = 3, 2
    weights = [make_weights(E, H, I, seed=20 + l) for l in range(L)]
    steps = [1, 4, 3, 4, 1]  # batch sizes per decode/prefill step; 3 is not a capture size
    kt_jit.KTMoEWrapper.set_capture_batch_sizes([1, 2, 4])
    g = torch.Generator().manual_seed(7)
    masks0 = [torch.rand(E, generator=g) < 0.25 for _ in range(L)]
    try:
        # create_weights: one wrapper per MoE layer, d = 0 on the last one
        wrappers = []
        for l in range(L):
            wr = kt_jit.KTMoEWrapper(
                layer_idx=l,
                num_experts=E,
                num_experts_per_tok=K,
                hidden_size=H,
                moe_intermediate_size=I,
                gpu_experts_mask=masks0[l],
                cpuinfer_threads=2,
                threadpool_count=1,
                weight_path="",
                chunked_prefill_size=2,  # exercise chunking inside the tasks
                method="AMXINT8",
                max_deferred_experts_per_token=d if l < L - 1 else 0,
            )
            wr.load_weights_from_tensors(*weights[l], torch.arange(E))
            wrappers.append(wr)
        deferral_mattered = 0.0
        for s, T in enumerate(steps):
            if s > 0:  # dynamic expert update: SGLang rewrites the masks in place
                for wr in wrappers:
                    wr.gpu_experts_mask.copy_(torch.rand(E, generator=g) < 0.3)
            carry_ref = None
            hidden = torch.randn(T, H, generator=g)
            for l, wr in enumerate(wrappers):
                ids, tw = make_routing(T, E, K, seed=1000 * s + l, invalid=(l == 1))
                mask = wr.gpu_experts_mask.clone()
                # apply(): submit on the side stream ...
                wr.submit_forward(hidden, ids, tw, 0)
                # ... the GPU experts meanwhile (CPU experts masked out) ...
                gpu_out = moe_reference(hidden, ids, tw, *weights[l], mask=~mask)
                # ... then sync and add
                cpu_out = wr.sync_forward(hidden, 0)
                out = gpu_out + cpu_out

                # reference of the CPU part with the deferral semantics
                dl = wr.max_deferred_experts_per_token
                imm, dfr = reference_split(ids, tw, E, dl) if dl > 0 else (ids, None)
                cpu_ref = moe_reference_actq(hidden, imm, tw, *weights[l], mask=mask)
                no_deferral = moe_reference_actq(hidden, ids, tw, *weights[l], mask=mask)
                if carry_ref is not None:
                    cpu_ref = cpu_ref + carry_ref
                carry_ref = (
                    moe_reference_actq(hidden, dfr, tw, *weights[l], mask=mask)
                    if dfr is not None
                    else None
                )
                err = rel_l1(cpu_out, cpu_ref)
                assert err <= 1e-3, f"step {s} layer {l}: rel L1 {err:.3g}"
                assert rel_l1(out, gpu_out + cpu_ref) <= 1e-3
                deferral_mattered = max(deferral_mattered, rel_l1(no_deferral, cpu_ref))
                hidden = (out / out.abs().amax().clamp_min(1e-6)).to(torch.float32)
        assert deferral_mattered > 1e-1, "the test never exercised a deferred contribution"
        assert serving.get_queue().pending == 0  # the last layer (d = 0) drained the queue
    finally:
        kt_jit.KTMoEWrapper.set_capture_batch_sizes([])
        kt_jit.KTMoEWrapper.clear_buffer_cache()
