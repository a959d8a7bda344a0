"""The one-build promise: the compiled extension is baseline x86-64; every AVX/AVX-512
instruction comes from a generator at run time."""

import platform
import re
import shutil
import subprocess

import pytest

from kt_jit import _core

# Any VEX/EVEX-only register (ymm, zmm, opmask) or a VEX-encoded mnemonic (v-prefixed SIMD op).
WIDE_REG = re.compile(r"%(ymm|zmm)\d+|%k[0-7]\b")
VEX_MNEMONIC = re.compile(r"^\s*[0-9a-f]+:\s+(v[a-z0-9]+)\s", re.M)
ALLOWED_V = {"verr", "verw"}  # not vector instructions


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 build check")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) is not installed")
def test_extension_has_no_vector_isa_instructions():
    text = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", _core.__file__],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert len(text) > 100_000, "disassembly unexpectedly small"
    wide = [line for line in text.splitlines() if WIDE_REG.search(line)]
    assert not wide, f"{len(wide)} instructions use ymm/zmm/k registers, e.g. {wide[:3]}"
    vex = sorted({m for m in VEX_MNEMONIC.findall(text) if m not in ALLOWED_V})
    assert not vex, f"VEX/EVEX-encoded mnemonics in the extension: {vex[:10]}"


def test_generated_kernels_do_use_the_selected_isa():
    """The other half of the promise: the kernels themselves are wide where the CPU is."""
    isa = _core.isa()
    if isa == "ref":
        pytest.skip("this CPU selects the reference path; nothing is generated")
    kernels = _core.dump_kernels("AMXINT8", 8, 2, 256, 128, isa)
    assert kernels and all(k["size"] > 0 for k in kernels)
    names = [k["name"] for k in kernels]
    if isa == "amx":
        # AMX tiles for the prefill blocks of >= 16 rows; decode and row tails at avx512_bf16.
        assert any("amx" in n for n in names), names
        assert all("amx" in n or "avx512bf16" in n for n in names), names
    else:
        assert all(isa.replace("_", "") in n for n in names), names
