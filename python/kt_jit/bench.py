"""``kt-jit bench``: the MoE forward against the machine's own limits, measured in one process.

1. Machine limits through ``_core.machine_limits()`` (generated loops: streaming read bandwidth on
   1 and 2 threads, peak throughput of vpdpbusd / vpmaddubsw / FMA / vdpbf16ps on one core).
2. The MoE forward through ``_core.MoELayer`` at the Qwen3-30B-A3B shape (E 128, top 8, H 2048,
   I 768) for several token counts. Weights rotate over several layers so every call streams its
   experts from DRAM rather than from L3.

Reported per token count: median µs, tokens/s, effective weight GB/s (bytes of the distinct experts
touched / time), Gop/s (2 per multiply-accumulate), and roof% = max(bytes / read_bw, ops / peak) /
time with the limits of the same run (peak: the best of 7 runs of the instruction's loop;
vpdpbusd at VNNI levels, the vpmaddubsw sequence
otherwise — vpmaddubsw + vpaddw for qgroup layers whose every kernel takes int16 group sums —
FMA / vdpbf16ps / AMX for the float formats; with more than one thread, that loop measured on all
of them at once, ``_threads_peak``). Bandwidth-bound token
counts also get ``PAIRED_REPS`` more reps, each between two passes of a read probe on the same
threads (with more than one, every pool thread reading its part of the probe's buffer): the median
of their GB/s over the adjacent probes is "% of adjacent read probes" (``_paired_ratio``), which
the machine's bandwidth drifting between the start-of-run probe and the rep cannot skew.
Speed is reported, never asserted.

Peers, each only when asked for and installed (otherwise skipped with the reason printed), run
right after the kt-jit rows in the same process and time window, against the same limits:
``--torch-peer`` (torch bf16 eager MoE), ``--ktkernel-peer [PYTHON]`` (kt-kernel from PyPI in its
own virtual environment, tools/peers/ktkernel_bench.py, same shape, weights, routing and layer
rotation) and ``--onednn-peer`` (oneDNN matmul on the expert's matrices, tools/peers/
onednn_bench.cpp, built on demand with ``g++ ... -ldnnl``). tools/peers/setup_peers.sh installs
the last two. Ratios printed: kt-jit vs kt-kernel per T; kt-jit vs oneDNN at matching rows per
expert (M = T·top_k / experts touched): weight bandwidth at M = 1, throughput at larger M.

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
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

#: Qwen3-30B-A3B MoE block.
SHAPES = {
    "qwen3": {
        "name": "Qwen3-30B-A3B",
        "experts": 128,
        "top_k": 8,
        "hidden": 2048,
        "intermediate": 768,
    },
    # DeepSeek-V3's expert shape with a 32-expert subset of its 256 (a layer is 11 GB in int8):
    # T = 1 still streams 8 experts = 352 MB of int8 per forward.
    "deepseek-v3": {
        "name": "DeepSeek-V3 (32 of 256 experts)",
        "experts": 32,
        "top_k": 8,
        "hidden": 7168,
        "intermediate": 2048,
    },
    "mixtral": {
        "name": "Mixtral-8x7B",
        "experts": 8,
        "top_k": 2,
        "hidden": 4096,
        "intermediate": 14336,
    },
}
SHAPE = SHAPES["qwen3"]
DEFAULT_TOKENS = (1, 4, 16, 64, 256, 1024)
VNNI_LEVELS = ("avx512_vnni", "avx512_bf16", "amx")
NEON_LEVELS = ("neon", "neon_dotprod", "neon_bf16")


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


BYTES_PER_WEIGHT.update(  # first estimates (packed codes + per-group scales); measured after load
    {"LLAMAFILE": 0.75, "RAWINT4": 0.625, "GPTQ_INT4": 0.53, "MXFP4": 0.625, "MXFP8": 1.125}
)
WEIGHT_NAME.update(
    {
        "LLAMAFILE": "gguf",
        "RAWINT4": "int4g",
        "GPTQ_INT4": "int4g",
        "MXFP4": "mxfp4",
        "MXFP8": "mxfp8",
    }
)
#: GGUF block types as kt-jit stores them (formats/grouped.hpp): 4-bit codes through a table or
#: bytes, the scale group, an offset term, the super block of two-level scales (K-quants and
#: IQ4_XS: group scales are d * an integer, kept as int8 times an fp32 factor per 256), the 16-bit
#: type of one-level scales (legacy types: f16 d). Random codes in each type's range; scales of
#: that form.
GGUF_TYPES = {
    "Q4_0": {"lut": [i - 8 for i in range(16)], "group": 32, "bias": False, "half": "f16"},
    "Q4_K": {"lut": list(range(16)), "group": 32, "bias": True, "super": 256},
    "IQ4_XS": {
        "lut": [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
        "group": 32,
        "bias": False,
        "super": 256,
    },
    "Q5_0": {"lut": None, "range": (-16, 16), "group": 32, "bias": False, "half": "f16"},
    "Q5_1": {"lut": None, "range": (0, 32), "group": 32, "bias": True, "half": "f16"},
    "Q5_K": {"lut": None, "range": (0, 32), "group": 32, "bias": True, "super": 256},
    "Q6_K": {"lut": None, "range": (-32, 32), "group": 16, "bias": False, "super": 256},
    "Q8_0": {"lut": None, "range": (-128, 128), "group": 32, "bias": False, "half": "f16"},
}
# gate/up type, down type (llama.cpp's _M mixes give the expert down matrices Q6_K)
GGUF_MIXES = {"Q4_K_M": ("Q4_K", "Q6_K"), "Q5_K_M": ("Q5_K", "Q6_K")}
INT4_GROUP = {"RAWINT4": 32, "GPTQ_INT4": 128}
INT4_SCALE = {"RAWINT4": "bf16", "GPTQ_INT4": "f16"}  # the checkpoints' scale dtypes
QGROUP_METHODS = ("LLAMAFILE", "RAWINT4", "GPTQ_INT4")
#: Kernel names that add vpmaddubsw's pair sums in int16 lanes: qgroup int16 group sums
#: (jit/kernel.hpp kQGroupI16: "qg4bu0iws", "qg4u8iwh16"; with int16-lane super-block folds
#: "qg4bu0iwls", Q5_K's bytes "qg8bu0wls"), int32 super-block folds
#: (kQGroupIntFold: "qg8fs", two K steps per lane) and the int4 kernels below the VNNI levels
#: (jit/gemm.hpp int4_int16_sums: 8 K steps per lane)
_INT16_SUMS = re.compile(r"_qg[48]b?(u\d+i?w|f)|_int4_avx(2|512)_")
INT4_METHODS = ("AMXINT4", "MOE_INT4")
MX_METHODS = ("MXFP4", "MXFP8")


def _qgroup_specs(method: str, gguf_type: str):
    """(gate/up spec, down spec) for a qgroup layer; each a GGUF_TYPES-style dict."""
    if method != "LLAMAFILE":
        t = {
            "lut": [i - 8 for i in range(16)],
            "group": INT4_GROUP[method],
            "bias": False,
            "half": INT4_SCALE[method],
        }
        return t, t
    gu, dn = GGUF_MIXES.get(gguf_type, (gguf_type, gguf_type))
    return GGUF_TYPES[gu], GGUF_TYPES[dn]


def _make_layer(_core, method, E, K, H, I, isa, gguf_type):
    if method in QGROUP_METHODS:
        gu, dn = _qgroup_specs(method, gguf_type)
        rng = lambda s: [s["range"][0], s["range"][1] - 1] if "range" in s else []  # noqa: E731
        return _core.MoELayer(
            E, K, H, I, method, isa,
            gu_group=gu["group"], down_group=dn["group"], gu_bias=gu["bias"],
            down_bias=dn["bias"], gu_lut=gu["lut"] or [], down_lut=dn["lut"] or [],
            gu_code_range=rng(gu), down_code_range=rng(dn),
            gu_super_group=gu.get("super", 0), down_super_group=dn.get("super", 0),
            gu_scale_dtype=gu.get("half", ""), down_scale_dtype=dn.get("half", ""),
        )  # fmt: skip
    if method in MX_METHODS:
        return _core.MoELayer(E, K, H, I, method, isa, swiglu_limit=7.0)
    return _core.MoELayer(E, K, H, I, method, isa)


def _random_sources(torch, method, E, H, I, gen, gguf_type):
    """Per-method random sources shared by every rotated layer (made once)."""
    shapes = ((I, H), (I, H), (H, I))
    if method in QGROUP_METHODS:
        gu, dn = _qgroup_specs(method, gguf_type)
        out = []
        for (n, k), spec in zip(shapes, (gu, gu, dn)):
            if spec["lut"] is not None:
                idx = torch.randint(0, 16, (E, n, k), generator=gen, dtype=torch.uint8)
                codes = torch.tensor(spec["lut"], dtype=torch.int8)[idx.long()]
            else:
                lo, hi = spec["range"]
                codes = torch.randint(lo, hi, (E, n, k), generator=gen, dtype=torch.int8)
            g = k // spec["group"]
            if spec.get("super"):  # d (an fp16 value) per super block times integer sub-scales

                def two_level(sign):
                    per = spec["super"] // spec["group"]
                    d = (torch.rand(E, n, g // per, 1, generator=gen) * 3e-5).half().float()
                    sub = torch.randint(1, 64, (E, n, g // per, per), generator=gen).float()
                    return (sign * d * sub).reshape(E, n, g)

                sc = two_level(1.0)
                bs = two_level(-1.0) if spec["bias"] else None
            else:
                sc = torch.rand(E, n, g, generator=gen) * 1e-3
                bs = torch.randn(E, n, g, generator=gen) * 1e-3 if spec["bias"] else None
                if spec.get("half"):  # values the checkpoint's 16-bit type holds
                    dt = torch.float16 if spec["half"] == "f16" else torch.bfloat16
                    sc = sc.to(dt).float()
                    bs = None if bs is None else bs.to(dt).float()
            out.append((codes, sc, bs))
        return out
    if method in MX_METHODS:
        fp4 = method == "MXFP4"
        out = []
        for n, k in shapes:
            b = torch.randint(
                0, 256, (E, n, k // 2 if fp4 else k), generator=gen, dtype=torch.uint8
            )
            if not fp4:  # no e4m3 NaN codes
                b = torch.where((b & 0x7F) == 0x7F, b ^ 1, b)
            sc = torch.randint(119, 123, (E, n, k // 32), generator=gen, dtype=torch.uint8)
            out.append((b, sc))
        return out
    return None


def _load_sources(layer, method, src):
    E = src[0][0].shape[0]
    slots = list(range(E))
    if method in QGROUP_METHODS:
        ptrs = []
        for codes, sc, bs in src:
            ptrs += [[codes[e].data_ptr() for e in slots], [sc[e].data_ptr() for e in slots]]
            ptrs.append([0] * E if bs is None else [bs[e].data_ptr() for e in slots])
        layer.load_experts_grouped(slots, *ptrs)
    else:  # MX: bytes then scales
        mats, scales = [m for m, _ in src], [s for _, s in src]
        layer.load_experts_mx(slots, *[[t[e].data_ptr() for e in slots] for t in mats + scales])


#: kt-jit method -> oneDNN matmul of the same weight precision (oneDNN 2.6 has no int4/fp8 weights).
ONEDNN_DTYPE = {"AMXINT8": "int8", "MOE_INT8": "int8", "BF16": "bf16"}
ONEDNN_MS = (1, 4, 16, 64, 256, 1024)
#: Issue #5 item 4: kt-jit's weight bandwidth at M = 1 over oneDNN's, and throughput at M = 256.
ONEDNN_M1_TARGET = {"bf16": 1.5, "int8": 1.15}
ONEDNN_M256_TARGET = 0.95
#: Methods tools/peers/ktkernel_bench.py maps onto a kt-kernel class.
KTKERNEL_METHODS = ("AMXINT8", "AMXINT4", "BF16", "FP8", "FP8_PERCHANNEL", "MOE_INT8", "MOE_INT4")
KTKERNEL_PYTHON = "/opt/ktk-venv/bin/python"
#: Where tools/peers/setup_peers.sh installs ggml (llama.cpp's tensor library, built from PyPI's
#: llama-cpp-python sdist) for tools/peers/ggml_bench.cpp, the llama.cpp peer of LLAMAFILE runs.
GGML_PREFIX = "/opt/ggml-peer"
#: Issue #4: kt-jit's prefill throughput over llama.cpp's at T = 1024 on the same shapes.
LLAMACPP_T1024_TARGET = 3.0


def parse_peer_json(text: str) -> Dict:
    """A peer's JSON document out of its stdout: the last line that opens with ``{"peer"`` (peers'
    libraries print lines of their own before and after it)."""
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i].lstrip()
        if line.startswith("{") and line[1:].lstrip().startswith('"peer"'):
            doc, _ = json.JSONDecoder().raw_decode("\n".join([line] + lines[i + 1 :]))
            return doc
    raise ValueError("no peer JSON document in the output")


def _peer_time_ratios(results: List[Dict], doc: Dict, name: str, extra=()) -> List[Dict]:
    """Adds {name}_us and speedup_vs_{name} (the peer's time / kt-jit's) to kt-jit's rows that the
    peer also ran; returns the pairs, with the peer row's `extra` keys as {name}_{key}."""
    by_t = {int(p["tokens"]): p for p in doc.get("results", [])}
    pairs = []
    for r in results:
        p = by_t.get(int(r["tokens"]))
        if not p or not p.get("us") or not r.get("us"):
            continue
        r[f"{name}_us"] = float(p["us"])
        r[f"speedup_vs_{name}"] = float(p["us"]) / float(r["us"])
        pair = {
            "tokens": r["tokens"],
            "ktjit_us": r["us"],
            f"{name}_us": r[f"{name}_us"],
            "speedup": r[f"speedup_vs_{name}"],
        }
        pair.update({f"{name}_{k}": p.get(k) for k in extra})
        pairs.append(pair)
    return pairs


