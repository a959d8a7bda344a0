"""AVX2-only smoke test of kt_jit, meant to run under ``qemu-x86_64 -cpu Haswell`` (see
run_haswell.sh), where CPUID reports no AVX-512 and any AVX-512 instruction is SIGILL.

Checks: the probe honours the emulated CPUID (no avx512f, level avx2); a tiny AMXINT8 MoE layer
loaded from random weights gives, for T in (1, 7, 32), the same bits as the core's plain C++
reference path and agrees with an independent fp32 torch reference over the dequantized weights.

Prints one ``PASS <check>`` / ``FAIL <check>: <why>`` line per check, then
``smoke: N passed, M failed``; exits 1 if anything failed. Natively on an AVX-512 host the CPUID
checks fail by design (with KT_JIT_ISA=avx2 only "cpuid reports no avx512f" does).
"""

from __future__ import annotations

import os
import sys
import time

T0 = time.time()
import torch  # noqa: E402

T_TORCH = time.time() - T0
import kt_jit  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from smoke_checks import check, check_matches_reference, run  # noqa: E402

E, K, H, I = 8, 2, 64, 48
TOL = 3e-2  # relative L1 vs the dequantized fp32 reference (as tests/python/test_moe_int8.py)


# --- independent torch reference (same math as tests/python/conftest.py: moe_reference) --------
def quantize_rows(w: torch.Tensor):
    """Symmetric per-row int8: d = amax/127, q = clamp(rne(w * (1/d)), -127, 127)."""
    w = w.to(torch.float32)
    amax = w.abs().amax(dim=-1, keepdim=True)
    d = amax / 127.0
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = torch.clamp(torch.round(w * inv), -127.0, 127.0)
    return q, d


def dequantize_rows(w: torch.Tensor) -> torch.Tensor:
    q, d = quantize_rows(w)
    return q * d


def moe_reference(x, ids, weights, gate, up, down, pmap):
    """fp32 MoE over the dequantized weights and the unquantized input; ids are physical slots,
    pmap[p] the logical expert in slot p; ids outside [0, E) contribute nothing."""
    x = x.to(torch.float32)
    T = x.shape[0]
    gq, uq, dq = dequantize_rows(gate), dequantize_rows(up), dequantize_rows(down)
    w = weights.to(torch.float32)
    out = torch.zeros(T, x.shape[1], dtype=torch.float32)
    for t in range(T):
        for j in range(ids.shape[1]):
            p = int(ids[t, j])
            if p < 0 or p >= E:
                continue
            e = int(pmap[p])
            g = gq[e] @ x[t]
            u = uq[e] @ x[t]
            h = g / (1.0 + torch.exp(-g)) * u
            out[t] += w[t, j] * (dq[e] @ h)
    return out


def rel_l1(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.to(torch.float64), ref.to(torch.float64)
    return ((out - ref).abs().mean() / ref.abs().mean().clamp_min(1e-30)).item()


def routing(T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int64)
    w = torch.rand(T, K, generator=g)
    if T > 1:
        ids[T - 1, 1] = -1  # an invalid slot contributes nothing
    return ids, w


def main() -> int:
    print(
        f"haswell_smoke: python {sys.version.split()[0]}, torch {torch.__version__} "
        f"(import {T_TORCH:.1f} s), kt_jit {kt_jit.__version__}, "
        f"KT_JIT_ISA={os.environ.get('KT_JIT_ISA', '')!r}",
        flush=True,
    )
    feats = kt_jit.cpu_features()
    print(f"haswell_smoke: cpu {feats.get('brand')!r}, isa {kt_jit.__isa__}", flush=True)
    check("isa is avx2", kt_jit.__isa__ == "avx2", f"kt_jit.__isa__ = {kt_jit.__isa__!r}")
    check(
        "cpuid reports no avx512f",
        feats["avx512f"] is False,
        f"cpu_features()['avx512f'] = {feats['avx512f']!r}",
    )
    check(
        "cpuid reports avx2", feats["avx2"] is True, f"cpu_features()['avx2'] = {feats['avx2']!r}"
    )

    g = torch.Generator().manual_seed(7)
    gate = torch.randn(E, I, H, generator=g) * 0.05
    up = torch.randn(E, I, H, generator=g) * 0.05
    down = torch.randn(E, H, I, generator=g) * 0.05
    pmap = torch.randperm(E, generator=torch.Generator().manual_seed(3))

    moe = kt_jit.KTMoEWrapper(
        layer_idx=0,
        num_experts=E,
        num_experts_per_tok=K,
        hidden_size=H,
        moe_intermediate_size=I,
        gpu_experts_mask=None,
        cpuinfer_threads=1,
        threadpool_count=1,
        weight_path="",
        chunked_prefill_size=1024,
        method="AMXINT8",
    )
    moe.load_weights_from_tensors(gate, up, down, pmap)
    layer = moe.moe
    names = list(layer.kernel_names())
    check("layer isa is avx2", layer.isa == "avx2", f"layer.isa = {layer.isa!r}")
    check(
        "kernels generated for avx2",
        bool(names) and all("avx2" in n for n in names),
        f"{len(names)} kernels, e.g. {names[:2]}",
    )

    # T=1 and 7 as asked; T=32 puts > 3 rows on an expert, so the avx2 prefill kernels run too.
    for T in (1, 7, 32):
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(100 + T))
        ids, w = routing(T, seed=T)
        t0 = time.time()
        out = moe.forward(x, ids, w)
        dt = time.time() - t0
        check(f"T={T} forward shape", tuple(out.shape) == (T, H), f"{tuple(out.shape)}, {dt:.2f} s")
        check(
            f"T={T} output finite and nonzero",
            bool(torch.isfinite(out).all()) and bool(out.abs().sum() > 0),
        )

        check_matches_reference(
            f"T={T} generated avx2 == forward_reference bitwise", layer, x, ids, w, out
        )

        torch_ref = moe_reference(x, ids, w, gate, up, down, pmap)
        err = rel_l1(out, torch_ref)
        check(f"T={T} vs torch fp32 reference", err <= TOL, f"relative L1 {err:.3g} (<= {TOL})")

    return 0


if __name__ == "__main__":
    run(main, T0)
