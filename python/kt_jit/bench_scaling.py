"""Scaling figures that are not per-forward speed: kernel generation time per layer and the cost
of a cache hit, and resident memory after load against the packed weight bytes. Not a test.

    python -m kt_jit.bench_scaling [--markdown PATH] [--json PATH]

Each measurement of generation time runs in a fresh interpreter (an empty kernel cache); resident
memory is read from /proc/self/statm around the load, with the source weights allocated before
the first reading, so the difference is what the layer itself keeps.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Dict, List

SHAPES = [
    {"name": "Qwen3-30B-A3B", "experts": 128, "top_k": 8, "hidden": 2048, "intermediate": 768},
    {"name": "DeepSeek-V3", "experts": 256, "top_k": 8, "hidden": 7168, "intermediate": 2048},
    {"name": "Mixtral-8x7B", "experts": 8, "top_k": 2, "hidden": 4096, "intermediate": 14336},
]
METHODS = ("AMXINT8", "AMXINT4", "BF16", "FP8")

_GEN_CHILD = r"""
import json, sys, time
from kt_jit import _core
E, K, H, I, method = {E}, {K}, {H}, {I}, {method!r}
t0 = time.perf_counter()
layer = _core.MoELayer(E, K, H, I, method)
first = (time.perf_counter() - t0) * 1e3
st = _core.cache_stats()
t0 = time.perf_counter()
again = _core.MoELayer(E, K, H, I, method)
second = (time.perf_counter() - t0) * 1e3
print(json.dumps({{"first_ms": first, "gen_ms": st["gen_us"] / 1e3, "kernels": st["misses"],
                   "code_bytes": st["bytes"], "hit_ms": second, "isa": _core.isa()}}))
"""

_RSS_CHILD = r"""
import json, os, torch
from kt_jit import _core
E, K, H, I, method = {E}, {K}, {H}, {I}, {method!r}
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
_core.init_pool(1)
g = torch.Generator().manual_seed(0)
src = [torch.randn(E, I, H, generator=g).to(torch.bfloat16),
       torch.randn(E, I, H, generator=g).to(torch.bfloat16),
       torch.randn(E, H, I, generator=g).to(torch.bfloat16)]
layer = _core.MoELayer(E, K, H, I, method)
before = rss()
layer.load_from_float(src[0].data_ptr(), src[1].data_ptr(), src[2].data_ptr(), "bf16", 0)
after = rss()
print(json.dumps({{"rss_delta": after - before, "packed": layer.packed_bytes}}))
"""


def _child(code: str) -> Dict:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip().splitlines()[-1] if r.stderr else "child failed")
    return json.loads(r.stdout.strip().splitlines()[-1])


def gen_times(shapes=SHAPES, methods=METHODS) -> List[Dict]:
    rows = []
    for s in shapes:
        for m in methods:
            d = _child(
                _GEN_CHILD.format(
                    E=s["experts"], K=s["top_k"], H=s["hidden"], I=s["intermediate"], method=m
                )
            )
            rows.append({"shape": s["name"], "method": m, **d})
    return rows


def resident(shape=SHAPES[0], methods=("AMXINT8", "AMXINT4", "BF16")) -> List[Dict]:
    rows = []
    for m in methods:
        d = _child(
            _RSS_CHILD.format(
                E=shape["experts"],
                K=shape["top_k"],
                H=shape["hidden"],
                I=shape["intermediate"],
                method=m,
            )
        )
        rows.append(
            {"shape": shape["name"], "method": m, **d, "ratio": d["rss_delta"] / d["packed"]}
        )
    return rows


def markdown(gen: List[Dict], rss: List[Dict]) -> str:
    out = ["## Kernel generation per layer (fresh process) and cache hits", ""]
    out.append(
        "| shape | method | isa | kernels | code KiB | generation ms | layer construction ms "
        "| same layer again (all hits) ms |"
    )
    out.append("|---|---|---|---:|---:|---:|---:|---:|")
    for r in gen:
        out.append(
            f"| {r['shape']} | {r['method']} | {r['isa']} | {r['kernels']} | "
            f"{r['code_bytes'] / 1024:.1f} | {r['gen_ms']:.2f} | {r['first_ms']:.2f} | "
            f"{r['hit_ms']:.3f} |"
        )
    out += ["", "## Resident memory after load", ""]
    out.append("| shape | method | packed MiB | RSS growth over the load MiB | ratio |")
    out.append("|---|---|---:|---:|---:|")
    for r in rss:
        out.append(
            f"| {r['shape']} | {r['method']} | {r['packed'] / 2**20:.1f} | "
            f"{r['rss_delta'] / 2**20:.1f} | {r['ratio']:.3f} |"
        )
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--markdown", metavar="PATH")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    gen, rss = gen_times(), resident()
    text = markdown(gen, rss)
    print(text)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"generation": gen, "resident": rss}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