def ktkernel_ratios(results: List[Dict], doc: Dict) -> List[Dict]:
    """kt-kernel's time over kt-jit's per token count (ktkernel_us, speedup_vs_ktkernel)."""
    return _peer_time_ratios(results, doc, "ktkernel", ("weight_gbs",))


def llamacpp_ratios(results: List[Dict], doc: Dict) -> List[Dict]:
    """llama.cpp's (the ggml peer's) time over kt-jit's per token count (llamacpp_us,
    speedup_vs_llamacpp)."""
    return _peer_time_ratios(results, doc, "llamacpp", ("experts_touched",))


def llamacpp_acceptance(pairs: List[Dict]) -> List[Dict]:
    """Issue #4's peer check this run can answer: >= 3x llama.cpp's throughput at T = 1024."""
    p = next((q for q in pairs if q["tokens"] == 1024), None)
    return [
        {
            "check": f">= {LLAMACPP_T1024_TARGET:g}x llama.cpp's throughput at T = 1024",
            "value": p["speedup"] if p else None,
            "target": LLAMACPP_T1024_TARGET,
            "ok": (p["speedup"] >= LLAMACPP_T1024_TARGET) if p else None,
        }
    ]


def onednn_expert(doc: Dict, hidden: int, inter: int, dtype: str) -> Dict[int, Dict]:
    """oneDNN's time for one expert at each M: gate and up (N = I, K = H) twice plus down
    (N = H, K = I), with its weight GB/s and Gop/s."""
    rows = {}
    for r in doc.get("results", []):
        if r.get("dtype") == dtype:
            rows[(int(r["n"]), int(r["k"]), int(r["m"]))] = r
    out = {}
    for m in sorted({key[2] for key in rows}):
        gu, dn = rows.get((inter, hidden, m)), rows.get((hidden, inter, m))
        if not gu or not dn:
            continue
        us = 2.0 * float(gu["us"]) + float(dn["us"])
        wbytes = 2.0 * float(gu["weight_bytes"]) + float(dn["weight_bytes"])
        out[m] = {
            "m": m,
            "us": us,
            "weight_gbs": wbytes / us / 1e3,
            "gops": 2.0 * m * 3 * hidden * inter / us / 1e3,
            "impl": gu.get("impl", "?"),
            "weights_format": gu.get("weights_format", "?"),
        }
    return out


