#!/usr/bin/env python3
"""Writes docs/ISA_MATRIX.md: for every built method x ISA level, how this build's code for it was
verified on the machine that ran the script. Produced from test runs, not by hand:

- "native": the level runs here; a tiny MoE layer (decode and prefill sizes, a tail strip) through
  the generated kernels equals the C++ reference path bit for bit (kt-jit doctor's self-test).
- "emulated": the level does not run here but qemu-x86_64 -cpu Haswell does (AVX2 only, SIGILL on
  any AVX-512): the C++ kernel sweep (every kernel shape, every format) passed under it.
- "generated": the kernels for the level are generated and disassemble, but nothing executed them.
- "not supported": no generator for the level yet.

    python tools/isa_matrix.py [--build build] [--out docs/ISA_MATRIX.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import subprocess
import sys

LEVELS = ["amx", "avx512_bf16", "avx512_vnni", "avx512", "avx2"]


def _haswell_sweep(build: str) -> bool:
    qemu = shutil.which("qemu-x86_64")
    exe = os.path.join(build, "ktjit_tests")
    if not qemu or not os.path.exists(exe):
        return False
    p = subprocess.run(
        [qemu, "-cpu", "Haswell", exe, "--gtest_filter=Gemm.*:MoELayer.*"],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "KT_JIT_ISA"},
    )
    return p.returncode == 0 and "PASSED" in p.stdout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--out", default="docs/ISA_MATRIX.md")
    args = ap.parse_args(argv)

    from kt_jit import _core
    from kt_jit.cli import _self_test

    methods = [m.strip() for m in _core.built_methods().split(",")]
    runnable = set(_core.runnable_isas())
    emulated_avx2 = _haswell_sweep(args.build)
    rows = []
    failures = 0
    for method in methods:
        cells = []
        for level in LEVELS:
            if level in runnable:
                problem = _self_test(level, method)
                failures += bool(problem)
                cell = "native" if not problem else f"FAILED: {problem}"
                if level == "avx2" and emulated_avx2:
                    cell += " + emulated"
            elif level == "avx2" and emulated_avx2:
                cell = "emulated"
            else:
                try:
                    ks = _core.dump_kernels(method, 8, 2, 128, 80, level)
                    cell = f"generated ({len(ks)} kernels)" if ks else "not supported"
                except Exception:  # no generator for this level
                    cell = "not supported"
            cells.append(cell)
        rows.append((method, cells))

    feats = _core.cpu_features()
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    lines = [
        "# ISA matrix",
        "",
        "Every built method x ISA level, and how it was verified. Written by "
        "`python tools/isa_matrix.py` (not by hand); the legend is in that script's docstring:",
        "**native** = run here, generated kernels equal the C++ reference bit for bit; "
        "**emulated** = kernel sweep passed under `qemu-x86_64 -cpu Haswell`; "
        "**generated** = kernels generate and disassemble but did not run; "
        "**not supported** = no generator yet.",
        "",
        f"- machine: {feats.get('brand', '?')}, selected ISA {_core.isa()}",
        f"- date: {date}",
        "",
        "| method | " + " | ".join(LEVELS) + " |",
        "|---|" + "---|" * len(LEVELS),
    ]
    for method, cells in rows:
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines.append("")
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
