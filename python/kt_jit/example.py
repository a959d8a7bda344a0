"""The main job: one MoE layer at the Qwen3-30B-A3B shape on built-in random weights.

Prints the version, the ISA, the kernels generated, tokens/s for decode and prefill, and the error
against an independent torch fp32 reference computed from the dequantized weights.

    python -m kt_jit.example [--threads N] [--tokens 1,128] [--reps 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import kt_jit
from kt_jit import _core

# Qwen3-30B-A3B: 128 experts, top 8, hidden 2048, moe_intermediate 768.
E, TOP_K, H, I = 128, 8, 2048, 768


def quantize_rows(w: torch.Tensor) -> torch.Tensor:
    """Per-output-row symmetric int8 (d = amax/127, round half to even), dequantized back."""
    w = w.float()
    d = w.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return torch.clamp(torch.round(w * inv), -127, 127) * d


def reference(x, ids, weights, gate, up, down):
    out = torch.zeros(x.shape[0], H, dtype=torch.float32)
    for e in ids.unique().tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        g, u, dn = quantize_rows(gate[e]), quantize_rows(up[e]), quantize_rows(down[e])
        xe = x[rows].float()
        h = torch.nn.functional.silu(xe @ g.T) * (xe @ u.T)
        out.index_add_(0, rows, (h @ dn.T) * weights[rows, slots, None])
    return out


def route(T: int, gen: torch.Generator):
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(T)])
    w = torch.rand(T, TOP_K, generator=gen)
    return ids, w / w.sum(-1, keepdim=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--tokens", default="1,128", help="comma-separated token counts to time")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)

    print(f"kt-jit {kt_jit.__version__}  isa={kt_jit.__isa__}  threads={args.threads}")
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    gate = (torch.randn(E, I, H, generator=gen) * 0.02).to(torch.bfloat16)
    up = (torch.randn(E, I, H, generator=gen) * 0.02).to(torch.bfloat16)
    down = (torch.randn(E, H, I, generator=gen) * 0.02).to(torch.bfloat16)
    print(
        f"random bf16 weights: E={E} top_k={TOP_K} H={H} I={I} ({time.perf_counter() - t0:.1f} s)"
    )

    moe = kt_jit.KTMoEWrapper(
        layer_idx=0,
        num_experts=E,
        num_experts_per_tok=TOP_K,
        hidden_size=H,
        moe_intermediate_size=I,
        gpu_experts_mask=None,
        cpuinfer_threads=args.threads,
        threadpool_count=1,
        weight_path="",
        chunked_prefill_size=4096,
        method="AMXINT8",
    )
    t0 = time.perf_counter()
    moe.load_weights_from_tensors(gate, up, down, torch.arange(E))
    dt = time.perf_counter() - t0
    gb = gate.numel() * 3 * 2 / 1e9
    print(f"loaded + quantized {gb:.2f} GB of bf16 in {dt:.2f} s ({gb / dt:.2f} GB/s)")
    names = moe.moe.kernel_names()
    stats = _core.cache_stats()
    # (the process's count also holds the activation row quantizers: quantize_* kernels)
    print(
        f"kernels generated in this process: {stats['misses']} ({stats['bytes']} bytes, "
        f"{stats['gen_us'] / 1e3:.2f} ms in all); the layer's {len(names)} GEMM kernels:"
    )
    for n in names:
        print(f"  {n}")

    # Accuracy against the independent torch reference (fp32, dequantized weights).
    x = torch.randn(16, H, generator=gen).to(torch.bfloat16)
    ids, w = route(16, gen)
    out = moe.forward(x, ids, w).float()
    ref = reference(x.float(), ids, w, gate, up, down)
    err = ((out - ref).abs().mean() / ref.abs().mean()).item()
    print(f"relative L1 error vs torch fp32 reference (T=16): {err:.2e}  (bar: 3e-2)")

    for T in [int(t) for t in args.tokens.split(",") if t]:
        times = []
        for _ in range(args.reps):
            x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
            ids, w = route(T, gen)
            t0 = time.perf_counter()
            moe.forward(x, ids, w)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        print(f"T={T:5d}: median {med * 1e3:8.3f} ms/layer  -> {T / med:9.1f} tokens/s (one layer)")
    return 0 if err <= 3e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