def onednn_ratios(results: List[Dict], expert: Dict[int, Dict], top_k: int, tol: float = 1.25):
    """Pairs kt-jit rows with oneDNN's expert at the M closest to the rows per expert of that row
    (T·top_k / experts touched, within a factor ``tol``). ratio = kt-jit's weight GB/s over
    oneDNN's for M <= 4 (bandwidth-bound), Gop/s over Gop/s above."""
    pairs = []
    for r in results:
        touched = max(1, int(r.get("experts_touched") or 0))
        m_eff = r["tokens"] * top_k / touched
        best = None
        for m in expert:
            q = max(m, m_eff) / min(m, m_eff)
            if q <= tol and (best is None or q < best[0]):
                best = (q, m)
        if best is None:
            continue
        o = expert[best[1]]
        bw = r["weight_gbs"] / o["weight_gbs"] if o["weight_gbs"] else float("nan")
        thr = r["gops"] / o["gops"] if o["gops"] else float("nan")
        pairs.append(
            {
                "tokens": r["tokens"],
                "m_eff": m_eff,
                "m": best[1],
                "onednn_expert_us": o["us"],
                "onednn_weight_gbs": o["weight_gbs"],
                "onednn_gops": o["gops"],
                "ktjit_weight_gbs": r["weight_gbs"],
                "ktjit_gops": r["gops"],
                "bw_ratio": bw,
                "gops_ratio": thr,
                "ratio": bw if best[1] <= 4 else thr,
            }
        )
    return pairs


def peer_acceptance(
    ktk_pairs: Optional[List[Dict]],
    onednn_pairs: Optional[List[Dict]],
    dtype: Optional[str],
    experts: int,
    top_k: int,
) -> List[Dict]:
    """Issue #5 item 4's checks that this run can answer: faster than kt-kernel at T = 1 and
    T = 1024; >= 1.5x (bf16) / 1.15x (int8) oneDNN's weight bandwidth at M = 1; within 5 % of
    oneDNN's throughput at M = 256. ok is None where the run has no row for it."""
    out = []
    if ktk_pairs is not None:
        by_t = {p["tokens"]: p for p in ktk_pairs}
        for t in (1, 1024):
            p = by_t.get(t)
            out.append(
                {
                    "check": f"faster than kt-kernel at T = {t}",
                    "value": p["speedup"] if p else None,
                    "target": 1.0,
                    "ok": (p["speedup"] > 1.0) if p else None,
                }
            )
    if onednn_pairs is not None and dtype:
        m1 = next((p for p in onednn_pairs if p["m"] == 1 and p["tokens"] == 1), None)
        tgt = ONEDNN_M1_TARGET.get(dtype, 1.0)
        out.append(
            {
                "check": f">= {tgt:g}x oneDNN's {dtype} weight bandwidth at M = 1 (T = 1)",
                "value": m1["bw_ratio"] if m1 else None,
                "target": tgt,
                "ok": (m1["bw_ratio"] >= tgt) if m1 else None,
            }
        )
        m256 = [p for p in onednn_pairs if p["m"] == 256]
        p = min(m256, key=lambda q: abs(q["m_eff"] - 256)) if m256 else None
        need = math.ceil(256 * experts / top_k)
        out.append(
            {
                "check": f"within 5 % of oneDNN's {dtype} throughput at M = 256"
                + (f" (T = {p['tokens']})" if p else f" (needs a row at T ~ {need})"),
                "value": p["gops_ratio"] if p else None,
                "target": ONEDNN_M256_TARGET,
                "ok": (p["gops_ratio"] >= ONEDNN_M256_TARGET) if p else None,
            }
        )
    return out


def _acceptance_lines(acc: List[Dict]) -> List[str]:
    lines = []
    for a in acc:
        if a["ok"] is None:
            lines.append(f"- {a['check']}: not measured in this run")
        else:
            mark = "met" if a["ok"] else "NOT met"
            lines.append(f"- {a['check']}: {a['value']:.2f}x (target {a['target']:g}x) — {mark}")
    return lines


def _peers_dir(arg: str = "") -> Optional[str]:
    """tools/peers of a kt-jit checkout: --peers-dir, $KTJIT_PEERS_DIR, the tree this module sits
    in (python/kt_jit/ -> tools/peers) or ./tools/peers."""
    here = os.path.dirname(os.path.abspath(__file__))
    for d in (
        arg,
        os.environ.get("KTJIT_PEERS_DIR", ""),
        os.path.join(here, "..", "..", "tools", "peers"),
        os.path.join(os.getcwd(), "tools", "peers"),
    ):
        if d and os.path.isfile(os.path.join(d, "ktkernel_bench.py")):
            return os.path.abspath(d)
    return None


def _run_peer(cmd: List[str], timeout: float, env: Optional[Dict] = None):
    """Runs a peer (its stderr shows progress live); returns (doc, None) or (None, reason)."""
    try:
        p = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout, env=env
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{type(e).__name__}: {e}"
    for line in p.stderr.splitlines():
        if line.startswith(("kt-kernel", "oneDNN")):
            print("  " + line, flush=True)
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or [""])[-1]
        return None, f"exit status {p.returncode}: {tail[-300:]}"
    try:
        doc = parse_peer_json(p.stdout)
    except ValueError as e:
        return None, str(e)
    if doc.get("skipped"):
        return None, str(doc["skipped"])
    return doc, None


