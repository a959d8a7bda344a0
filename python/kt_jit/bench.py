"""``kt-jit bench``: the MoE forward against the machine's own limits, measured in one process.

1. Machine limits through ``_core.machine_limits()`` (generated loops: streaming read bandwidth on
   1 and 2 threads, peak throughput of vpdpbusd / vpmaddubsw / FMA / vdpbf16ps on one core).
2. The MoE forward through ``_core.MoELayer`` at the Qwen3-30B-A3B shape (E 128, top 8, H 2048,
   I 768) for several token counts. Weights rotate over several layers so every call streams its
   experts from DRAM rather than from L3.

Reported per token count: median µs, tokens/s, effective weight GB/s (bytes of the distinct experts
touched / time), Gop/s (2 per multiply-accumulate), and roof% = max(bytes / read_bw, ops / peak) /
time with the limits of the same run (peak = vpdpbusd at VNNI levels, the vpmaddubsw sequence
otherwise; scaled by the thread count). Speed is reported, never asserted.

Usage: ``kt-jit bench [--tokens 1,4,16] [--threads 1] [--json PATH] [--markdown PATH]``
or ``python -m kt_jit.bench ...``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from typing import Dict, List, Optional

#: Qwen3-30B-A3B MoE block.
SHAPE = {"name": "Qwen3-30B-A3B", "experts": 128, "top_k": 8, "hidden": 2048, "intermediate": 768}
DEFAULT_TOKENS = (1, 4, 16, 64, 256, 1024)
VNNI_LEVELS = ("avx512_vnni", "avx512_bf16", "amx")


BYTES_PER_WEIGHT = {
    "AMXINT8": 1.0,
    "MOE_INT8": 1.0,
    "AMXINT4": 0.5,
    "MOE_INT4": 0.5,
    "BF16": 2.0,
    "FP8": 1.0,
    "FP8_PERCHANNEL": 1.0,
}
WEIGHT_NAME = {
    "AMXINT4": "int4",
    "MOE_INT4": "int4",
    "BF16": "bf16",
    "FP8": "fp8",
    "FP8_PERCHANNEL": "fp8",
}


def _load_layer(layer, method, gate, up, down, torch):
    """Random weights into a layer: float tensors, or e4m3 + scales for the FP8 methods."""
    if not method.startswith("FP8"):
        layer.load_from_float(gate.data_ptr(), up.data_ptr(), down.data_ptr(), "f32", 0)
        return
    E = gate.shape[0]
    mats = [(t * 50).clamp(-448, 448).to(torch.float8_e4m3fn) for t in (gate, up, down)]
    if method == "FP8":
        scales = [
            torch.full((E, (m.shape[1] + 127) // 128, (m.shape[2] + 127) // 128), 0.02)
            for m in mats
        ]
    else:
        scales = [torch.full((E, m.shape[1]), 0.02) for m in mats]
    slots = list(range(E))
    layer.load_experts_fp8(slots, *[[t[e].data_ptr() for e in slots] for t in mats + scales])


def _l3_bytes() -> int:
    """L3 size as the OS reports it (32 MiB when it cannot be read)."""
    path = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for idx in sorted(os.listdir(path)):
            base = os.path.join(path, idx)
            with open(os.path.join(base, "level")) as f:
                if f.read().strip() != "3":
                    continue
            with open(os.path.join(base, "size")) as f:
                s = f.read().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
            return int(s.rstrip("KMG")) * mult
    except (OSError, ValueError):
        pass
    return 32 << 20


def _parse_tokens(s: str) -> List[int]:
    out = [int(t) for t in s.replace(" ", "").split(",") if t]
    if not out or any(t < 1 for t in out):
        raise argparse.ArgumentTypeError(f"bad token list {s!r}")
    return out


def _default_reps(t: int) -> int:
    if t <= 16:
        return 30
    if t <= 64:
        return 15
    if t <= 256:
        return 7
    return 5


def _routing(torch, t: int, e: int, k: int, gen):
    """Random top-k per token: k distinct experts, weights uniform in [0, 1)."""
    ids = torch.rand(t, e, generator=gen).argsort(dim=1)[:, :k].contiguous().to(torch.int64)
    w = torch.rand(t, k, generator=gen, dtype=torch.float32).contiguous()
    return ids, w


def _fmt(v: float, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:,.{digits}f}"


def _markdown_table(results: List[Dict]) -> str:
    peer = any("torch_us" in r for r in results)
    head = "| T | µs (median) | tokens/s | experts touched | weight GB/s | Gop/s | roof% | bound |"
    rule = "|---:|---:|---:|---:|---:|---:|---:|---|"
    if peer:
        head += " torch bf16 µs | vs torch |"
        rule += "---:|---:|"
    lines = [head, rule]
    for r in results:
        line = (
            f"| {r['tokens']} | {_fmt(r['us'])} | {_fmt(r['tokens_per_s'])} | "
            f"{r['experts_touched']} | {_fmt(r['weight_gbs'], 2)} | {_fmt(r['gops'])} | "
            f"{_fmt(r['roof_pct'])}% | {r['bound']} |"
        )
        if peer:
            line += f" {_fmt(r.get('torch_us', 0))} | {r.get('speedup_vs_torch', 0):.1f}x |"
        lines.append(line)
    return "\n".join(lines)


def _limits_lines(lim: Dict, read_bw: float, peak: float, peak_name: str, threads: int) -> str:
    return "\n".join(
        [
            f"- read bandwidth: {_fmt(lim.get('read_gbs_1t', 0), 2)} GB/s (1 thread), "
            f"{_fmt(lim.get('read_gbs_2t', 0), 2)} GB/s (2 threads)",
            f"- peaks per core: vpdpbusd {_fmt(lim.get('peak_vnni_gops', 0))} Gop/s, "
            f"vpmaddubsw+vpmaddwd+vpaddd {_fmt(lim.get('peak_maddubsw_gops', 0))} Gop/s, "
            f"FMA fp32 {_fmt(lim.get('peak_fma_gflops', 0))} GFLOP/s, "
            f"vdpbf16ps {_fmt(lim.get('peak_bf16_gflops', 0))} GFLOP/s",
            f"- roof% uses read bandwidth {_fmt(read_bw, 2)} GB/s and {peak_name} peak "
            f"{_fmt(peak)} Gop/s ({threads} thread{'s' if threads != 1 else ''})",
        ]
    )


def _torch_peer(torch, args, results, E, K, H, I, threads, layers_n):
    """torch's bf16 eager MoE (per-expert matmuls, the way an HF model block runs experts) on the
    same shape, token counts and rotation, in the same process; adds torch_us and speedup."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(args.seed + 1)
    n = max(2, min(layers_n, 2))  # bf16 layers are 2x the int8 bytes; 2 layers still exceed L3
    tl = [
        (
            torch.randn(E, I, H, generator=gen).mul_(0.02).bfloat16(),
            torch.randn(E, I, H, generator=gen).mul_(0.02).bfloat16(),
            torch.randn(E, H, I, generator=gen).mul_(0.02).bfloat16(),
        )
        for _ in range(n)
    ]

    def moe(layer, x, ids, w):
        g, u, d = layer
        out = torch.zeros(x.shape[0], H, dtype=torch.float32)
        for e in ids.unique().tolist():
            rows, slots = (ids == e).nonzero(as_tuple=True)
            xe = x[rows]
            h = torch.nn.functional.silu(xe @ g[e].T) * (xe @ u[e].T)
            out.index_add_(0, rows, (h @ d[e].T).float() * w[rows, slots, None])
        return out

    for r in results:
        t = r["tokens"]
        x = torch.randn(t, H, generator=gen).bfloat16()
        ids, w = _routing(torch, t, E, K, gen)
        moe(tl[0], x, ids, w)
        times = []
        start = time.perf_counter()
        for i in range(max(3, min(r["reps"], 10))):
            a = time.perf_counter_ns()
            moe(tl[i % n], x, ids, w)
            times.append((time.perf_counter_ns() - a) * 1e-9)
            if len(times) >= 3 and time.perf_counter() - start > args.budget_s:
                break
        r["torch_us"] = statistics.median(times) * 1e6
        r["speedup_vs_torch"] = r["torch_us"] / r["us"]
        print(
            f"T={t:5d}: torch bf16 eager {r['torch_us']:10.1f} µs -> kt-jit "
            f"{r['speedup_vs_torch']:.1f}x faster",
            flush=True,
        )


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="kt-jit bench", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--tokens",
        type=_parse_tokens,
        default=list(DEFAULT_TOKENS),
        help="comma-separated token counts (default 1,4,16,64,256,1024)",
    )
    p.add_argument("--threads", type=int, default=1, help="worker threads (default 1)")
    p.add_argument(
        "--layers",
        type=int,
        default=0,
        help="layers to rotate over (default: enough that the experts touched between "
        "two uses of a layer exceed 4x L3, at least 4)",
    )
    p.add_argument("--reps", type=int, default=0, help="timed reps per token count (default by T)")
    p.add_argument("--warmup", type=int, default=0, help="warm-up calls (default: one per layer)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=20.0,
        help="stop timing a token count after this many seconds (>= 3 reps)",
    )
    p.add_argument("--method", default="AMXINT8", help="MoELayer method (default AMXINT8)")
    p.add_argument(
        "--torch-peer",
        action="store_true",
        help="also time torch's bf16 eager MoE on the same shape in this process",
    )
    p.add_argument("--isa", default="", help="ISA level for the layer (default: selected)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write results as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the table as markdown with a header")
    args = p.parse_args(argv)

    import torch

    from . import _core

    threads = max(1, args.threads)
    _core.init_pool(threads, 1)
    feats = dict(_core.cpu_features())
    isa = args.isa or _core.isa()
    brand = str(feats.get("brand") or platform.processor() or platform.machine()).strip()
    command = "kt-jit bench " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
    )
    if argv is None and os.path.basename(sys.argv[0]) not in ("kt-jit", "kt-jit.exe"):
        command = "python -m kt_jit.bench " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    print(f"# kt-jit bench: {brand}, isa {isa}, {threads} thread(s)", flush=True)

    # --- 1. machine limits, same process ---------------------------------------------------------
    t0 = time.perf_counter()
    lim = dict(_core.machine_limits())
    print(f"machine limits measured in {time.perf_counter() - t0:.1f} s", flush=True)
    if threads == 1 or not lim.get("read_gbs_2t"):
        read_bw = float(lim.get("read_gbs_1t", 0.0))
    else:
        read_bw = float(lim["read_gbs_2t"])
    vnni = isa in VNNI_LEVELS and float(lim.get("peak_vnni_gops", 0.0)) > 0
    if args.method in ("BF16", "FP8", "FP8_PERCHANNEL"):  # widened to fp32, vfmadd231ps
        peak_name, peak_key = "vfmadd231ps", "peak_fma_gflops"
    else:
        peak_name = "vpdpbusd" if vnni else "vpmaddubsw"
        peak_key = "peak_vnni_gops" if vnni else "peak_maddubsw_gops"
    peak_core = float(lim.get(peak_key, 0.0))
    peak = peak_core * threads
    print(_limits_lines(lim, read_bw, peak, peak_name, threads), flush=True)

    # --- 2. layers ---------------------------------------------------------------------------------
    E, K, H, I = SHAPE["experts"], SHAPE["top_k"], SHAPE["hidden"], SHAPE["intermediate"]
    # Packed weight bytes per element of the method (scales and compensations not counted).
    bytes_per_weight = BYTES_PER_WEIGHT.get(args.method, 1.0)
    wname = WEIGHT_NAME.get(args.method, "int8")
    expert_bytes = int(3 * H * I * bytes_per_weight)  # gate + up + down
    layer_bytes = E * expert_bytes
    l3 = _l3_bytes()
    min_touched = min(E, K * min(args.tokens)) * expert_bytes  # lower bound at the smallest T
    layers_n = args.layers or max(4, math.ceil(4 * l3 / max(1, min_touched)))
    if not args.layers:  # keep the rotation within half of the free memory
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            layers_n = max(2, min(layers_n, int(0.5 * avail // layer_bytes)))
        except (ValueError, OSError):
            pass
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    gate = torch.randn(E, I, H, generator=gen).mul_(0.02)
    up = torch.randn(E, I, H, generator=gen).mul_(0.02)
    down = torch.randn(E, H, I, generator=gen).mul_(0.02)
    layers = []
    for _ in range(layers_n):
        layer = _core.MoELayer(E, K, H, I, args.method, args.isa)
        _load_layer(layer, args.method, gate, up, down, torch)
        layers.append(layer)
    del gate, up, down
    print(
        f"{layers_n} layers x {layer_bytes / 1e6:.0f} MB {wname} = {layers_n * layer_bytes / 1e9:.2f} GB "
        f"(L3 {l3 / 2**20:.1f} MiB) loaded in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )

    # --- 3. accuracy: one small call against the C++ reference ------------------------------------
    te = 4
    x = torch.randn(te, H, generator=gen)
    ids, w = _routing(torch, te, E, K, gen)
    out = torch.zeros(te, H)
    ref = torch.zeros(te, H)
    layers[0].forward(te, x.data_ptr(), ids.data_ptr(), w.data_ptr(), 0, out.data_ptr())
    layers[0].forward_reference(te, x.data_ptr(), ids.data_ptr(), w.data_ptr(), 0, ref.data_ptr())
    err_abs = float((out - ref).abs().max().item())
    ref_max = float(ref.abs().max().item())
    err_rel = err_abs / ref_max if ref_max > 0 else float("nan")
    print(
        f"error vs forward_reference (T={te}): max abs {err_abs:.3g}, rel {err_rel:.3g}", flush=True
    )

    # --- 4. MoE forward ------------------------------------------------------------------------------
    results = []
    for t in args.tokens:
        x = torch.randn(t, H, generator=gen)
        ids, w = _routing(torch, t, E, K, gen)
        out = torch.empty(t, H)
        ptrs = (x.data_ptr(), ids.data_ptr(), w.data_ptr(), 0, out.data_ptr())
        touched = int(torch.unique(ids).numel())
        wbytes = touched * expert_bytes
        ops = 2.0 * t * K * 3 * H * I
        for i in range(args.warmup or layers_n):
            layers[i % layers_n].forward(t, *ptrs)
        reps = args.reps or _default_reps(t)
        times = []
        start = time.perf_counter()
        for i in range(reps):
            layer = layers[i % layers_n]
            a = time.perf_counter_ns()
            layer.forward(t, *ptrs)
            times.append((time.perf_counter_ns() - a) * 1e-9)
            if len(times) >= 3 and time.perf_counter() - start > args.budget_s:
                break
        sec = statistics.median(times)
        t_bw = wbytes / (read_bw * 1e9) if read_bw > 0 else 0.0
        t_op = ops / (peak * 1e9) if peak > 0 else 0.0
        r = {
            "tokens": t,
            "us": sec * 1e6,
            "us_min": min(times) * 1e6,
            "us_max": max(times) * 1e6,
            "reps": len(times),
            "tokens_per_s": t / sec,
            "experts_touched": touched,
            "weight_bytes": wbytes,
            "weight_gbs": wbytes / sec / 1e9,
            "ops": ops,
            "gops": ops / sec / 1e9,
            "roof_pct": 100.0 * max(t_bw, t_op) / sec if (t_bw or t_op) else float("nan"),
            "bound": "bandwidth" if t_bw >= t_op else "compute",
        }
        results.append(r)
        print(
            f"T={t:5d}: {r['us']:10.1f} µs  {r['weight_gbs']:6.2f} GB/s  {r['gops']:7.1f} Gop/s  "
            f"roof {r['roof_pct']:5.1f}%  ({r['reps']} reps)",
            flush=True,
        )

    if args.torch_peer:
        _torch_peer(torch, args, results, E, K, H, I, threads, layers_n)

    table = _markdown_table(results)
    print()
    print(table)

    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    if args.markdown:
        md = "\n".join(
            [
                f"# kt-jit MoE benchmark: {SHAPE['name']}",
                "",
                f"- machine: {brand} ({os.cpu_count()} CPUs visible, L3 {l3 / 2**20:.1f} MiB)",
                f"- ISA: {isa}; method {args.method}; threads {threads}",
                f"- date: {date}",
                f"- command: `{command}`",
                f"- shape: E {E}, top {K}, H {H}, I {I}; {wname} weights rotated over {layers_n} layers "
                f"({layers_n * layer_bytes / 1e9:.2f} GB)",
                f"- error vs forward_reference (T={te}): max abs {err_abs:.3g}, rel {err_rel:.3g}",
                "",
                "Machine limits (same run):",
                "",
                _limits_lines(lim, read_bw, peak, peak_name, threads),
                "",
                table,
                "",
            ]
        )
        with open(args.markdown, "w") as f:
            f.write(md)
    if args.json:
        doc = {
            "machine": {
                "brand": brand,
                "isa": isa,
                "cpus": os.cpu_count(),
                "l3_bytes": l3,
                "features": {
                    k: v for k, v in feats.items() if isinstance(v, (bool, int, float, str))
                },
            },
            "date": date,
            "command": command,
            "config": {
                "shape": SHAPE,
                "method": args.method,
                "threads": threads,
                "layers": layers_n,
                "seed": args.seed,
            },
            "limits": lim,
            "roof": {"read_gbs": read_bw, "peak_gops": peak, "peak_op": peak_name},
            "error": {"tokens": te, "max_abs": err_abs, "max_rel": err_rel},
            "results": results,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
