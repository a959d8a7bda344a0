"""kt-kernel (PyPI ``kt-kernel``) as a peer of ``kt-jit bench``: the same MoE shape, random weights,
routing and layer rotation, driven through kt-kernel's own extension API the way its bench scripts
(kt-kernel/bench/bench_moe_amx.py, bench_bf16_moe.py, bench_fp8_moe.py) drive it:
``CPUInfer`` + ``moe.MOEConfig`` + ``moe.<Class>(config)``, ``load_weights_task``, then per call
``CPUInfer.submit(moe.forward_task(...)); CPUInfer.sync()`` timed around both.

Runs in kt-kernel's own virtual environment (tools/peers/setup_peers.sh makes /opt/ktk-venv), never
in kt-jit's. Prints one JSON document on one stdout line (progress on stderr)::

    /opt/ktk-venv/bin/python tools/peers/ktkernel_bench.py --method AMXINT8 --tokens 1,1024
    /opt/ktk-venv/bin/python tools/peers/ktkernel_bench.py --probe      # which classes run here

``--probe`` builds a small layer of every candidate class in a child process each (so an illegal
instruction kills only the child), runs T = 1, 8 and 80 (the last takes kt-kernel's prefill/AMX
branch, ``qlen > 4·E/k``) and checks the output against a torch reference.

Timing follows kt-jit's bench: weights rotate over ``--layers`` copies (default: enough that the
experts touched between two uses of a layer exceed 4× L3, at least 4), one warm-up call per layer,
then median wall time per forward. Weight bytes = distinct experts touched × packed bytes per
expert (scales not counted), as in kt-jit's bench.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time

#: kt-jit method name -> (kt-kernel classes in the order kt-kernel's wrapper prefers them,
#: packed bytes per weight, how the weights are handed over).
METHODS = {
    "AMXINT8": (("AMXInt8_MOE",), 1.0, "bf16"),
    "AMXINT4": (("AMXInt4_MOE",), 0.5, "bf16"),
    "BF16": (("AMXBF16_MOE", "AVX2BF16_MOE"), 2.0, "bf16_experts"),
    "FP8": (("AMXFP8_MOE", "AVX2FP8_MOE"), 1.0, "fp8_block"),
    "FP8_PERCHANNEL": (("AMXFP8PerChannel_MOE",), 1.0, "fp8_channel"),
    "MOE_INT8": (("Int8_KERNEL_MOE",), 1.0, "bf16"),
    "MOE_INT4": (("Int4_KERNEL_MOE",), 0.5, "bf16"),
    "LLAMAFILE": (("MOE",), 34.0 / 32.0, "gguf_q8_0"),
}
#: Every class the probe tries: (class, source kind).
PROBE = [
    ("AMXInt8_MOE", "bf16"),
    ("AMXInt4_MOE", "bf16"),
    ("AMXInt4_1_MOE", "bf16"),
    ("AMXBF16_MOE", "bf16_experts"),
    ("AVX2BF16_MOE", "bf16_experts"),
    ("AMXFP8_MOE", "fp8_block"),
    ("AVX2FP8_MOE", "fp8_block"),
    ("AMXFP8PerChannel_MOE", "fp8_channel"),
    ("Int8_KERNEL_MOE", "bf16"),
    ("Int4_KERNEL_MOE", "bf16"),
    ("MOE", "gguf_q8_0"),
]
SHAPE = {"name": "Qwen3-30B-A3B", "experts": 128, "top_k": 8, "hidden": 2048, "intermediate": 768}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def l3_bytes() -> int:
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


def routing(torch, t, e, k, gen):
    """Same as kt-jit's bench: k distinct experts per token, weights uniform in [0, 1)."""
    ids = torch.rand(t, e, generator=gen).argsort(dim=1)[:, :k].contiguous().to(torch.int64)
    w = torch.rand(t, k, generator=gen, dtype=torch.float32).contiguous()
    return ids, w


