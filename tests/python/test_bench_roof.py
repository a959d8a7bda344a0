"""`kt-jit bench`'s choice of the instruction peak a layer's compute roof% is measured against, per
ISA level and method (x86-64 and the AArch64 NEON levels), on canned machine limits."""

from __future__ import annotations

import pytest

from kt_jit import bench

X86 = {
    "read_gbs_1t": 20.0,
    "peak_vnni_gops": 900.0,
    "peak_maddubsw_gops": 400.0,
    "peak_maddubsw_w_gops": 600.0,
    "peak_fma_gflops": 200.0,
    "peak_bf16_gflops": 450.0,
    "peak_amx_int8_gops": 8000.0,
    "peak_amx_bf16_gflops": 4000.0,
    "peak_sdot_gops": 0.0,
    "peak_smull_gops": 0.0,
    "peak_bfdot_gflops": 0.0,
}
NEON = {
    "read_gbs_1t": 30.0,
    "peak_fma_gflops": 60.0,
    "peak_sdot_gops": 250.0,
    "peak_smull_gops": 70.0,
    "peak_bfdot_gflops": 120.0,
}
NEON_PLAIN = dict(NEON, peak_sdot_gops=0.0, peak_bfdot_gflops=0.0)


@pytest.mark.parametrize(
    "isa, method, lim, want",
    [
        ("avx2", "AMXINT8", X86, "vpmaddubsw"),
        ("avx512_vnni", "AMXINT4", X86, "vpdpbusd"),
        ("amx", "AMXINT8", X86, "tdpbusd"),
        ("amx", "BF16", X86, "tdpbf16ps"),
        ("avx512_bf16", "BF16", X86, "vdpbf16ps"),
        ("avx2", "BF16", X86, "vfmadd231ps"),
        ("avx2", "MXFP4", X86, "vfmadd231ps"),
        ("neon_bf16", "BF16", NEON, "bfdot"),
        ("neon_dotprod", "BF16", NEON, "fmla"),
        ("neon", "BF16", NEON_PLAIN, "fmla"),
        ("neon_bf16", "AMXINT8", NEON, "sdot"),
        ("neon_dotprod", "AMXINT4", NEON, "sdot"),
        ("neon", "AMXINT8", NEON_PLAIN, "smull+sadalp"),
        ("neon", "MOE_INT4", NEON_PLAIN, "smull+sadalp"),
        ("neon_bf16", "FP8", NEON, "fmla"),
    ],
)
def test_roof_peak_per_level_and_method(isa, method, lim, want):
    name, key = bench._roof_peak(isa, method, lim)
    assert name == want
    assert lim[key] > 0, f"{isa} {method}: the chosen peak {key} was not measured"


def test_limits_lines_name_the_measured_architecture():
    neon = bench._limits_lines(NEON, 30.0, 250.0, "sdot", 1)
    assert "sdot 250" in neon and "smull+sadalp 70" in neon and "bfdot 120" in neon
    assert "vpdpbusd" not in neon
    x86 = bench._limits_lines(X86, 20.0, 900.0, "vpdpbusd", 1)
    assert "vpdpbusd 900" in x86 and "tdpbusd 8" in x86
    assert "sdot" not in x86