def _onednn_binary(peers: Optional[str]):
    """Builds tools/peers/onednn_bench.cpp once into the user cache; (path, None) or (None, why)."""
    if not peers or not os.path.isfile(os.path.join(peers, "onednn_bench.cpp")):
        return None, "tools/peers/onednn_bench.cpp not found (run from a checkout or --peers-dir)"
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        return None, "no C++ compiler (g++) on PATH"
    src = os.path.join(peers, "onednn_bench.cpp")
    cache = os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kt-jit", "peers"
    )
    out = os.path.join(cache, "onednn_bench")
    if os.path.isfile(out) and os.path.getmtime(out) >= os.path.getmtime(src):
        return out, None
    os.makedirs(cache, exist_ok=True)
    cmd = [cxx, "-O2", "-std=c++17", "-fopenmp", src, "-o", out, "-ldnnl"]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        if "dnnl.hpp" in p.stdout or "-ldnnl" in p.stdout:
            return (
                None,
                "oneDNN not installed (apt-get install libdnnl-dev: tools/peers/setup_peers.sh)",
            )
        return None, "building onednn_bench failed: " + p.stdout.strip()[-300:]
    return out, None


def _ggml_binary(peers: Optional[str], prefix: str):
    """Builds tools/peers/ggml_bench.cpp once (per ggml prefix) into the user cache against the ggml
    that tools/peers/setup_peers.sh installed under `prefix`; (path, None) or (None, why)."""
    if not peers or not os.path.isfile(os.path.join(peers, "ggml_bench.cpp")):
        return None, "tools/peers/ggml_bench.cpp not found (run from a checkout or --peers-dir)"
    lib, inc = os.path.join(prefix, "lib"), os.path.join(prefix, "include")
    if not os.path.isfile(os.path.join(inc, "ggml.h")):
        return None, f"no ggml under {prefix} (bash tools/peers/setup_peers.sh builds it)"
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        return None, "no C++ compiler (g++) on PATH"
    src = os.path.join(peers, "ggml_bench.cpp")
    cache = os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kt-jit", "peers"
    )
    out = os.path.join(cache, "ggml_bench-" + prefix.strip("/").replace("/", "_"))
    newest = max(os.path.getmtime(src), os.path.getmtime(os.path.join(inc, "ggml.h")))
    if os.path.isfile(out) and os.path.getmtime(out) >= newest:
        return out, None
    os.makedirs(cache, exist_ok=True)
    cmd = [cxx, "-O2", "-std=c++17", src, "-o", out, f"-I{inc}", f"-L{lib}", "-lggml"]
    cmd += ["-lggml-base", "-lggml-cpu", f"-Wl,-rpath,{lib}"]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        return None, "building ggml_bench failed: " + p.stdout.strip()[-300:]
    return out, None


def _onednn_verbose(binary: str, dtype: str, shape: str, env: Dict) -> Dict:
    """One verbose call: the ISA line and the implementation oneDNN's ONEDNN_VERBOSE reports."""
    env = dict(env, ONEDNN_VERBOSE="1", DNNL_VERBOSE="1")
    cmd = [binary, "--dtypes", dtype, "--shapes", shape, "--ms", "1", "--reps", "1"]
    try:
        p = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, timeout=120, env=env
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    isa, impl = "", ""
    for line in p.stdout.splitlines():
        f = line.split(",")
        if len(f) > 3 and f[1] == "info" and f[3].startswith("isa:"):
            isa = f[3][4:]
        if len(f) > 4 and f[1] == "exec" and f[3] == "matmul":
            impl = f[4]
    return {"verbose_isa": isa, "verbose_impl": impl}


def fp8_quantize(torch, w, block: bool):
    """[E, n, k] weights as e4m3 the way FP8 checkpoints are made (DeepSeek-V3's recipe): per
    128 x 128 block (or per row) the scale is amax / 448, so each block's largest weight is 448
    and its codes span the format's range (zero-exponent codes are then rare, about 1e-4 of
    Gaussian weights). Returns (e4m3 [E, n, k], scales [E, n/128, k/128] or [E, n])."""
    E, n, k = w.shape
    q = torch.empty(E, n, k, dtype=torch.float8_e4m3fn)
    if block:
        nb, kb = (n + 127) // 128, (k + 127) // 128
        scales = torch.empty(E, nb, kb)
    else:
        scales = torch.empty(E, n)
    for e in range(E):  # an expert at a time: a DeepSeek-V3 layer is 1.4 G weights
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


def _load_layer(layer, method, gate, up, down, torch):
    """Random weights into a layer: float tensors, or e4m3 + scales for the FP8 methods."""
    if not method.startswith("FP8"):
        dt = {torch.float32: "f32", torch.bfloat16: "bf16"}[gate.dtype]
        layer.load_from_float(gate.data_ptr(), up.data_ptr(), down.data_ptr(), dt, 0)
        return
    E = gate.shape[0]
    mats, scales = zip(*(fp8_quantize(torch, t, method == "FP8") for t in (gate, up, down)))
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


#: Forward reps paired with read probes per bandwidth-bound token count (``_paired_ratio``).
PAIRED_REPS = 15
#: Bytes one paired probe reads: far beyond any L3, about 20 ms at 12 GB/s.
PAIRED_PROBE_BYTES = 256 << 20


def _paired_ratio(forward_s: List[float], probes_gbs: List[float], weight_bytes: float):
    """Decode against a drifting bandwidth: forward rep i ran between probes i and i + 1; its
    weight GB/s over the mean of those two probes, median over the reps. Returns (that median
    ratio, the median probe GB/s). One start-of-run probe misjudges the ratio by as much as the
    bandwidth drifts in between (12-16 GB/s within minutes on the shared VM); adjacent probes
    see what the forward saw."""
    if not forward_s or len(probes_gbs) != len(forward_s) + 1:
        raise ValueError("_paired_ratio: expected one more probe than forward reps")
    if min(forward_s) <= 0 or min(probes_gbs) <= 0:
        raise ValueError("_paired_ratio: times and probes must be positive")
    ratios = [
        weight_bytes / sec / 1e9 / (0.5 * (probes_gbs[i] + probes_gbs[i + 1]))
        for i, sec in enumerate(forward_s)
    ]
    return statistics.median(ratios), statistics.median(probes_gbs)


def _routing(torch, t: int, e: int, k: int, gen):
    """Random top-k per token: k distinct experts, weights uniform in [0, 1)."""
    ids = torch.rand(t, e, generator=gen).argsort(dim=1)[:, :k].contiguous().to(torch.int64)
    w = torch.rand(t, k, generator=gen, dtype=torch.float32).contiguous()
    return ids, w


