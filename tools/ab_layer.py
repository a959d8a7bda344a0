#!/usr/bin/env python3
"""In-process A/B of one MoE layer built two ways: the same weights, two environment settings.

On a shared VM a layer's time moves by up to ±25 % between processes, so two builds compared in
separate processes hide effects of a few percent. This builds two layers in one process with the
same random weights (as `kt-jit bench` makes them), each under its own environment setting read
when a layer is built (e.g. `KT_JIT_QGROUP_FOLDS=1` against `=0`), then alternates their forwards
pair by pair (the order flipping every pair) and prints the median of the per-pair time ratio
B / A (> 1: A is faster) with its quartiles. Run it a few times with `--order BA` too: which
layer is built first can matter (memory placement), so alternate the order between processes.

    PYTHONPATH=... python tools/ab_layer.py --method LLAMAFILE --gguf-type Q4_K --tokens 1024 \\
        --pairs 15 --a KT_JIT_QGROUP_FOLDS=1 --b KT_JIT_QGROUP_FOLDS=0 [--order BA]

Also prints both layers' prefill kernel names and the relative L1 difference of their outputs.
Timing only; correctness is the tests' job.

Kernels are cached by their key, so two layers whose settings give the same keys share their
kernels. To A/B a setting the generators read when they generate (the same keys, other code), pass
`--fresh-kernels`: each layer is then built after `_core.retire_kernels()`, with kernels of its
own. (A setting a generator reads once per process, e.g. into a `static`, still cannot differ.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _env(pair: str):
    key, sep, value = pair.partition("=")
    if not sep or not key:
        raise SystemExit(f"--a / --b take NAME=VALUE, got {pair!r}")
    return key, value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", default="LLAMAFILE")
    p.add_argument("--gguf-type", default="Q4_K")
    p.add_argument(
        "--shape", default="qwen3", help="a kt_jit.bench shape (qwen3, deepseek-v3, ...)"
    )
    p.add_argument(
        "--dims", default="", help="E,TOPK,H,I instead of --shape (small layers for a quick check)"
    )
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--pairs", type=int, default=15)
    p.add_argument("--a", action="append", default=[], help="NAME=VALUE for layer A (repeatable)")
    p.add_argument("--b", action="append", default=[], help="NAME=VALUE for layer B (repeatable)")
    p.add_argument("--order", choices=("AB", "BA"), default="AB", help="which layer is built first")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--fresh-kernels",
        action="store_true",
        help="generate each layer's kernels afresh (_core.retire_kernels() before each build), "
        "for settings the generators read when they generate",
    )
    p.add_argument(
        "--routings",
        type=int,
        default=1,
        help="draw this many routings and cycle through them, one per forward (decode: the "
        "same few experts every time would stay in L3; 16 make T = 1 stream from DRAM)",
    )
    args = p.parse_args(argv)
    if args.pairs < 1:
        raise SystemExit("--pairs must be at least 1")

    import torch

    from kt_jit import _core, bench

    if args.dims:
        try:
            E, K, H, I = (int(v) for v in args.dims.split(","))
        except ValueError:
            raise SystemExit(f"--dims takes E,TOPK,H,I, got {args.dims!r}") from None
        args.shape = args.dims
    elif args.shape in bench.SHAPES:
        shp = bench.SHAPES[args.shape]
        E, K, H, I = shp["experts"], shp["top_k"], shp["hidden"], shp["intermediate"]
    else:
        raise SystemExit(f"--shape must be one of {sorted(bench.SHAPES)}")
    if args.threads < 1:
        raise SystemExit("--threads must be at least 1")
    _core.init_pool(args.threads, 1)
    threads = int(_core.pool_info()["threads"])
    gen = torch.Generator().manual_seed(0)
    src = bench._random_sources(torch, args.method, E, H, I, gen, args.gguf_type)
    if src is None:  # float weights, quantized by the layer as kt-jit bench does
        src = [torch.randn(*s, generator=gen).mul_(0.02) for s in ((E, I, H), (E, I, H), (E, H, I))]
    envs = {"A": [_env(x) for x in args.a], "B": [_env(x) for x in args.b]}
    layers = {}
    for which in args.order:
        saved = {k: os.environ.get(k) for k, _ in envs[which]}
        os.environ.update(dict(envs[which]))
        try:
            if args.fresh_kernels:
                _core.retire_kernels()
            layer = bench._make_layer(_core, args.method, E, K, H, I, _core.isa(), args.gguf_type)
            if isinstance(src[0], torch.Tensor):
                bench._load_layer(layer, args.method, *src, torch)
            else:
                bench._load_sources(layer, args.method, src)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        layers[which] = layer
    del src
    for which in "AB":
        names = [n for n in layers[which].kernel_names() if "prefill" in n]
        print(f"{which} ({' '.join(args.a if which == 'A' else args.b) or 'no change'}):", names)

    T = args.tokens
    x = torch.randn(T, H, generator=gen)
    if args.routings < 1:
        raise SystemExit("--routings must be at least 1")
    routings = [bench._routing(torch, T, E, K, gen) for _ in range(args.routings)]
    outs = {k: torch.zeros(T, H) for k in "AB"}
    calls = {k: 0 for k in "AB"}

    def run(which):
        ids, w = routings[calls[which] % len(routings)]
        calls[which] += 1
        t0 = time.perf_counter()
        layers[which].forward(
            T, x.data_ptr(), ids.data_ptr(), w.data_ptr(), 0, outs[which].data_ptr()
        )
        return time.perf_counter() - t0

    for which in "AB":
        run(which)
    diff = float((outs["A"] - outs["B"]).abs().sum() / outs["B"].abs().sum().clamp_min(1e-30))
    print(f"relative L1 difference of the outputs: {diff:.3g}")
    ta, tb, ratio = [], [], []
    for i in range(args.pairs):
        t = {}
        for which in ("AB" if i % 2 == 0 else "BA"):
            t[which] = run(which)
        ta.append(t["A"])
        tb.append(t["B"])
        ratio.append(t["B"] / t["A"])
    q = statistics.quantiles(ratio, n=4) if len(ratio) > 1 else [ratio[0]] * 3
    print(
        f"{args.method} {args.gguf_type if args.method == 'LLAMAFILE' else ''} {args.shape} "
        f"T={T}, {threads} thread(s), built {args.order}: A {statistics.median(ta) * 1e3:.1f} "
        f"ms, B {statistics.median(tb) * 1e3:.1f} ms (medians); per-pair B/A median "
        f"{statistics.median(ratio):.3f} (quartiles {q[0]:.3f}, {q[2]:.3f}), {args.pairs} pairs"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
