"""One MoE layer's forward with every token routed to the same top-k experts, so their weights
stay in L2 / L3: the kernels' own speed, without the DRAM stream that `kt-jit bench` measures.

    python tools/hot_layer.py --method FP8 --tokens 1,3,8 [--shape qwen3] [--experts 8]
                              [--top-k 2] [--fp8-codes checkpoint|small] [--reps 300]

The layer has the shape's H and I, `--experts` experts and top-k `--top-k` (2 Qwen3 FP8 experts
are 9 MiB, in L3 here). T tokens give each of the top-k experts T rows (T = 1-4: the decode
tiles; from 5: the prefill tiers at avx512_bf16). Prints the median µs over the reps and the weight GB/s of the touched
experts' packed bytes. `--fp8-codes small` loads the e4m3 of 50·w with a constant 0.02 scale (the
bench's weights before 2026-11-27: zero-exponent codes in 1.25 % of the weights, which the pair
order's shift decode leaves to its table decode) instead of `bench.fp8_quantize`'s. A design aid
(docs/BENCHMARKS.md); speed is judged in `kt-jit bench`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kt_jit import _core, bench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="FP8")
    ap.add_argument("--tokens", default="1,3,8")
    ap.add_argument("--shape", default="qwen3", choices=sorted(bench.SHAPES))
    ap.add_argument("--experts", type=int, default=8, help="experts in the layer (default 8)")
    ap.add_argument("--top-k", type=int, default=2, help="experts each token takes (default 2)")
    ap.add_argument("--fp8-codes", default="checkpoint", choices=("checkpoint", "small"))
    ap.add_argument("--gguf-type", default="Q4_K", help="LLAMAFILE: the GGUF block type (Q4_K)")
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args()
    shape = bench.SHAPES[args.shape]
    E, K, H, I = args.experts, args.top_k, shape["hidden"], shape["intermediate"]
    _core.init_pool(1, 1)
    gen = torch.Generator().manual_seed(0)
    src = [torch.randn(*s, generator=gen).mul_(0.02) for s in ((E, I, H), (E, I, H), (E, H, I))]
    layer = bench._make_layer(_core, args.method, E, K, H, I, _core.isa(), args.gguf_type)
    # GGUF and MX methods load codes and scales drawn as `kt-jit bench` draws them
    codes = bench._random_sources(torch, args.method, E, H, I, gen, args.gguf_type)
    if codes is not None:
        bench._load_sources(layer, args.method, codes)
    elif args.fp8_codes == "small" and args.method.startswith("FP8"):
        mats = [(t * 50).clamp(-448, 448).to(torch.float8_e4m3fn) for t in src]
        if args.method == "FP8":
            scales = [
                torch.full((E, (m.shape[1] + 127) // 128, (m.shape[2] + 127) // 128), 0.02)
                for m in mats
            ]
        else:
            scales = [torch.full((E, m.shape[1]), 0.02) for m in mats]
        ptrs = [[t[e].data_ptr() for e in range(E)] for t in mats + scales]
        layer.load_experts_fp8(list(range(E)), *ptrs)
    else:
        bench._load_layer(layer, args.method, *src, torch)
    hot_bytes = layer.packed_bytes * K / E
    print(
        f"{args.method} {shape['name']}, isa {layer.isa}, {K} of {E} experts hot "
        f"({hot_bytes / 2**20:.1f} MiB), 1 thread"
    )
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, H, generator=gen)
        out = torch.zeros(T, H)
        ids = torch.arange(K, dtype=torch.int64).repeat(T, 1).contiguous()
        w = torch.full((T, K), 1.0 / K)
        ts = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            layer.forward(T, x.data_ptr(), ids.data_ptr(), w.data_ptr(), 0, out.data_ptr())
            ts.append(time.perf_counter() - t0)
        med = statistics.median(ts[args.reps // 10 :])
        print(f"T = {T:4d}: {med * 1e6:9.1f} µs  {hot_bytes / med / 1e9:6.1f} GB/s of weights")


if __name__ == "__main__":
    main()