def _thp_mode(path: str = "/sys/kernel/mm/transparent_hugepage/enabled") -> str:
    """The transparent-huge-page mode in force ("always", "madvise", "never"), or "unavailable".
    kt-jit advises its weights and large scratch for huge pages, so "never" costs TLB misses."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return "unavailable"
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else "unavailable"


def _fmt(v: float, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:,.{digits}f}"


def _markdown_table(results: List[Dict]) -> str:
    peer = any("torch_us" in r for r in results)
    ktk = any("ktkernel_us" in r for r in results)
    lcpp = any("llamacpp_us" in r for r in results)
    paired = any("paired_roof_pct" in r for r in results)
    head = "| T | µs (median) | tokens/s | experts touched | weight GB/s | Gop/s | roof% | bound |"
    rule = "|---:|---:|---:|---:|---:|---:|---:|---|"
    if paired:
        head += " % of adjacent read probes |"
        rule += "---:|"
    if peer:
        head += " torch bf16 µs | vs torch |"
        rule += "---:|---:|"
    if ktk:
        head += " kt-kernel µs | vs kt-kernel |"
        rule += "---:|---:|"
    if lcpp:
        head += " llama.cpp µs | vs llama.cpp |"
        rule += "---:|---:|"
    lines = [head, rule]
    for r in results:
        line = (
            f"| {r['tokens']} | {_fmt(r['us'])} | {_fmt(r['tokens_per_s'])} | "
            f"{r['experts_touched']} | {_fmt(r['weight_gbs'], 2)} | {_fmt(r['gops'])} | "
            f"{_fmt(r['roof_pct'])}% | {r['bound']} |"
        )
        if paired:
            line += f" {_fmt(r['paired_roof_pct'])}% |" if "paired_roof_pct" in r else " - |"
        if peer:
            line += f" {_fmt(r.get('torch_us', 0))} | {r.get('speedup_vs_torch', 0):.1f}x |"
        if ktk:
            if "ktkernel_us" in r:
                line += f" {_fmt(r['ktkernel_us'])} | {r['speedup_vs_ktkernel']:.2f}x |"
            else:
                line += " - | - |"
        if lcpp:
            if "llamacpp_us" in r:
                line += f" {_fmt(r['llamacpp_us'])} | {r['speedup_vs_llamacpp']:.2f}x |"
            else:
                line += " - | - |"
        lines.append(line)
    return "\n".join(lines)


#: Methods whose prefill runs on AMX tiles at isa amx (runtime/moe_layer.cpp's kernel choice).
# Methods whose prefill tiles (experts with >= 16 rows) run on AMX at isa amx.
AMX_INT8_METHODS = ("AMXINT8", "MOE_INT8", "AMXINT4", "MOE_INT4")
AMX_BF16_METHODS = ("BF16", "FP8", "FP8_PERCHANNEL", "MXFP4", "MXFP8")


def _roof_peak(isa: str, method: str, lim: Dict) -> Tuple[str, str]:
    """(name, machine_limits key) of the instruction peak a layer's compute roof% uses."""
    if isa in NEON_LEVELS:
        # NEON (jit/aarch64/gemm_a64.cpp): int8 / int4 and the qgroup methods (GGUF, RAWINT4,
        # GPTQ_INT4) on sdot where the CPU has it, else the widening smull + smull2 + addp +
        # sadalp step; bf16 and fp8 on fmla, and bf16 on bfdot for the pair prefill tiles at
        # neon_bf16; MX on fmla too (fp32 activations, one fmla per weight and row).
        if method == "BF16" and isa == "neon_bf16" and lim.get("peak_bfdot_gflops"):
            return "bfdot", "peak_bfdot_gflops"
        if method in ("BF16", "FP8", "FP8_PERCHANNEL") + MX_METHODS:
            return "fmla", "peak_fma_gflops"
        if isa != "neon" and lim.get("peak_sdot_gops"):
            return "sdot", "peak_sdot_gops"
        return "smull+sadalp", "peak_smull_gops"
    vnni = isa in VNNI_LEVELS and float(lim.get("peak_vnni_gops", 0.0)) > 0
    # widened to fp32, vfmadd231ps (MX too: its int16 decode tiles are bandwidth-bound)
    if method in ("BF16", "FP8", "FP8_PERCHANNEL") + MX_METHODS:
        peak_name, peak_key = "vfmadd231ps", "peak_fma_gflops"
    else:
        peak_name = "vpdpbusd" if vnni else "vpmaddubsw"
        peak_key = "peak_vnni_gops" if vnni else "peak_maddubsw_gops"
    # At isa amx the prefill tiles of experts with >= 16 rows run on AMX: their roof is the tile
    # unit's peak (AMX-INT8 for the per-row int8 / int4 formats, AMX-BF16 for BF16, FP8 and MX).
    if isa == "amx" and method in AMX_INT8_METHODS and lim.get("peak_amx_int8_gops"):
        peak_name, peak_key = "tdpbusd", "peak_amx_int8_gops"
    elif isa == "amx" and method in AMX_BF16_METHODS and lim.get("peak_amx_bf16_gflops"):
        peak_name, peak_key = "tdpbf16ps", "peak_amx_bf16_gflops"
    # At avx512_bf16, BF16, FP8 and MX experts with >= 5 rows run vdpbf16ps pair kernels (FP8
    # also at amx, and its decode tiles of <= 4 rows): that is their roof.
    elif (
        (isa == "avx512_bf16" and method in ("BF16",) + MX_METHODS)
        or (isa in ("avx512_bf16", "amx") and method in ("FP8", "FP8_PERCHANNEL"))
    ) and lim.get("peak_bf16_gflops"):
        peak_name, peak_key = "vdpbf16ps", "peak_bf16_gflops"
    return peak_name, peak_key


def _threads_peak(_core, lim: Dict, peak_key: str, threads: int) -> float:
    """The compute roof for `threads` threads: one core's peak from `lim` on 1 thread; with more,
    the peak loop measured on all of them at once (stored in `lim` as `<key>_<N>t`), since two
    threads need not double one core's peak (SMT siblings, or a VM's vCPUs on one core: this
    Zen 3 VM gave 1.95-2.0x in some runs and 1.0x in others)."""
    core = float(lim.get(peak_key, 0.0))
    if threads <= 1 or core <= 0:
        return core * max(threads, 1)
    key = f"{peak_key}_{threads}t"
    if key not in lim:
        lim[key] = float(_core.measure_peak_threads(peak_key, threads))
    print(
        f"- {peak_key} with {threads} threads at once: {_fmt(lim[key])} Gop/s "
        f"({lim[key] / core:.2f}x one core)",
        flush=True,
    )
    return float(lim[key])


def _neon_peaks_line(lim: Dict) -> str:
    return (
        f"- peaks per core: fmla {_fmt(lim.get('peak_fma_gflops', 0))} GFLOP/s, "
        f"smull+sadalp {_fmt(lim.get('peak_smull_gops', 0))} Gop/s, "
        f"sdot {_fmt(lim.get('peak_sdot_gops', 0))} Gop/s, "
        f"bfdot {_fmt(lim.get('peak_bfdot_gflops', 0))} GFLOP/s"
    )


