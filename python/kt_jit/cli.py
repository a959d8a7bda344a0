"""``kt-jit`` command line: version, doctor, dump, bench, convert."""

from __future__ import annotations

import sys
from typing import List, Optional

USAGE = """usage: kt-jit <command> [args]

commands:
  version   version, selected ISA and a CPU feature summary
  doctor    CPU model, selected ISA, why higher levels were refused, and a kernel self-test
  dump      generate and show the JIT kernels of one MoE layer (same as kt-jit-dump)
  bench     MoE forward benchmark
  convert   convert a Hugging Face checkpoint into kt-jit's weight artifact (AMXINT8/AMXINT4)
"""

#: ISA levels, highest first, and the CPU features each one needs (x86-64; AArch64 below).
LEVELS = ("amx", "avx512_bf16", "avx512_vnni", "avx512", "avx2")
NEON_LEVELS = ("neon_bf16", "neon_dotprod", "neon")
LEVEL_FEATURES = {
    "neon": ("asimd",),
    "neon_dotprod": ("asimd", "asimd_dp"),
    "neon_bf16": ("asimd", "asimd_dp", "arm_bf16"),
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512_vnni": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"),
    "avx512_bf16": (
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512dq",
        "avx512_vnni",
        "avx512_bf16",
    ),
    "amx": ("avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"),
}


def _norm(s: str) -> str:
    return "".join(c for c in str(s).lower() if c.isalnum())


def _lookup(features: dict, name: str):
    """Value of feature ``name`` in the probe dict, tolerant of spelling (avx512_vnni/avx512vnni)."""
    want = _norm(name)
    for key, val in features.items():
        k = _norm(key)
        if k in (want, "has" + want, "cpuid" + want):
            return val
    return None


def _cpu_model(features: dict) -> str:
    for key in ("brand", "cpu_brand", "model_name", "model", "cpu_model"):
        if features.get(key):
            return str(features[key]).strip()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _bool_summary(features: dict) -> str:
    on = sorted(str(k) for k, v in features.items() if isinstance(v, bool) and v)
    return " ".join(on)


def cmd_version(argv: List[str]) -> int:
    import kt_jit

    feats = kt_jit.cpu_features()
    print(f"kt-jit {kt_jit.__version__}")
    print(f"isa: {kt_jit.__isa__}")
    detected = feats.get("detected_isa")
    if detected is not None and detected != kt_jit.__isa__:
        print(f"detected isa: {detected} (capped by KT_JIT_ISA)")
    print(f"cpu: {_cpu_model(feats)}")
    print(f"features: {_bool_summary(feats)}")
    return 0


def _higher_levels(features: dict, selected: str) -> List[str]:
    """This architecture's levels above ``selected``, highest first."""
    levels = NEON_LEVELS if features.get("aarch64") else LEVELS
    return list(levels[: levels.index(selected)] if selected in levels else levels)


def _refusal_reason(level: str, features: dict, runnable: List[str]) -> str:
    if level in runnable:
        return "usable, but capped (KT_JIT_ISA)"
    refused = features.get("refused")
    if isinstance(refused, dict) and level in refused:
        missing = refused[level]
        if isinstance(missing, (list, tuple)):
            missing = ", ".join(str(m) for m in missing)
        if missing:
            return f"missing {missing}"
    missing, unknown = [], []
    for feat in LEVEL_FEATURES.get(level, ()):
        val = _lookup(features, feat)
        if val is None:
            unknown.append(feat)
        elif not val:
            missing.append(feat)
    parts = []
    if missing:
        parts.append("CPU lacks " + ", ".join(missing))
    if not parts:
        parts.append("not runnable on this machine")
    if unknown:
        parts.append("(probe does not report " + ", ".join(unknown) + ")")
    return "; ".join(parts)


