#!/usr/bin/env python3
"""Where the time goes inside generated kernels: perf samples per kernel, per instruction, per loop.

Without hardware counters (this project's VMs count software events only), sampling the
instruction pointer with `perf record -e cpu-clock` still shows which instructions of a kernel
the time lands on. perf cannot disassemble JIT code, so this joins three things kt-jit can write:

1. the sample IPs (`perf script -F ip`),
2. `/tmp/perf-<pid>.map` (`KT_JIT_PERF_MAP=1`: each kernel's address, size and name),
3. the kernels' code (`KT_JIT_DUMP=<dir>`: `<name>.bin`), disassembled with objdump,

and prints the share of samples per kernel, then for one kernel (the hottest unless --kernel) its
loops (the ranges between a backward branch and its target, innermost first) with their shares,
and its hottest instructions. A sample lands on the instruction that was waiting to retire, so
read shares of regions, not of single instructions.

    KT_JIT_PERF_MAP=1 KT_JIT_DUMP=/tmp/kdump python my_forward_loop.py &   # warm up, then loop
    perf record -e cpu-clock -F 4000 -p <pid> -o perf.data -- sleep 15      # while it loops
    python tools/kernel_profile.py --perf-data perf.data --map /tmp/perf-<pid>.map \\
        --dump /tmp/kdump [--kernel NAME] [--top 25]

Record while the process runs forwards only (attach with -p after its set-up), or the set-up's
samples outnumber the kernels'.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import os
import re
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

Kernel = Tuple[int, int, str]  # start address, size in bytes, name


def parse_perf_map(text: str) -> List[Kernel]:
    """The `<start hex> <size hex> <name>` lines of a perf map, sorted by address."""
    out = []
    for line in text.splitlines():
        parts = line.split(maxsplit=2)
        if len(parts) != 3:
            continue
        try:
            out.append((int(parts[0], 16), int(parts[1], 16), parts[2].strip()))
        except ValueError:
            continue
    return sorted(out)


def parse_ips(text: str) -> List[int]:
    """Sample addresses, one hex number per line (`perf script -F ip`)."""
    ips = []
    for line in text.split():
        try:
            ips.append(int(line, 16))
        except ValueError:
            continue
    return ips


def attribute(ips: List[int], kernels: List[Kernel]):
    """(samples per kernel name, {name: Counter of offsets}, samples outside every kernel)."""
    starts = [k[0] for k in kernels]
    per_kernel: Dict[str, int] = collections.Counter()
    offsets: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    outside = 0
    for ip in ips:
        i = bisect.bisect_right(starts, ip) - 1
        if i >= 0 and ip < kernels[i][0] + kernels[i][1]:
            name = kernels[i][2]
            per_kernel[name] += 1
            offsets[name][ip - kernels[i][0]] += 1
        else:
            outside += 1
    return per_kernel, offsets, outside


_INSN = re.compile(r"^\s*([0-9a-f]+):\t(?:[0-9a-f]{2} )+\s*\t(.+)$")


def parse_objdump(text: str) -> List[Tuple[int, str]]:
    """(offset, instruction text) of each instruction in `objdump -D -b binary` output (the
    continuation lines of long encodings carry no instruction and are skipped)."""
    out = []
    for line in text.splitlines():
        m = _INSN.match(line)
        if m:
            out.append((int(m.group(1), 16), " ".join(m.group(2).split())))
    return out


def disassemble(path: str) -> List[Tuple[int, str]]:
    res = subprocess.run(
        ["objdump", "-D", "-b", "binary", "-m", "i386:x86-64", path],
        capture_output=True,
        text=True,
        check=True,
    )
    return parse_objdump(res.stdout)


_BRANCH = re.compile(r"^j[a-z]+\s+(?:0x)?([0-9a-f]+)\b")


def loops(insns: List[Tuple[int, str]]) -> List[Tuple[int, int]]:
    """[target, end) ranges of the backward conditional branches (jmp excluded), smallest
    first; end is the offset after the branch."""
    out = []
    for i, (off, text) in enumerate(insns):
        m = _BRANCH.match(text)
        if not m or text.startswith("jmp"):
            continue
        target = int(m.group(1), 16)
        if target <= off:
            end = insns[i + 1][0] if i + 1 < len(insns) else off + 1
            out.append((target, end))
    return sorted(set(out), key=lambda r: (r[1] - r[0], r[0]))


def share(counter: collections.Counter, lo: int, hi: int) -> int:
    return sum(c for o, c in counter.items() if lo <= o < hi)


def report(
    per_kernel: Dict[str, int],
    offsets: Dict[str, collections.Counter],
    outside: int,
    insns: Optional[List[Tuple[int, str]]],
    kernel: str,
    top: int,
) -> str:
    total = sum(per_kernel.values()) + outside
    lines = [f"{total} samples; {outside} ({100 * outside / max(total, 1):.1f} %) outside kernels"]
    for name, c in sorted(per_kernel.items(), key=lambda kv: -kv[1]):
        lines.append(f"{100 * c / max(total, 1):6.2f} %  {name}")
    counts = offsets.get(kernel, collections.Counter())
    n = sum(counts.values())
    lines.append("")
    lines.append(f"{kernel}: {n} samples")
    if not insns or not n:
        return "\n".join(lines)
    lines.append(
        "loops (innermost first): [start, end) share of the kernel's samples, instructions"
    )
    for lo, hi in loops(insns):
        k = sum(1 for o, _ in insns if lo <= o < hi)
        lines.append(f"  [{lo:#6x}, {hi:#6x})  {100 * share(counts, lo, hi) / n:5.1f} %  {k}")
    text = dict(insns)
    lines.append(f"hottest {top} instructions:")
    for off, c in counts.most_common(top):
        lines.append(f"  {off:#6x}  {100 * c / n:5.1f} %  {text.get(off, '?')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--perf-data", help="perf.data to read the sample IPs from (perf script)")
    p.add_argument("--ips", help="a file of sample IPs instead (perf script -F ip > FILE)")
    p.add_argument("--map", required=True, help="/tmp/perf-<pid>.map (KT_JIT_PERF_MAP=1)")
    p.add_argument("--dump", help="the KT_JIT_DUMP directory (<kernel>.bin) for disassembly")
    p.add_argument("--kernel", help="the kernel to break down (default: the most sampled)")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    if bool(args.perf_data) == bool(args.ips):
        raise SystemExit("give one of --perf-data or --ips")
    if args.ips:
        with open(args.ips) as f:
            ips = parse_ips(f.read())
    else:
        res = subprocess.run(
            ["perf", "script", "-i", args.perf_data, "-F", "ip"],
            capture_output=True,
            text=True,
        )
        if res.returncode != 0:
            raise SystemExit(f"perf script failed: {res.stderr.strip()}")
        ips = parse_ips(res.stdout)
    with open(args.map) as f:
        kernels = parse_perf_map(f.read())
    if not kernels:
        raise SystemExit(f"{args.map}: no kernels (was KT_JIT_PERF_MAP=1 set?)")
    per_kernel, offsets, outside = attribute(ips, kernels)
    if not per_kernel:
        raise SystemExit("no sample fell in a generated kernel")
    kernel = args.kernel or max(per_kernel, key=per_kernel.get)
    if kernel not in {k[2] for k in kernels}:
        raise SystemExit(f"--kernel {kernel!r} is not in {args.map}")
    insns = None
    if args.dump:
        path = os.path.join(args.dump, kernel + ".bin")
        if not os.path.exists(path):
            raise SystemExit(f"{path} is missing (was KT_JIT_DUMP set to {args.dump}?)")
        insns = disassemble(path)
    print(report(per_kernel, offsets, outside, insns, kernel, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