def _limits_lines(lim: Dict, read_bw: float, peak: float, peak_name: str, threads: int) -> str:
    neon = bool(lim.get("peak_smull_gops"))  # measured on AArch64 only
    return "\n".join(
        [
            f"- read bandwidth: {_fmt(lim.get('read_gbs_1t', 0), 2)} GB/s (1 thread), "
            f"{_fmt(lim.get('read_gbs_2t', 0), 2)} GB/s (2 threads)",
            (
                _neon_peaks_line(lim)
                if neon
                else f"- peaks per core: vpdpbusd {_fmt(lim.get('peak_vnni_gops', 0))} Gop/s, "
                f"vpmaddubsw+vpmaddwd+vpaddd {_fmt(lim.get('peak_maddubsw_gops', 0))} Gop/s, "
                f"vpmaddubsw+vpaddw {_fmt(lim.get('peak_maddubsw_w_gops', 0))} Gop/s, "
                f"FMA fp32 {_fmt(lim.get('peak_fma_gflops', 0))} GFLOP/s, "
                f"vdpbf16ps {_fmt(lim.get('peak_bf16_gflops', 0))} GFLOP/s"
                + (
                    f", tdpbusd {_fmt(lim['peak_amx_int8_gops'])} Gop/s, "
                    f"tdpbf16ps {_fmt(lim.get('peak_amx_bf16_gflops', 0))} GFLOP/s"
                    if lim.get("peak_amx_int8_gops")
                    else ""
                )
            ),
            f"- roof% uses read bandwidth {_fmt(read_bw, 2)} GB/s and {peak_name} peak "
            f"{_fmt(peak)} Gop/s ({threads} thread{'s' if threads != 1 else ''})",
        ]
    )


