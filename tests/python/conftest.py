"""Shared helpers for kt-jit's Python tests: an independent torch reference of the INT8 MoE math.

Nothing here calls ``kt_jit._core``: the reference is plain torch, written from SPEC.md §4 and the
AMXINT8 numerics (per-row symmetric int8 weights, per-token int8 activations).
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

# Keep the pool small and identical for every test in this process (the pool is process-wide).
THREADS = 2
POOLS = 1


def quantize_rows(w: torch.Tensor):
    """Symmetric per-row int8: d = amax/127 (fp32), q = clamp(rne(w * (1/d)), -127, 127).

    Returns (q as float32 integers, d fp32 [..., 1]). Rows of zeros get d = 0, q = 0.
    """
    w = w.to(torch.float32)
    amax = w.abs().amax(dim=-1, keepdim=True)
    d = amax / 127.0
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = torch.clamp(torch.round(w * inv), -127.0, 127.0)
    return q, d


def quantize_rows_int4(w: torch.Tensor):
    """AMXINT4 per row: d = amax/112, q8 = clamp(rne(w * (1/d)), -127, 127), then kt-kernel's
    round_4bit_s8: q4 = sign(q8) * ((|q8| + 8) >> 4) in [-7, 7].

    Returns (16 * q4 as float32 integers — the int8 value the kernels multiply — and d [..., 1]).
    """
    w = w.to(torch.float32)
    amax = w.abs().amax(dim=-1, keepdim=True)
    d = amax / 112.0
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q8 = torch.clamp(torch.round(w * inv), -127.0, 127.0)
    q4 = torch.sign(q8) * torch.floor((q8.abs() + 8.0) / 16.0)
    return 16.0 * q4, d


#: Weight quantizer per method (activations are always per-token int8).
WEIGHT_QUANTIZERS = {
    "AMXINT8": quantize_rows,
    "MOE_INT8": quantize_rows,
    "AMXINT4": quantize_rows_int4,
    "MOE_INT4": quantize_rows_int4,
}


def dequantize_rows(w: torch.Tensor, quantizer=quantize_rows) -> torch.Tensor:
    q, d = quantizer(w)
    return q * d


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def _valid_slots(ids: torch.Tensor, E: int, mask):
    valid = (ids >= 0) & (ids < E)
    if mask is not None:
        safe = ids.clamp(0, E - 1)
        valid &= ~mask.to(torch.bool)[safe]
    return valid


def _slots_by_expert(ids: torch.Tensor, E: int, mask):
    """For each physical slot p: (token indices, routing slot indices) of its valid uses."""
    valid = _valid_slots(ids, E, mask)
    tok, slot = torch.nonzero(valid, as_tuple=True)
    phys = ids[tok, slot]
    for p in torch.unique(phys).tolist():
        sel = phys == p
        yield int(p), tok[sel], slot[sel]


def moe_reference(x, ids, weights, gate, up, down, pmap=None, mask=None, wq=quantize_rows):
    """fp32 MoE from the dequantized weights and the unquantized input.

    x [T, H] (any float), ids [T, K] physical slots, weights [T, K]; gate/up [E, I, H] and
    down [E, H, I] logical experts; pmap[p] = logical expert held by physical slot p.
    """
    E = gate.shape[0]
    x = x.to(torch.float32)
    T, H = x.shape
    if pmap is None:
        pmap = torch.arange(E)
    gq = dequantize_rows(gate, wq)
    uq = dequantize_rows(up, wq)
    dq = dequantize_rows(down, wq)
    w = weights.to(torch.float32)
    out = torch.zeros(T, H, dtype=torch.float32)
    for p, tok, slot in _slots_by_expert(ids, E, mask):
        e = int(pmap[p])
        xs = x[tok]
        h = silu(xs @ gq[e].T) * (xs @ uq[e].T)
        out.index_add_(0, tok, w[tok, slot].unsqueeze(1) * (h @ dq[e].T))
    return out


def moe_reference_actq(x, ids, weights, gate, up, down, pmap=None, mask=None, wq=quantize_rows):
    """As moe_reference, but with the same activation quantization as the INT8 kernels.

    x is quantized per token over H, the intermediate h = silu(g) * u per (expert, token) over I;
    the integer dot products and the scaling are done in float64.
    """
    E = gate.shape[0]
    x = x.to(torch.float32)
    T, H = x.shape
    if pmap is None:
        pmap = torch.arange(E)
    gq, gd = wq(gate)
    uq, ud = wq(up)
    dq, dd = wq(down)
    gq, gd, uq, ud, dq, dd = (a.to(torch.float64) for a in (gq, gd, uq, ud, dq, dd))
    xq, xd = quantize_rows(x)  # per token over H
    xq, xd = xq.to(torch.float64), xd.to(torch.float64)
    w = weights.to(torch.float32).to(torch.float64)
    out = torch.zeros(T, H, dtype=torch.float64)
    for p, tok, slot in _slots_by_expert(ids, E, mask):
        e = int(pmap[p])
        xs, xds = xq[tok], xd[tok]  # [n, H], [n, 1]
        g = (xs @ gq[e].T) * (xds * gd[e][:, 0])  # [n, I]
        u = (xs @ uq[e].T) * (xds * ud[e][:, 0])
        h = (g / (1.0 + torch.exp(-g))) * u
        hq, hd = quantize_rows(h.to(torch.float32))  # per (expert, token) over I
        y = (hq.to(torch.float64) @ dq[e].T) * (hd.to(torch.float64) * dd[e][:, 0])
        out.index_add_(0, tok, w[tok, slot].unsqueeze(1) * y)
    return out


def rel_l1(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.to(torch.float64)
    ref = ref.to(torch.float64)
    return ((out - ref).abs().mean() / ref.abs().mean().clamp_min(1e-30)).item()


def make_weights(E, H, I, seed=0, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(E, I, H, generator=g) * scale
    up = torch.randn(E, I, H, generator=g) * scale
    down = torch.randn(E, H, I, generator=g) * scale
    return gate, up, down


def make_routing(T, E, K, seed=0, invalid=True):
    """ids [T, K] int64 (distinct experts per token) with some -1 and >= E slots; weights [T, K]."""
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else None
    if ids is None:
        ids = torch.empty(0, K, dtype=torch.int64)
    weights = torch.rand(T, K, generator=g)
    if invalid and T > 0:
        ids[0, K - 1] = -1
        if T > 1:
            ids[1, 0] = E
        if T > 2:
            ids[2, 1] = E + 7
            ids[T - 1, 0] = -5
    return ids.to(torch.int64), weights


def make_wrapper(E, K, H, I, method="AMXINT8", mask=None, chunked_prefill_size=1024, **kw):
    import kt_jit

    return kt_jit.KTMoEWrapper(
        layer_idx=0,
        num_experts=E,
        num_experts_per_tok=K,
        hidden_size=H,
        moe_intermediate_size=I,
        gpu_experts_mask=mask,
        cpuinfer_threads=THREADS,
        threadpool_count=POOLS,
        weight_path="",
        chunked_prefill_size=chunked_prefill_size,
        method=method,
        **kw,
    )


def run_python(code: str, env_extra=None, cwd=None, timeout=180):
    """Run ``code`` in a fresh interpreter; returns CompletedProcess (text)."""
    env = dict(os.environ)
    env.pop("KT_JIT_ISA", None)
    if env_extra:
        env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def ref():
    """The reference helpers as one namespace (tests use ``ref.moe_reference(...)`` etc.)."""
    return types.SimpleNamespace(
        quantize_rows=quantize_rows,
        quantize_rows_int4=quantize_rows_int4,
        WEIGHT_QUANTIZERS=WEIGHT_QUANTIZERS,
        dequantize_rows=dequantize_rows,
        silu=silu,
        moe_reference=moe_reference,
        moe_reference_actq=moe_reference_actq,
        rel_l1=rel_l1,
        make_weights=make_weights,
        make_routing=make_routing,
        make_wrapper=make_wrapper,
        run_python=run_python,
        THREADS=THREADS,
        POOLS=POOLS,
    )
