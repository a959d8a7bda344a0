"""``kt-jit-dump --isa neon``: the AArch64 (asmjit a64) kernels generate on any host and print as
AArch64 code. Needs an AArch64 objdump (binutils-aarch64-linux-gnu; tools/setup.sh installs it)
for the disassembly checks; the generation checks run without it."""

from __future__ import annotations

import pytest
from kt_jit import dump

SHAPE = ["--experts", "8", "--top-k", "2", "--hidden", "128", "--intermediate", "80"]
needs_objdump = pytest.mark.skipif(
    dump.a64_objdump() is None,
    reason="no AArch64 objdump (apt-get install binutils-aarch64-linux-gnu; tools/setup.sh does)",
)


@needs_objdump
@pytest.mark.parametrize(
    "isa,method,mnemonic",
    [
        ("neon_dotprod", "AMXINT8", "sdot"),  # dot-product level
        ("neon", "AMXINT8", "smull2"),  # widening path without dotprod
        ("neon_bf16", "AMXINT4", "sdot"),
        ("neon", "BF16", "shl"),  # bf16 k pairs -> fp32 (shl #16, bic), then fmla
        ("neon_bf16", "BF16", "bfdot"),  # the pair tier: bfdot on bf16 activations
        ("neon", "FP8", "fcvtl2"),  # e4m3 -> fp16 bits (sshll #7, bic) -> fp32, group sums
        ("neon_bf16", "MXFP4", "tbl"),  # nibble -> 2 * e2m1 byte, then scvtf #25
        ("neon", "MXFP8", "fcvtl2"),  # the fp8 route, times the group's 2^(e - 127)
    ],
)
def test_dump_prints_aarch64_kernels(capsys, isa, method, mnemonic):
    assert dump.main(["--isa", isa, "--method", method] + SHAPE) == 0
    out = capsys.readouterr().out
    tag = {"neon": "neon", "neon_dotprod": "neondot", "neon_bf16": "neonbf16"}[isa]
    assert f"isa={isa}" in out
    fmt = {"BF16": "bf16", "AMXINT8": "int8", "AMXINT4": "int4", "FP8": "fp8"}.get(
        method, method.lower()
    )
    assert f"== gemm_decode_{fmt}_{tag}_m1n16_siluup" in out
    assert f"\t{mnemonic}\t" in out, out[:2000]
    assert "\tret" in out
    # AArch64, not x86: no x86 register names in the disassembly
    assert "zmm" not in out and "rsp" not in out
    if method == "BF16":
        assert "\tfmla\tv" in out  # decode keeps fp32 activations
        assert "\tbic\tv" in out


def test_dump_generates_without_disassembly(capsys):
    assert dump.main(["--isa", "neon", "--method", "MOE_INT8", "--no-disasm"] + SHAPE) == 0
    out = capsys.readouterr().out
    assert "gemm_prefill_int8_neon_m4n16_accum" in out  # plain neon: 4-row widening tiles


def test_dump_neon_generates_every_format(capsys):
    for method in ("MXFP4", "MXFP8", "FP8", "BF16", "AMXINT4"):
        assert dump.main(["--isa", "neon_dotprod", "--method", method, "--no-disasm"] + SHAPE) == 0
    out = capsys.readouterr().out
    assert "gemm_prefill_mxfp4_neondot_m4n16_siluup" in out  # 4-row mx tiles


def test_dump_neon_without_disassembler_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setattr(dump, "a64_objdump", lambda: None)
    assert dump.main(["--isa", "neon", "--method", "AMXINT8"] + SHAPE) == 1
    err = capsys.readouterr().err
    assert "AArch64" in err and "binutils-aarch64-linux-gnu" in err
