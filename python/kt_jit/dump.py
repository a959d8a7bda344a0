"""``kt-jit-dump`` / ``kt-jit dump``: generate the kernels one MoE layer needs and show them.

For every kernel: name, key, size in bytes, generation time (µs) and a disassembly (objdump when
installed, else a hex dump). ``--isa neon`` (or neon_dotprod, neon_bf16) generates the AArch64
kernels on any host and disassembles them with an AArch64 objdump (aarch64-linux-gnu-objdump, or a
multiarch objdump); without one it stops with an error unless ``--no-disasm``. ``--out DIR`` also writes ``<name>.bin`` (raw code) and ``<name>.json``
(metadata) per kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import List, Optional


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kt-jit-dump",
        description="Generate and show the JIT kernels of one kt-jit MoE layer.",
    )
    p.add_argument("--method", default="AMXINT8", help="weight method (default AMXINT8)")
    p.add_argument("--experts", type=int, default=128, help="number of experts (default 128)")
    p.add_argument("--top-k", type=int, default=8, help="experts per token (default 8)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size H (default 2048)")
    p.add_argument(
        "--intermediate", type=int, default=768, help="MoE intermediate size I (default 768)"
    )
    p.add_argument(
        "--isa", default=None, help="ISA level to generate for (default: the selected one)"
    )
    p.add_argument("--out", default=None, help="directory for <name>.bin + <name>.json per kernel")
    p.add_argument("--no-disasm", action="store_true", help="do not print the disassembly")
    return p


def safe_name(name: str) -> str:
    """A file-system safe version of a kernel name."""
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", name) or "kernel"


NEON_LEVELS = ("neon", "neon_dotprod", "neon_bf16")


def a64_objdump() -> str | None:
    """An objdump that disassembles AArch64: the cross binutils' one, or a multiarch objdump."""
    cross = shutil.which("aarch64-linux-gnu-objdump")
    if cross:
        return cross
    objdump = shutil.which("objdump")
    if objdump:
        res = subprocess.run([objdump, "--help"], capture_output=True, text=True, check=False)
        if re.search(r"supported architectures:.*\baarch64\b", res.stdout, re.DOTALL):
            return objdump
    return None


def disassemble_a64(code: bytes, objdump: str) -> str:
    """objdump's disassembly of raw AArch64 code (the constant pool shows as .inst words)."""
    fd, path = tempfile.mkstemp(suffix=".bin", prefix="kt_jit_")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(code)
        res = subprocess.run(
            [objdump, "-D", "-b", "binary", "-m", "aarch64", path],
            capture_output=True,
            text=True,
            check=False,
        )
        if res.returncode != 0:
            raise RuntimeError(f"{objdump} failed: {res.stderr.strip()}")
        lines = res.stdout.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("0000000000000000 <.data>:"):
                lines = lines[i + 1 :]
                break
        return "\n".join(lines)
    finally:
        os.unlink(path)


def disassemble(code: bytes) -> str:
    """objdump's Intel-syntax disassembly of raw x86-64 code, or a hex dump without objdump."""
    objdump = shutil.which("objdump")
    if objdump and code:
        fd, path = tempfile.mkstemp(suffix=".bin", prefix="kt_jit_")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(code)
            res = subprocess.run(
                [objdump, "-D", "-b", "binary", "-m", "i386:x86-64", "-M", "intel", path],
                capture_output=True,
                text=True,
            )
            if res.returncode == 0:
                lines = res.stdout.splitlines()
                # drop objdump's header (file name, format, section banner)
                for i, line in enumerate(lines):
                    if line.startswith("0000000000000000 <.data>:"):
                        lines = lines[i + 1 :]
                        break
                return "\n".join(lines)
        finally:
            os.unlink(path)
    return hexdump(code)


def hexdump(code: bytes) -> str:
    out = []
    for off in range(0, len(code), 16):
        chunk = code[off : off + 16]
        out.append(f"{off:08x}  {chunk.hex(' ')}")
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    from . import _core

    isa = args.isa or _core.isa()
    a64 = isa in NEON_LEVELS
    a64_dis = a64_objdump() if a64 and not args.no_disasm else None
    if a64 and not args.no_disasm and a64_dis is None:
        print(
            f"kt-jit-dump: error: --isa {isa} prints AArch64 code and needs an AArch64 "
            "disassembler: install binutils-aarch64-linux-gnu (aarch64-linux-gnu-objdump) or a "
            "multiarch objdump (binutils-multiarch), or pass --no-disasm",
            file=sys.stderr,
        )
        return 1
    try:
        kernels = _core.dump_kernels(
            args.method, args.experts, args.top_k, args.hidden, args.intermediate, isa
        )
    except Exception as e:  # report cleanly: bad isa / method / shape
        print(f"kt-jit-dump: error: {e}", file=sys.stderr)
        return 1

    if args.out:
        os.makedirs(args.out, exist_ok=True)
    print(
        f"# kt-jit {_core.__version__}: {len(kernels)} kernel(s) for method={args.method} "
        f"E={args.experts} K={args.top_k} H={args.hidden} I={args.intermediate} isa={isa}"
    )
    total = 0
    for k in kernels:
        name = str(k["name"])
        code = bytes(k["code"])
        size = int(k.get("size", len(code)))
        total += size
        gen_us = float(k.get("gen_us", 0.0))
        print(f"\n== {name}\n   key: {k['key']}\n   bytes: {size}\n   generation: {gen_us:.1f} us")
        if args.out:
            base = os.path.join(args.out, safe_name(name))
            with open(base + ".bin", "wb") as f:
                f.write(code)
            meta = {key: val for key, val in k.items() if key != "code"}
            meta.update(
                {
                    "method": args.method,
                    "isa": isa,
                    "experts": args.experts,
                    "top_k": args.top_k,
                    "hidden": args.hidden,
                    "intermediate": args.intermediate,
                    "version": _core.__version__,
                }
            )
            with open(base + ".json", "w") as f:
                json.dump(meta, f, indent=2, default=str)
                f.write("\n")
            print(f"   wrote: {base}.bin, {base}.json")
        if not args.no_disasm:
            print(disassemble_a64(code, a64_dis) if a64_dis else disassemble(code))
    print(f"\n# total: {len(kernels)} kernel(s), {total} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
