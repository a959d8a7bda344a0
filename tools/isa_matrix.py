#!/usr/bin/env python3
"""Writes docs/ISA_MATRIX.md: for every built method x ISA level, how this build's code for it was
verified on the machine that ran the script. Produced from test runs, not by hand:

- "native": the level runs here; a tiny MoE layer (decode and prefill sizes, a tail strip) through
  the generated kernels equals the C++ reference path bit for bit (kt-jit doctor's self-test).
- "emulated": the level does not run here but qemu-x86_64 -cpu Haswell does (AVX2 only, SIGILL on
  any AVX-512): the C++ kernel sweep (every kernel shape, every format) passed under it.
  For the AArch64 levels (neon, neon_dotprod, neon_bf16): the cross-built suite
  (tests/emu/run_aarch64.sh, BUILD_AARCH64/ktjit_tests) ran under qemu-aarch64 and its NEON kernel
  sweeps (A64Gemm.*, QGroup.*, MxGemm.*: bit for bit against gemm_ref) and MoE executor tests
  (MoELayer.*, MxMoELayer.*) passed at that level; the
  cell names the CPU models (-cpu max runs all three levels, -cpu cortex-a72 plain neon).
- "interpreted": an x86 level above what this CPU runs (AVX-512 on an AVX2-only machine): the C++
  kernel sweeps (Gemm, MxGemm, QGroup: every kernel shape of every format) and the vdpbf16ps pair
  kernels ran in the tests' x86-64 interpreter (tests/cpp/x64_emu.cpp, itself checked against this
  CPU by ctest's x64_emu_matches_hardware) and equal the C++ reference bit for bit at that level.
- "generated": the kernels for the level are generated and disassemble, but nothing executed them.
- "encoding-checked, tile-model-verified" (amx without AMX hardware): the C++ AMX suite passed —
  every tile instruction objdump finds equals the generator's own log and our decoder's reading,
  and the real kernels ran with each tile instruction trapped (SIGILL) and executed on the software
  tile model, equal to the C++ reference bit for bit (tests/cpp/test_amx.cpp).
- "not supported": no generator for the level yet.
- "native on <machine>": the level did not run here, but this same script ran on that machine
  (e.g. a lent Xeon with AMX) with `--json`, found the level runnable there and its self-test equal
  bit for bit; that run's JSON report is committed under docs/evidence/ and merged with `--merge`.
  For amx the cell also says whether the C++ AMX suite (tests/cpp/test_amx.cpp, which runs the
  kernels natively, without the trap, on AMX hardware) passed there.

    python tools/isa_matrix.py [--build build] [--build-aarch64 build-aarch64] [--out docs/ISA_MATRIX.md]
                               [--json REPORT.json] [--merge docs/evidence/REPORT.json ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys

LEVELS = ["amx", "avx512_bf16", "avx512_vnni", "avx512", "avx2"]
NEON_LEVELS = ["neon_bf16", "neon_dotprod", "neon"]


def _aarch64_sweeps(build: str) -> dict:
    """level -> CPU models under which its NEON sweep and the MoE tests passed (qemu-aarch64)."""
    qemu = shutil.which("qemu-aarch64")
    exe = os.path.join(build, "ktjit_tests")
    proven: dict = {}
    if not qemu or not os.path.exists(exe):
        return proven
    env = {k: v for k, v in os.environ.items() if k != "KT_JIT_ISA"}
    for cpu in ("max", "cortex-a72"):
        p = subprocess.run(
            [
                qemu,
                "-L",
                "/usr/aarch64-linux-gnu",
                "-cpu",
                cpu,
                exe,
                "--gtest_filter=A64Gemm.*:MoELayer.*:QGroup.*:MxGemm.*:MxMoELayer.*",
            ],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if p.returncode != 0 or "PASSED" not in p.stdout:
            continue
        for line in p.stdout.splitlines():
            # "a64: neon_dotprod: 120 kernels generated, run and equal to gemm_ref"
            parts = line.split(":")
            if len(parts) >= 3 and parts[0] == "a64" and "equal to gemm_ref" in line:
                proven.setdefault(parts[1].strip(), []).append(cpu)
    return proven


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


def _interpreted_sweeps(build: str) -> set:
    """x86 levels whose kernel sweeps passed in the x86-64 interpreter (not runnable here)."""
    exe = os.path.join(build, "ktjit_tests")
    if not os.path.exists(exe):
        return set()
    p = subprocess.run(
        [
            exe,
            "--gtest_filter=Gemm.SweepMatchesReferenceBitwise:MxGemm.SweepMatchesReferenceBitwise:"
            "QGroup.SweepMatchesReferenceBitwise:Bf16Pairs.GeneratedMatchesReferenceBitwise",
        ],
        capture_output=True,
        text=True,
        check=False,
        env={k: v for k, v in os.environ.items() if k not in ("KT_JIT_ISA", "KT_JIT_TEST_DUAL")},
    )
    if p.returncode != 0 or "PASSED" not in p.stdout:
        return set()
    # "gemm sweep: avx512 (emulated)": a level counts when every sweep ran it in the interpreter
    seen: dict = {}
    for line in p.stdout.splitlines():
        if " sweep: " in line and line.endswith("(emulated)"):
            sweep, level = line.split(" sweep: ")
            seen.setdefault(level.split(" ")[0], set()).add(sweep)
    return {lv for lv, sweeps in seen.items() if sweeps >= {"gemm", "mx", "qgroup"}}


def _amx_suite(build: str) -> bool:
    """The C++ AMX checks (encoding vs objdump, tile model, trapped execution) pass."""
    exe = os.path.join(build, "ktjit_tests")
    if not os.path.exists(exe):
        return False
    p = subprocess.run(
        [exe, "--gtest_filter=AmxEncoding.*:AmxTileModel.*:AmxExecution.*:AmxProbe.*"],
        capture_output=True,
        text=True,
        check=False,
        env={k: v for k, v in os.environ.items() if k != "KT_JIT_ISA"},
    )
    return p.returncode == 0 and "PASSED" in p.stdout and "SKIPPED" not in p.stdout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--build-aarch64", default="build-aarch64")
    ap.add_argument("--out", default="docs/ISA_MATRIX.md")
    ap.add_argument("--json", help="also write this run's cells as a JSON report")
    ap.add_argument(
        "--merge",
        action="append",
        default=[],
        help="a JSON report from another machine: its native cells fill levels not runnable here",
    )
    args = ap.parse_args(argv)

    from kt_jit import _core
    from kt_jit.cli import _self_test

    methods = [m.strip() for m in _core.built_methods().split(",")]
    runnable = set(_core.runnable_isas())
    emulated_avx2 = _haswell_sweep(args.build)
    emulated_neon = _aarch64_sweeps(args.build_aarch64)
    interpreted = _interpreted_sweeps(args.build)
    amx_suite = _amx_suite(args.build)
    amx_checked = "amx" not in runnable and amx_suite
    rows = []
    failures = 0
    for method in methods:
        cells = []
        for level in LEVELS:
            if level in runnable:
                try:
                    problem = _self_test(level, method)
                except Exception as e:  # a method the self-test cannot build yet  # noqa: BLE001
                    problem = f"self-test error: {e}"
                failures += bool(problem)
                cell = "native" if not problem else f"FAILED: {problem}"
                if level == "amx" and not problem:
                    ks = _core.dump_kernels(method, 8, 2, 128, 80, level)
                    if not any("_amx_" in k["name"] for k in ks):
                        cell += " (avx512_bf16 kernels; no AMX generator for this format)"
                    elif amx_suite:
                        cell += " + C++ AMX suite natively"
                    else:
                        cell += " (C++ AMX suite failed)"
                        failures += 1
                if level == "avx2" and emulated_avx2:
                    cell += " + emulated"
            elif level == "avx2" and emulated_avx2:
                cell = "emulated"
            elif level in interpreted:
                cell = "interpreted"
            else:
                try:
                    ks = _core.dump_kernels(method, 8, 2, 128, 80, level)
                    cell = f"generated ({len(ks)} kernels)" if ks else "not supported"
                    n_amx = sum("_amx_" in k["name"] for k in ks)
                    if level == "amx" and ks and not n_amx:
                        cell = f"generated ({len(ks)} avx512_bf16 kernels; no AMX generator for this format)"
                    elif level == "amx" and n_amx:
                        cell = f"generated ({len(ks)} kernels, {n_amx} AMX)"
                        cell += (
                            ", encoding-checked, tile-model-verified"
                            if amx_checked
                            else " (AMX checks failed or not built)"
                        )
                        failures += not amx_checked
                except Exception:  # no generator for this level
                    cell = "not supported"
            cells.append(cell)
        for level in NEON_LEVELS:
            try:
                ks = _core.dump_kernels(method, 8, 2, 128, 80, level)
            except Exception:  # no NEON generator for this method's format  # noqa: BLE001
                ks = []
            if not ks:
                cell = "not supported"
            elif level in emulated_neon:
                cell = "emulated (qemu-aarch64 -cpu " + ", ".join(emulated_neon[level]) + ")"
            else:
                cell = f"generated ({len(ks)} kernels)"
            cells.append(cell)
        rows.append((method, cells))

    feats = _core.cpu_features()
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    all_levels = LEVELS + NEON_LEVELS
    if args.json:
        report = {
            "machine": feats.get("brand", "?"),
            "isa": _core.isa(),
            "date": date,
            "cells": {m: dict(zip(all_levels, c)) for m, c in rows},
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    merged = []
    for path in args.merge:
        with open(path) as f:
            rep = json.load(f)
        merged.append(rep)
        for method, cells in rows:
            theirs = rep["cells"].get(method, {})
            for i, level in enumerate(all_levels):
                t = theirs.get(level, "")
                if t.startswith("native") and not cells[i].startswith("native"):
                    how = t[len("native") :].split(" + emulated")[0].strip(" +").strip("()")
                    how = f"; {how}" if how else ""
                    cells[i] = (
                        f"native on the {rep['isa']} host ({rep['date'][:10]}{how}; "
                        f"{os.path.basename(path)}); here: {cells[i]}"
                    )
    lines = [
        "# ISA matrix",
        "",
        "Every built method x ISA level, and how it was verified. Written by "
        "`python tools/isa_matrix.py` (not by hand); the legend is in that script's docstring:",
        "**native** = run here, generated kernels equal the C++ reference bit for bit; "
        "**emulated** = kernel sweep passed under `qemu-x86_64 -cpu Haswell` (x86 levels) or "
        "`qemu-aarch64` (NEON levels, cross-built suite); "
        "**interpreted** = an x86 level this CPU lacks: every kernel sweep ran in the tests' x86-64 "
        "interpreter (itself checked against this CPU's own kernels) and equals the reference bit "
        "for bit; "
        "**generated** = kernels generate and disassemble but did not run; "
        "**encoding-checked, tile-model-verified** = AMX tile instructions equal objdump's listing "
        "and the kernels ran with every tile instruction executed by the software tile model, "
        "bit for bit equal to the reference; "
        "**not supported** = no generator yet; "
        "**native on M** = this script ran on machine M (its JSON report is in docs/evidence/), "
        "where the level runs, and the self-test (and for amx the C++ AMX suite, natively) passed "
        "there.",
        "",
        f"- machine: {feats.get('brand', '?')}, selected ISA {_core.isa()}",
        f"- date: {date}",
    ]
    for rep in merged:
        lines.append(
            f"- merged: the native cells of this script's run on the {rep['isa']} host "
            f"({rep['machine']}, selected ISA {rep['isa']}), {rep['date']}"
        )
    lines += [
        "",
        "| method | " + " | ".join(LEVELS + NEON_LEVELS) + " |",
        "|---|" + "---|" * len(LEVELS + NEON_LEVELS),
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