def fp8_quantize(torch, w, block):
    """kt_jit.bench.fp8_quantize, here because this script runs in kt-kernel's environment: per
    128 x 128 block (or row) scale = amax / 448, e4m3 of w / scale; (codes, scales)."""
    E, n, k = w.shape
    nb, kb = (n + 127) // 128, (k + 127) // 128
    q = torch.empty(E, n, k, dtype=torch.float8_e4m3fn)
    scales = torch.empty(E, nb, kb) if block else torch.empty(E, n)
    for e in range(E):
        x = w[e].float()
        if block:
            pad = torch.zeros(nb * 128, kb * 128)
            pad[:n, :k] = x.abs()
            amax = pad.view(nb, 128, kb, 128).amax(dim=(1, 3))
        else:
            amax = x.abs().amax(dim=1)
        sc = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
        full = (
            sc.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
            if block
            else sc[:, None]
        )
        q[e] = (x / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        scales[e] = sc
    return q, scales


def q8_0_blocks(torch, w):
    """GGML Q8_0 bytes of a float [..., K] tensor (K % 32 == 0): per 32 values an fp16 scale
    amax/127 followed by 32 int8."""
    shp = w.shape
    b = w.reshape(-1, 32).float()
    d = b.abs().amax(dim=1, keepdim=True) / 127.0
    q = torch.where(d > 0, b / d, torch.zeros_like(b)).round().clamp(-127, 127).to(torch.int8)
    blk = torch.cat([d.half().view(torch.int8).reshape(-1, 2), q], dim=1)
    return blk.reshape(*shp[:-1], shp[-1] // 32 * 34).contiguous()


class Source:
    """Weights of one layer in the form a class loads, plus the float weights they stand for."""

    def __init__(self, torch, kind, gate, up, down):
        self.kind = kind
        self.keep = []
        if kind in ("bf16", "bf16_experts"):
            self.mats = [t.bfloat16().contiguous() for t in (gate, up, down)]
            self.ref = [t.float() for t in self.mats]
            self.scales = None
        elif kind in ("fp8_block", "fp8_channel"):
            # As kt-jit's bench (kt_jit.bench.fp8_quantize): per 128 x 128 block (or row) the
            # scale is amax / 448, as FP8 checkpoints are made.
            block = kind == "fp8_block"
            self.mats, self.scales, self.ref = [], [], []
            for t in (gate, up, down):
                q, sc = fp8_quantize(torch, t, block)
                self.mats.append(q)
                self.scales.append(sc)
                n, k = q.shape[1], q.shape[2]
                full = (
                    sc.repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)[:, :, :k]
                    if block
                    else sc[:, :, None]
                )
                self.ref.append(q.float() * full)
        elif kind == "gguf_q8_0":
            self.mats = [q8_0_blocks(torch, t) for t in (gate, up, down)]
            self.ref = []
            for m, t in zip(self.mats, (gate, up, down)):
                blk = m.reshape(-1, 34)
                d = blk[:, :2].contiguous().view(torch.float16).float()
                self.ref.append((blk[:, 2:].float() * d).reshape(t.shape))
            self.scales = None
        else:
            raise ValueError(kind)

    def configure(self, ext, cfg):
        """Point a MOEConfig at the weights the way kt-kernel's Python wrappers do."""
        if self.kind == "bf16":  # AMXMoEWrapper.load_weights_from_tensors (online quantization)
            cfg.gate_proj, cfg.up_proj, cfg.down_proj = [m.data_ptr() for m in self.mats]
            cfg.save = False
            cfg.load = False
        elif self.kind in ("bf16_experts", "fp8_block", "fp8_channel"):  # NativeMoEWrapper
            E = self.mats[0].shape[0]
            ptrs = [[[m[e].data_ptr() for e in range(E)]] for m in self.mats]
            cfg.gate_projs, cfg.up_projs, cfg.down_projs = ptrs
            if self.scales is None:
                sc = [[[0] * E] for _ in range(3)]
            else:
                sc = [[[s[e].data_ptr() for e in range(E)]] for s in self.scales]
            cfg.gate_scales, cfg.up_scales, cfg.down_scales = sc
            if self.kind != "bf16_experts":
                cfg.quant_config.bits = 8
                cfg.quant_config.zero_point = False
                if self.kind == "fp8_block":
                    cfg.quant_config.group_size = 128
                else:
                    cfg.quant_config.per_channel = True
        elif self.kind == "gguf_q8_0":  # LlamafileMoEWrapper.load_weights
            gt = ext.kvcache.ggml_type
            cfg.m_block = 32
            cfg.group_min_len = 10
            cfg.group_max_len = cfg.max_len
            cfg.gate_proj, cfg.up_proj, cfg.down_proj = [m.data_ptr() for m in self.mats]
            cfg.gate_type = cfg.up_type = cfg.down_type = gt.Q8_0
            cfg.hidden_type = gt.BF16


def make_cpuinfer(ext, threads):
    """One subpool of ``threads`` threads on NUMA node 0 (kt-kernel's wrapper with
    threadpool_count = 1)."""
    wc = ext.WorkerPoolConfig()
    wc.subpool_count = 1
    wc.subpool_numa_map = [0]
    wc.subpool_thread_count = [threads]
    return ext.CPUInfer(wc)


def build_layer(ext, torch, cpuinfer, cls_name, src, E, K, H, I, max_len, mask):
    cfg = ext.moe.MOEConfig(E, K, H, I, mask.data_ptr())
    cfg.layer_idx = 0
    cfg.pool = cpuinfer.backend_
    cfg.max_len = max_len
    src.configure(ext, cfg)
    moe = getattr(ext.moe, cls_name)(cfg)
    ident = torch.arange(E, dtype=torch.int64)
    cpuinfer.submit(moe.load_weights_task(ident.data_ptr()))
    cpuinfer.sync()
    return moe


class Call:
    """Pinned-free CPU buffers for one token count, as bench_moe_amx.py allocates them."""

    def __init__(self, torch, x, ids, w):
        t, H = x.shape
        self.t = t
        self.k = ids.shape[1]
        self.x = x.bfloat16().contiguous()
        self.ids = ids.to(torch.int64).contiguous()
        self.w = w.float().contiguous()
        self.out = torch.zeros(t, H, dtype=torch.bfloat16)
        self.bsz = torch.tensor([t], dtype=torch.int32)

    def run(self, cpuinfer, moe):
        cpuinfer.submit(
            moe.forward_task(
                self.bsz.data_ptr(),
                self.k,
                self.ids.data_ptr(),
                self.w.data_ptr(),
                self.x.data_ptr(),
                self.out.data_ptr(),
                False,
            )
        )
        cpuinfer.sync()


def reference(torch, ref, x, ids, w):
    g, u, d = ref
    xf = x.bfloat16().float()
    out = torch.zeros(x.shape[0], x.shape[1])
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = torch.nn.functional.silu(g[e] @ xf[t]) * (u[e] @ xf[t])
            out[t] += w[t, j] * (d[e] @ h)
    return out


def rel_l1(torch, out, ref):
    den = float(ref.abs().mean())
    return float((out.float() - ref).abs().mean()) / den if den > 0 else float("nan")


# --- probe --------------------------------------------------------------------------------------


def probe_one(cls_name, kind, threads):
    """Child process: small layer of one class, T = 1, 8, 80, relative L1 error vs torch."""
    import torch

    import kt_kernel  # noqa: F401  (picks and registers the extension for this CPU)
    from kt_kernel import kt_kernel_ext as ext

    if not hasattr(ext.moe, cls_name):
        return {"class": cls_name, "status": "absent", "detail": "not compiled into this variant"}
    E, K, H, I = 8, 2, 2048, 768
    gen = torch.Generator().manual_seed(1)
    gate = torch.randn(E, I, H, generator=gen) * 0.02
    up = torch.randn(E, I, H, generator=gen) * 0.02
    down = torch.randn(E, H, I, generator=gen) * 0.02
    src = Source(torch, kind, gate, up, down)
    cpuinfer = make_cpuinfer(ext, threads)
    mask = torch.zeros(E, dtype=torch.bool)
    moe = build_layer(ext, torch, cpuinfer, cls_name, src, E, K, H, I, 128, mask)
    errs = {}
    for t in (1, 8, 80):
        x = torch.randn(t, H, generator=gen)
        ids, w = routing(torch, t, E, K, gen)
        c = Call(torch, x, ids, w)
        c.run(cpuinfer, moe)
        errs[t] = rel_l1(torch, c.out, reference(torch, src.ref, x, ids, w))
    ok = all(math.isfinite(v) and v < 0.5 for v in errs.values())
    return {
        "class": cls_name,
        "status": "ok" if ok else "wrong",
        "rel_l1": errs,
        "variant": getattr(ext, "__cpu_variant__", "?"),
    }


def probe(threads):
    rows = []
    for cls_name, kind in PROBE:
        cmd = [sys.executable, __file__, "--probe-one", cls_name, "--source", kind]
        cmd += ["--threads", str(threads)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            rows.append({"class": cls_name, "status": "timeout"})
            log(f"{cls_name:24s} timeout")
            continue
        if p.returncode < 0:
            sig = signal.Signals(-p.returncode).name
            row = {"class": cls_name, "status": sig, "detail": p.stderr.strip()[-300:]}
        elif p.returncode != 0:
            tail = p.stderr.strip().splitlines()[-1:] or [""]
            row = {"class": cls_name, "status": "error", "detail": tail[0][-300:]}
        else:
            row = json.loads(p.stdout.strip().splitlines()[-1])
        rows.append(row)
        log(f"{cls_name:24s} {row['status']:8s} {row.get('rel_l1', row.get('detail', ''))}")
    return rows


# --- benchmark ----------------------------------------------------------------------------------


def default_reps(t):
    return 30 if t <= 16 else 15 if t <= 64 else 7 if t <= 256 else 5


def bench(args):
    import torch

    import kt_kernel
    from kt_kernel import kt_kernel_ext as ext

    torch.set_num_threads(max(1, args.threads))
    classes, bpw, kind = METHODS[args.method]
    cls_name = args.cls or next((c for c in classes if hasattr(ext.moe, c)), None)
    if cls_name is None or not hasattr(ext.moe, cls_name):
        return {
            "peer": "kt-kernel",
            "method": args.method,
            "skipped": f"{'/'.join(classes)} not compiled into kt-kernel's "
            f"{getattr(ext, '__cpu_variant__', '?')} extension",
        }
    E, K, H, I = args.experts, args.top_k, args.hidden, args.intermediate
    expert_bytes = int(3 * H * I * bpw)
    layer_bytes = E * expert_bytes
    layers_n = args.layers
    if not layers_n:
        min_touched = min(E, K * min(args.tokens)) * expert_bytes
        layers_n = max(4, math.ceil(4 * l3_bytes() / max(1, min_touched)))
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        layers_n = max(2, min(layers_n, int(0.5 * avail // layer_bytes)))

    cpuinfer = make_cpuinfer(ext, max(1, args.threads))
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    gate = torch.randn(E, I, H, generator=gen).mul_(0.02)
    up = torch.randn(E, I, H, generator=gen).mul_(0.02)
    down = torch.randn(E, H, I, generator=gen).mul_(0.02)
    src = Source(torch, kind, gate, up, down)
    del gate, up, down
    mask = torch.zeros(E, dtype=torch.bool)
    max_len = max(max(args.tokens), 512)  # AMXInt4_MOE aborts below M_STEP = 32 rows
    layers = [
        build_layer(ext, torch, cpuinfer, cls_name, src, E, K, H, I, max_len, mask)
        for _ in range(layers_n)
    ]
    load_s = time.perf_counter() - t0
    log(
        f"kt-kernel {kt_kernel.__version__} ({ext.__cpu_variant__}): {layers_n} x {cls_name} "
        f"layers ({layers_n * layer_bytes / 1e9:.2f} GB packed) loaded in {load_s:.1f} s"
    )

    inputs = torch.load(args.inputs) if args.inputs else {}
    # accuracy: T = 4 against torch on the weights the class was given
    te = 4
    x = torch.randn(te, H, generator=gen)
    ids, w = routing(torch, te, E, K, gen)
    c = Call(torch, x, ids, w)
    c.run(cpuinfer, layers[0])
    err = rel_l1(torch, c.out, reference(torch, src.ref, x, ids, w))
    del src

    results = []
    for t in args.tokens:
        if t in inputs:
            x, ids, w = inputs[t]
        else:
            x = torch.randn(t, H, generator=gen)
            ids, w = routing(torch, t, E, K, gen)
        c = Call(torch, x, ids, w)
        touched = int(torch.unique(ids).numel())
        wbytes = touched * expert_bytes
        ops = 2.0 * t * K * 3 * H * I
        for i in range(args.warmup or layers_n):
            c.run(cpuinfer, layers[i % layers_n])
        times = []
        start = time.perf_counter()
        for i in range(args.reps or default_reps(t)):
            a = time.perf_counter_ns()
            c.run(cpuinfer, layers[i % layers_n])
            times.append((time.perf_counter_ns() - a) * 1e-9)
            if len(times) >= 3 and time.perf_counter() - start > args.budget_s:
                break
        sec = statistics.median(times)
        r = {
            "tokens": t,
            "us": sec * 1e6,
            "us_min": min(times) * 1e6,
            "us_max": max(times) * 1e6,
            "reps": len(times),
            "experts_touched": touched,
            "weight_bytes": wbytes,
            "weight_gbs": wbytes / sec / 1e9,
            "gops": ops / sec / 1e9,
        }
        results.append(r)
        log(
            f"kt-kernel T={t:5d}: {r['us']:10.1f} µs  {r['weight_gbs']:6.2f} GB/s  "
            f"{r['gops']:7.1f} Gop/s  ({r['reps']} reps)"
        )
    return {
        "peer": "kt-kernel",
        "version": getattr(kt_kernel, "__version__", "?"),
        "variant": getattr(ext, "__cpu_variant__", "?"),
        "int8_kernel": getattr(ext, "__int8_kernel__", "?"),
        "method": args.method,
        "class": cls_name,
        "threads": args.threads,
        "threadpool_count": 1,
        "layers": layers_n,
        "shape": {"experts": E, "top_k": K, "hidden": H, "intermediate": I},
        "bytes_per_weight": bpw,
        "same_routing_as_ktjit": bool(inputs),
        "error_rel_l1": err,
        "results": results,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="AMXINT8", choices=sorted(METHODS))
    p.add_argument(
        "--class", dest="cls", default="", help="kt-kernel class (default: as its wrapper)"
    )
    p.add_argument("--tokens", default="1,4,16,64,256,1024")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--reps", type=int, default=0)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--experts", type=int, default=SHAPE["experts"])
    p.add_argument("--top-k", type=int, default=SHAPE["top_k"])
    p.add_argument("--hidden", type=int, default=SHAPE["hidden"])
    p.add_argument("--intermediate", type=int, default=SHAPE["intermediate"])
    p.add_argument("--inputs", default="", help="torch.save'd {T: (x, ids, w)} to reuse routing")
    p.add_argument("--probe", action="store_true", help="which kt-kernel classes run on this CPU")
    p.add_argument("--probe-one", default="", help=argparse.SUPPRESS)
    p.add_argument("--source", default="bf16", help=argparse.SUPPRESS)
    p.add_argument("--json", default="", help="also write the JSON here")
    args = p.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",") if t]

    if args.probe_one:
        print(json.dumps(probe_one(args.probe_one, args.source, max(1, args.threads))))
        return 0
    if args.probe:
        doc = {"peer": "kt-kernel", "probe": probe(max(1, args.threads))}
    else:
        doc = bench(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    # One line, so that a reader can find it among kt-kernel's own stdout chatter (its CPUInfer
    # prints "Hello"/"Goodbye" lines, the last one at exit).
    print(json.dumps(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
