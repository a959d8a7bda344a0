"""Serving overhead: median µs of forward() vs submit_forward()+sync_forward() vs the bare native
call, T=1 on a tiny layer (H 256, I 128, E 8, top 2). Not a test.

    python -m kt_jit.bench_overhead [--iters 2000] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import kt_jit


def _median_us(fn, iters: int, warmup: int = 200) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t0)
    return statistics.median(ts) / 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--method", default="AMXINT8")
    a = p.parse_args(argv)
    E, K, H, I, T = 8, 2, 256, 128, 1
    g = torch.Generator().manual_seed(0)
    wr = kt_jit.KTMoEWrapper(0, E, K, H, I, None, a.threads, 1, "", 1024, method=a.method)
    wr.load_weights_from_tensors(
        torch.randn(E, I, H, generator=g) * 0.05,
        torch.randn(E, I, H, generator=g) * 0.05,
        torch.randn(E, H, I, generator=g) * 0.05,
    )
    x = torch.randn(T, H, generator=g)
    ids = torch.tensor([[1, 5]])
    w = torch.rand(T, K, generator=g)
    out = torch.empty(T, H)
    ids64, w32 = ids.contiguous(), w.contiguous()

    def native():
        wr.moe.forward(T, x.data_ptr(), ids64.data_ptr(), w32.data_ptr(), 0, out.data_ptr())

    def submit_sync():
        wr.submit_forward(x, ids, w, None)
        wr.sync_forward(x, None)

    kernel = _median_us(native, a.iters)
    fwd = _median_us(lambda: wr.forward(x, ids, w), a.iters)
    ss = _median_us(submit_sync, a.iters)
    print(f"kt-jit {kt_jit.__version__} isa={kt_jit.__isa__} threads={a.threads} method={a.method}")
    print(f"T=1 H={H} I={I} E={E} K={K}, median of {a.iters}")
    print(f"  native MoELayer.forward (kernel time): {kernel:8.1f} us")
    print(f"  KTMoEWrapper.forward():               {fwd:8.1f} us  (+{fwd - kernel:.1f})")
    print(f"  submit_forward + sync_forward:        {ss:8.1f} us  (+{ss - kernel:.1f})")


if __name__ == "__main__":
    main()