def _self_test(isa: str, method: str = "AMXINT8") -> str:
    """Tiny MoELayer forwards on ``isa`` against the C++ reference path, at a decode-sized and a
    prefill-sized T (so both kernel variants and every epilogue run); '' when identical, and a
    string starting with ``reference:`` when ``isa`` has no generated kernels for the method."""
    import torch

    from . import _core

    E, K, H, I = 8, 2, 128, 80  # I = 80: a tail strip at every vector width
    mx = method in ("MXFP4", "MXFP8")
    if mx:  # MX: multiples of 32; H = 160 leaves down a tail strip, and L / alpha are on
        H, I = 160, 96
    g = torch.Generator().manual_seed(1234)
    gate = torch.randn(E, I, H, generator=g) * 0.05
    up = torch.randn(E, I, H, generator=g) * 0.05
    down = torch.randn(E, H, I, generator=g) * 0.05
    kw = {"swiglu_limit": 0.5, "swiglu_alpha": 1.702} if mx else {}
    qg = method in ("LLAMAFILE", "RAWINT4", "GPTQ_INT4")
    if qg:  # k-group integer layers: nibbles through a table (INT4), or bytes with a bias term
        nib = method != "LLAMAFILE"
        lut = [i - 8 for i in range(16)] if nib else []
        kw = dict(gu_group=16, down_group=16, gu_bias=not nib, down_bias=not nib)
        kw.update(gu_lut=lut, down_lut=lut)
    layer = _core.MoELayer(E, K, H, I, method, isa, **kw)
    if mx:  # random e2m1 / e4m3 bytes, ue8m0 scales 2^-8 .. 2^-5
        fp4 = method == "MXFP4"
        shapes = ((I, H), (I, H), (H, I))
        mats = [torch.randint(0, 256, (E, n, k // 2 if fp4 else k), generator=g) for n, k in shapes]
        mats = [m.to(torch.uint8) for m in mats]
        if not fp4:  # no e4m3 NaN codes
            mats = [torch.where((m & 0x7F) == 0x7F, m ^ 1, m) for m in mats]
        scales = [
            torch.randint(119, 123, (E, n, k // 32), generator=g).to(torch.uint8) for n, k in shapes
        ]
        slots = list(range(E))
        layer.load_experts_mx(slots, *[[t[e].data_ptr() for e in slots] for t in mats + scales])
    elif method.startswith("FP8"):  # e4m3 weights with block (FP8) or row (FP8_PERCHANNEL) scales
        mats = [t.clamp(-448, 448).to(torch.float8_e4m3fn) for t in (gate * 20, up * 20, down * 20)]
        block = method == "FP8"
        scales = [
            (
                torch.full((E, (m.shape[1] + 127) // 128, (m.shape[2] + 127) // 128), 0.05)
                if block
                else torch.rand(E, m.shape[1], generator=g) * 0.05 + 0.01
            )
            for m in mats
        ]
        slots = list(range(E))
        layer.load_experts_fp8(slots, *[[t[e].data_ptr() for e in slots] for t in mats + scales])
    elif qg:  # random codes in the table's range (bytes: the full int8 range), scales, biases
        lo, hi = (-8, 8) if nib else (-128, 128)
        mats = [
            torch.randint(lo, hi, t.shape, generator=g).to(torch.int8) for t in (gate, up, down)
        ]
        sc = [torch.rand(E, t.shape[1], t.shape[2] // 16, generator=g) * 0.01 for t in mats]
        bs = [torch.randn(E, t.shape[1], t.shape[2] // 16, generator=g) * 0.01 for t in mats]
        slots = list(range(E))
        ptrs = []
        for m, s_, b in zip(mats, sc, bs):
            ptrs += [[m[e].data_ptr() for e in slots], [s_[e].data_ptr() for e in slots]]
            ptrs.append([0] * E if nib else [b[e].data_ptr() for e in slots])
        layer.load_experts_grouped(slots, *ptrs)
    else:
        layer.load_from_float(gate.data_ptr(), up.data_ptr(), down.data_ptr(), "f32", 0)
    if layer.isa != isa:  # no generated kernels for this format here (NEON: int8, int4, bf16)
        return f"reference: runs the C++ reference kernels at {isa}"
    for T in (5, 60, 160):  # 160: >= 16 rows per expert, so amx runs its AMX tiles
        x = torch.randn(T, H, generator=g)
        ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int64)
        w = torch.rand(T, K, generator=g)
        out = torch.empty(T, H)
        ref = torch.empty(T, H)
        layer.forward(T, x.data_ptr(), ids.data_ptr(), w.data_ptr(), 0, out.data_ptr())
        layer.forward_reference(T, x.data_ptr(), ids.data_ptr(), w.data_ptr(), 0, ref.data_ptr())
        if not torch.equal(out, ref):
            diff = (out - ref).abs().max().item()
            return f"T={T}: max |jit - reference| = {diff:.3g}"
    return ""


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _system_lines() -> List[str]:
    """NUMA nodes with their CPUs and memory, transparent and explicit huge pages (Linux)."""
    import glob
    import os

    lines = [
        f"cpus online: {os.cpu_count()}, usable by this process: {len(os.sched_getaffinity(0))}"
    ]
    nodes = sorted(
        glob.glob("/sys/devices/system/node/node[0-9]*"),
        key=lambda p: int(os.path.basename(p)[4:]),
    )
    if not nodes:
        lines.append("numa: no /sys/devices/system/node (one node assumed)")
    for n in nodes:
        mem = _read(f"{n}/meminfo").splitlines()
        total = next((x.split()[-2] for x in mem if "MemTotal" in x), "?")
        gib = f"{int(total) / 2**20:.1f} GiB" if total.isdigit() else "? GiB"
        lines.append(f"numa {os.path.basename(n)}: cpus {_read(n + '/cpulist') or '?'}, {gib}")
    thp = _read("/sys/kernel/mm/transparent_hugepage/enabled") or "unavailable"
    defrag = _read("/sys/kernel/mm/transparent_hugepage/defrag") or "unavailable"
    lines.append(f"transparent huge pages: enabled {thp}; defrag {defrag}")
    if "[never]" in thp:
        # kt-jit advises its packed weights and its forward scratch from 2 MiB on for huge pages
        # (MADV_HUGEPAGE); with THP off they sit on 4 KiB pages, and the scattered partial rows of
        # large prefill batches cost TLB misses (docs/BENCHMARKS.md: ~2-3 % at T = 4096)
        lines.append(
            "note: transparent huge pages are off, so kt-jit's weights and scratch get 4 KiB "
            "pages; `echo madvise > /sys/kernel/mm/transparent_hugepage/enabled` (as root) "
            "lets them have huge pages"
        )
    meminfo = {
        x.split(":")[0]: x.split(":")[1].strip()
        for x in _read("/proc/meminfo").splitlines()
        if ":" in x
    }
    lines.append(
        f"huge pages: {meminfo.get('HugePages_Total', '?')} x {meminfo.get('Hugepagesize', '?')}, "
        f"anonymous huge pages in use {meminfo.get('AnonHugePages', '?')}"
    )
    return lines


def cmd_doctor(argv: List[str]) -> int:
    import os

    import kt_jit
    from . import _core

    feats = kt_jit.cpu_features()
    runnable = list(_core.runnable_isas())
    selected = kt_jit.__isa__
    print(f"kt-jit {kt_jit.__version__}")
    print(f"cpu: {_cpu_model(feats)}")
    print(f"selected isa: {selected}")
    if os.environ.get("KT_JIT_ISA"):
        print(f"KT_JIT_ISA={os.environ['KT_JIT_ISA']}")
    if feats.get("detected_isa") is not None:
        print(f"detected isa: {feats['detected_isa']}")
    print(f"runnable isas: {', '.join(runnable)}")
    higher = _higher_levels(feats, selected)
    if higher:
        print("higher levels:")
        for level in higher:
            print(f"  {level:<12} refused: {_refusal_reason(level, feats, runnable)}")
    print("system:")
    for line in _system_lines():
        print(f"  {line}")
    print("probe:")
    for key in sorted(feats, key=str):
        if key == "refused":
            continue
        print(f"  {key}: {feats[key]}")
    print("self-test (tiny MoE layer per method, JIT vs C++ reference, bitwise):")
    failures = 0
    methods = [m.strip() for m in _core.built_methods().split(",")]
    for isa in runnable:
        results = []
        for method in methods:
            try:
                problem = _self_test(isa, method)
            except Exception as e:  # report, never crash the doctor
                problem = f"{type(e).__name__}: {e}"
            if problem.startswith("reference:"):
                results.append(f"{method} n/a (C++ reference kernels)")
                continue
            failures += bool(problem)
            results.append(f"{method} {'pass' if not problem else 'FAIL (' + problem + ')'}")
        print(f"  {isa:<12} " + ", ".join(results))
    return 1 if failures else 0


def cmd_dump(argv: List[str]) -> int:
    from . import dump

    return dump.main(argv)


def cmd_bench(argv: List[str]) -> int:
    try:
        from . import bench
    except ImportError as e:
        print(f"kt-jit bench: the benchmark driver is not available in this build ({e})")
        return 2
    return bench.main(argv)


def cmd_convert(argv: List[str]) -> int:
    from . import convert

    return convert.main(argv)


COMMANDS = {
    "version": cmd_version,
    "doctor": cmd_doctor,
    "dump": cmd_dump,
    "bench": cmd_bench,
    "convert": cmd_convert,
}


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if argv else 2
    if argv[0] in ("--version", "-V"):
        argv[0] = "version"
    cmd = COMMANDS.get(argv[0])
    if cmd is None:
        print(f"kt-jit: unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr, end="")
        return 2
    return int(cmd(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