def _onednn_table(pairs: List[Dict]) -> str:
    lines = [
        "| T | M per expert | oneDNN M | oneDNN expert µs | oneDNN weight GB/s | oneDNN Gop/s "
        "| kt-jit weight GB/s | kt-jit Gop/s | kt-jit / oneDNN |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in pairs:
        what = "GB/s" if p["m"] <= 4 else "Gop/s"
        lines.append(
            f"| {p['tokens']} | {p['m_eff']:.1f} | {p['m']} | {_fmt(p['onednn_expert_us'])} | "
            f"{_fmt(p['onednn_weight_gbs'], 2)} | {_fmt(p['onednn_gops'])} | "
            f"{_fmt(p['ktjit_weight_gbs'], 2)} | {_fmt(p['ktjit_gops'])} | "
            f"{p['ratio']:.2f}x ({what}) |"
        )
    return "\n".join(lines)


def _peers_markdown(peers: Dict, acceptance: List[Dict], dtype, H: int, I: int) -> List[str]:
    """Markdown lines about the kt-kernel and oneDNN peers of a run (none when neither ran)."""
    if not peers:
        return []
    out = ["Peers (same run, right after the kt-jit rows):", ""]
    after = peers.get("limits_after_peers")
    if after:
        out.append(
            f"- read bandwidth measured again after the peers: "
            f"{_fmt(after.get('read_gbs_1t', 0), 2)} GB/s (1 thread), "
            f"{_fmt(after.get('read_gbs_2t', 0), 2)} GB/s (2 threads)"
        )
    k = peers.get("ktkernel")
    if k is not None:
        if "skipped" in k:
            out.append(f"- kt-kernel: skipped ({k['skipped']})")
        else:
            out.append(
                f"- kt-kernel {k.get('version', '?')} ({k.get('variant', '?')} extension), class "
                f"`{k.get('class', '?')}`, {k.get('threads', '?')} thread(s), threadpool_count 1, "
                f"{k.get('layers', '?')} layers rotated, same routing: "
                f"{'yes' if k.get('same_routing_as_ktjit') else 'no'}; rel. L1 error vs torch "
                f"{k.get('error_rel_l1', float('nan')):.3g}; µs and ratio in the table above"
            )
    g = peers.get("llamacpp")
    if g is not None:
        if "skipped" in g:
            out.append(f"- llama.cpp: skipped ({g['skipped']})")
        else:
            out.append(
                f"- llama.cpp's ggml-cpu {g.get('ggml_version', '?')} ({g.get('ggml_commit', '?')}; "
                "PyPI llama-cpp-python's vendored llama.cpp, built with GGML_NATIVE), "
                "`tools/peers/ggml_bench.cpp`: the MoE FFN as llama.cpp's build_moe_ffn builds it "
                f"(mul_mat_id, swiglu, weighted sum), {g.get('gu_type', '?')} gate/up in "
                f"{g.get('gu_buffer', '?')}, {g.get('down_type', '?')} down in "
                f"{g.get('down_buffer', '?')}, {g.get('threads', '?')} thread(s), "
                f"{g.get('layers', '?')} layers rotated, its own random routing; rel. L1 error vs "
                f"float64 over the dequantized weights "
                f"{g.get('rel_l1_vs_f64', float('nan')):.3g}; µs and ratio in the table above"
            )
    o = peers.get("onednn")
    if o is not None:
        if "skipped" in o:
            out.append(f"- oneDNN: skipped ({o['skipped']})")
        else:
            ex = (o.get("expert") or [{}])[0]
            out += [
                f"- oneDNN {o.get('version', '?')} matmul, {dtype} "
                + ("(u8·s8→f32, per-N scales)" if dtype == "int8" else "(bf16·bf16→f32)")
                + f", {o.get('threads', '?')} thread(s); ISA {o.get('effective_isa', '?')} "
                f"(verbose: {o.get('verbose_isa') or '?'}); implementation "
                f"`{o.get('verbose_impl') or ex.get('impl', '?')}`, weights prepacked as "
                f"`{ex.get('weights_format', '?')}`; one expert = 2 × {I}×{H} (gate, up) + "
                f"{H}×{I} (down), weights rotated over {o.get('rotate_bytes', 0) / 2**20:.0f} MiB "
                "of copies",
                "",
                _onednn_table(o.get("pairs", [])),
            ]
    if acceptance:
        out += ["", "Peer checks (this run; issue #5 item 4, issue #4):", ""]
        out += _acceptance_lines(acceptance)
    return out + [""]


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
    p.add_argument(
        "--no-paired-probes",
        dest="paired_probes",
        action="store_false",
        help="skip the extra bandwidth-bound reps that each sit between two read probes "
        f"({PAIRED_REPS} reps and {PAIRED_REPS + 1} probes of {PAIRED_PROBE_BYTES >> 20} MiB per "
        "token count, read on the forward's threads)",
    )
    p.add_argument("--method", default="AMXINT8", help="MoELayer method (default AMXINT8)")
    p.add_argument(
        "--gguf-type",
        default="Q4_K",
        choices=sorted(GGUF_TYPES) + sorted(GGUF_MIXES),
        help="LLAMAFILE: the GGUF block type of the random weights (default Q4_K)",
    )
    p.add_argument(
        "--shape",
        default="qwen3",
        choices=sorted(SHAPES),
        help="MoE shape (default qwen3; deepseek-v3 is a 32-expert subset, mixtral is 8x7B)",
    )
    p.add_argument(
        "--torch-peer",
        action="store_true",
        help="also time torch's bf16 eager MoE on the same shape in this process",
    )
    p.add_argument(
        "--ktkernel-peer",
        nargs="?",
        const=KTKERNEL_PYTHON,
        default=None,
        metavar="PYTHON",
        help="also time kt-kernel (PyPI) on the same layer, run by PYTHON of its own virtual "
        f"environment (default {KTKERNEL_PYTHON}; tools/peers/setup_peers.sh makes it)",
    )
    p.add_argument(
        "--llamacpp-peer",
        nargs="?",
        const=GGML_PREFIX,
        default=None,
        metavar="PREFIX",
        help="LLAMAFILE: also time llama.cpp's ggml-cpu on the same MoE layer (GGML types, shape, "
        f"tokens, threads), built against the ggml under PREFIX (default {GGML_PREFIX}; "
        "tools/peers/setup_peers.sh builds it)",
    )
    p.add_argument(
        "--onednn-peer",
        action="store_true",
        help="also time oneDNN matmul (libdnnl-dev) on the expert's matrices, same dtype",
    )
    p.add_argument(
        "--onednn-ms",
        type=_parse_tokens,
        default=list(ONEDNN_MS),
        help="rows per matmul for the oneDNN peer (default 1,4,16,64,256,1024)",
    )
    p.add_argument(
        "--peers-dir", default="", help="tools/peers of a kt-jit checkout (default: found)"
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
    if feats.get("family") is not None and feats.get("model") is not None:
        # (AMD names Zen 4 and Zen 5 alike, "AMD EPYC": the family tells the tables apart)
        brand += f", family {feats['family']} model {feats['model']}"
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
    peak_name, peak_key = _roof_peak(isa, args.method, lim)
    peak = _threads_peak(_core, lim, peak_key, threads)
    print(_limits_lines(lim, read_bw, peak, peak_name, threads), flush=True)

    # --- 2. layers ---------------------------------------------------------------------------------
    shape = SHAPES[args.shape]
    E, K, H, I = shape["experts"], shape["top_k"], shape["hidden"], shape["intermediate"]
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
    src = _random_sources(torch, args.method, E, H, I, gen, args.gguf_type)
    if src is None:
        # Large shapes draw bf16 weights directly (fp32 sources would need 2x the memory).
        wdt = torch.float32 if 3 * E * H * I <= 2**28 else torch.bfloat16
        gate = torch.randn(E, I, H, generator=gen, dtype=wdt).mul_(0.02)
        up = torch.randn(E, I, H, generator=gen, dtype=wdt).mul_(0.02)
        down = torch.randn(E, H, I, generator=gen, dtype=wdt).mul_(0.02)
    layers = []
    for _ in range(layers_n):
        layer = _make_layer(_core, args.method, E, K, H, I, args.isa, args.gguf_type)
        if src is None:
            _load_layer(layer, args.method, gate, up, down, torch)
        else:
            _load_sources(layer, args.method, src)
        layers.append(layer)
    if src is None:
        del gate, up, down
    del src
    # What a forward really streams: the packed codes with their scales (measured, not assumed).
    expert_bytes = int(layers[0].packed_bytes // E)
    layer_bytes = E * expert_bytes
    if args.method == "LLAMAFILE":
        wname = f"gguf {args.gguf_type}"
    print(
        f"{layers_n} layers x {layer_bytes / 1e6:.0f} MB {wname} = {layers_n * layer_bytes / 1e9:.2f} GB "
        f"(L3 {l3 / 2**20:.1f} MiB) loaded in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )

    # Layers whose every kernel adds int16 lanes (qgroup: Q4_0, Q4_K, Q5_K, RAWINT4 G32, Q6_K's
    # int32 folds, Q4_K_M / Q5_K_M at avx2; AMXINT4 / MOE_INT4 at avx2 and avx512) run vpmaddubsw
    # + vpaddw, not the three-instruction chain: that pair's peak is their roof.
    int16_lanes = args.method in QGROUP_METHODS or args.method in INT4_METHODS
    if int16_lanes and not vnni and lim.get("peak_maddubsw_w_gops"):
        names = layers[0].kernel_names()
        if names and all(_INT16_SUMS.search(n) for n in names):
            peak_name, peak_key = "vpmaddubsw+vpaddw", "peak_maddubsw_w_gops"
            peak = _threads_peak(_core, lim, peak_key, threads)
            print(
                f"- every kernel adds int16 lanes: roof% uses the {peak_name} peak "
                f"{_fmt(peak)} Gop/s",
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
    probe = None  # _core.ReadProbe, made at the first bandwidth-bound token count
    peer_inputs = {}  # T -> (x, ids, w), handed to the kt-kernel peer
    for t in args.tokens:
        x = torch.randn(t, H, generator=gen)
        ids, w = _routing(torch, t, E, K, gen)
        out = torch.empty(t, H)
        ptrs = (x.data_ptr(), ids.data_ptr(), w.data_ptr(), 0, out.data_ptr())
        if args.ktkernel_peer:
            peer_inputs[t] = (x, ids, w)
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
        # Bandwidth-bound: more reps, each between two read probes, read on the threads the
        # forward runs on (one thread: the calling thread; more: every pool thread its part of
        # the buffer). Their weight GB/s against the adjacent probes is the roof% that a drifting
        # shared machine cannot skew (this VM's 2-thread bandwidth flips between about 45 and 80
        # GB/s from minute to minute); the rows above stay as they were measured.
        if r["bound"] == "bandwidth" and args.paired_probes:
            if probe is None:
                probe = _core.ReadProbe(PAIRED_PROBE_BYTES, on_pool=threads > 1)
            fw, pr = [], [probe.pass_gbs()]
            for i in range(PAIRED_REPS):
                a = time.perf_counter_ns()
                layers[i % layers_n].forward(t, *ptrs)
                fw.append((time.perf_counter_ns() - a) * 1e-9)
                pr.append(probe.pass_gbs())
            ratio, probe_gbs = _paired_ratio(fw, pr, wbytes)
            r["paired_roof_pct"] = 100.0 * ratio
            r["paired_read_gbs"] = probe_gbs
            r["paired_reps"] = len(fw)
            print(
                f"        paired: {r['paired_roof_pct']:5.1f}% of the adjacent read probes "
                f"(median of {len(fw)} reps; probes {min(pr):.2f}-{max(pr):.2f} GB/s, "
                f"median {probe_gbs:.2f})",
                flush=True,
            )

    probe = None  # its 256 MiB are not the peers' to share
    if args.torch_peer:
        _torch_peer(torch, args, results, E, K, H, I, threads, layers_n)

    # --- 5. kt-kernel and oneDNN peers: right after, kt-jit's layers freed first -------------------
    peers: Dict = {}
    acceptance: List[Dict] = []
    ktk_pairs = onednn_pairs = None
    dtype = ONEDNN_DTYPE.get(args.method)
    if args.ktkernel_peer or args.onednn_peer or args.llamacpp_peer:
        del layers
        import gc

        gc.collect()
        peers_dir = _peers_dir(args.peers_dir)
    if args.ktkernel_peer:
        py = args.ktkernel_peer
        why = None
        if args.method not in KTKERNEL_METHODS:
            why = f"no kt-kernel class for method {args.method}"
        elif not (os.path.isfile(py) or shutil.which(py)):
            why = f"{py} not found (bash tools/peers/setup_peers.sh makes /opt/ktk-venv)"
        elif not peers_dir:
            why = "tools/peers/ktkernel_bench.py not found (run from a checkout or --peers-dir)"
        doc = None
        if not why:
            tmpd = tempfile.mkdtemp(prefix="ktjit-peer-")
            inputs = os.path.join(tmpd, "inputs.pt")
            torch.save(peer_inputs, inputs)
            cmd = [py, os.path.join(peers_dir, "ktkernel_bench.py"), "--method", args.method]
            cmd += ["--tokens", ",".join(str(t) for t in args.tokens), "--threads", str(threads)]
            cmd += ["--layers", str(layers_n), "--seed", str(args.seed), "--inputs", inputs]
            cmd += ["--budget-s", str(args.budget_s)]
            cmd += ["--experts", str(E), "--top-k", str(K), "--hidden", str(H)]
            cmd += ["--intermediate", str(I)]
            if args.reps:
                cmd += ["--reps", str(args.reps)]
            if args.warmup:
                cmd += ["--warmup", str(args.warmup)]
            print(f"kt-kernel peer: {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
            doc, why = _run_peer(cmd, timeout=3600 + 120 * len(args.tokens))
            shutil.rmtree(tmpd, ignore_errors=True)
        if doc is None:
            print(f"kt-kernel peer skipped: {why}", flush=True)
            peers["ktkernel"] = {"skipped": why}
        else:
            ktk_pairs = ktkernel_ratios(results, doc)
            peers["ktkernel"] = dict(doc, pairs=ktk_pairs)
            for q in ktk_pairs:
                print(
                    f"T={q['tokens']:5d}: kt-kernel {doc.get('class', '?')} {q['ktkernel_us']:10.1f}"
                    f" µs -> kt-jit {q['speedup']:.2f}x",
                    flush=True,
                )
    lcpp_pairs = None
    if args.llamacpp_peer:
        doc, why = None, None
        if args.method != "LLAMAFILE":
            why = "the llama.cpp peer runs the GGUF block types (method LLAMAFILE)"
        else:
            binary, why = _ggml_binary(peers_dir, args.llamacpp_peer)
        if not why:
            gu_t, dn_t = GGUF_MIXES.get(args.gguf_type, (args.gguf_type, args.gguf_type))
            cmd = [binary, "--experts", str(E), "--topk", str(K), "--hidden", str(H)]
            cmd += ["--inter", str(I), "--gu-type", gu_t, "--down-type", dn_t]
            cmd += ["--tokens", ",".join(str(t) for t in args.tokens), "--threads", str(threads)]
            cmd += ["--layers", str(layers_n), "--budget-ms", str(args.budget_s * 1000.0)]
            cmd += ["--seed", str(args.seed + 1)]
            print(f"llama.cpp peer: {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
            doc, why = _run_peer(cmd, timeout=3600)
        if doc is None:
            print(f"llama.cpp peer skipped: {why}", flush=True)
            peers["llamacpp"] = {"skipped": why}
        else:
            lcpp_pairs = llamacpp_ratios(results, doc)
            peers["llamacpp"] = dict(doc, pairs=lcpp_pairs)
            print(
                f"llama.cpp: ggml {doc.get('ggml_version')}, gate/up {doc.get('gu_buffer')}, down "
                f"{doc.get('down_buffer')}, rel. L1 vs float64 {doc.get('rel_l1_vs_f64')}",
                flush=True,
            )
            for q in lcpp_pairs:
                print(
                    f"T={q['tokens']:5d}: llama.cpp {q['llamacpp_us']:10.1f} µs -> kt-jit "
                    f"{q['speedup']:.2f}x",
                    flush=True,
                )
    if args.onednn_peer:
        doc, why = None, None
        if not dtype:
            why = f"oneDNN has no matmul on {wname} weights (peer runs for int8 and bf16 methods)"
        else:
            binary, why = _onednn_binary(peers_dir)
        if not why:
            env = dict(os.environ, OMP_NUM_THREADS=str(threads))
            shapes = f"{I}x{H},{H}x{I}"
            cmd = [binary, "--threads", str(threads), "--dtypes", dtype, "--shapes", shapes]
            cmd += ["--ms", ",".join(str(m) for m in args.onednn_ms)]
            cmd += ["--budget-ms", str(args.budget_s * 1000.0)]
            print(f"oneDNN peer: {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
            doc, why = _run_peer(cmd, timeout=3600, env=env)
            if doc is not None:
                doc.update(_onednn_verbose(binary, dtype, f"{I}x{H}", env))
        if doc is None:
            print(f"oneDNN peer skipped: {why}", flush=True)
            peers["onednn"] = {"skipped": why}
        else:
            expert = onednn_expert(doc, H, I, dtype)
            onednn_pairs = onednn_ratios(results, expert, K)
            peers["onednn"] = dict(doc, expert=list(expert.values()), pairs=onednn_pairs)
            for q in onednn_pairs:
                print(
                    f"T={q['tokens']:5d}: oneDNN {dtype} expert at M={q['m']:<4d} "
                    f"{q['onednn_expert_us']:10.1f} µs, {q['onednn_weight_gbs']:6.2f} GB/s, "
                    f"{q['onednn_gops']:7.1f} Gop/s -> kt-jit {q['ratio']:.2f}x",
                    flush=True,
                )
    lim_after = None
    if (ktk_pairs is not None) or (onednn_pairs is not None) or (lcpp_pairs is not None):
        # The VM's bandwidth drifts: the limits again after the peers show how far it moved.
        lim_after = dict(_core.machine_limits())
        print(
            f"read bandwidth after the peers: {_fmt(lim_after.get('read_gbs_1t', 0), 2)} GB/s "
            f"(1 thread), {_fmt(lim_after.get('read_gbs_2t', 0), 2)} GB/s (2 threads); before the "
            f"kt-jit rows: {_fmt(lim.get('read_gbs_1t', 0), 2)}, {_fmt(lim.get('read_gbs_2t', 0), 2)}",
            flush=True,
        )
        peers["limits_after_peers"] = lim_after
    if args.ktkernel_peer or args.onednn_peer or args.llamacpp_peer:
        acceptance = peer_acceptance(ktk_pairs, onednn_pairs, dtype, E, K)
        if lcpp_pairs is not None:
            acceptance += llamacpp_acceptance(lcpp_pairs)
        for line in _acceptance_lines(acceptance):
            print(line, flush=True)

    table = _markdown_table(results)
    print()
    print(table)

    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    if args.markdown:
        md = "\n".join(
            [
                f"# kt-jit MoE benchmark: {shape['name']}, {wname} ({args.method}), "
                f"{threads} thread(s)",
                "",
                f"- machine: {brand} ({os.cpu_count()} CPUs visible, L3 {l3 / 2**20:.1f} MiB, "
                f"THP {_thp_mode()})",
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
            + _peers_markdown(peers, acceptance, dtype, H, I)
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
                "thp": _thp_mode(),
                "features": {
                    k: v for k, v in feats.items() if isinstance(v, (bool, int, float, str))
                },
            },
            "date": date,
            "command": command,
            "config": {
                "shape": shape,
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
        if peers:
            doc["peers"] = peers
            doc["acceptance"] = acceptance
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
