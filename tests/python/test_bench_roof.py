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
        ("avx512_vnni", "MXFP8", X86, "vfmadd231ps"),
        ("avx512_bf16", "MXFP4", X86, "vdpbf16ps"),
        ("amx", "MXFP8", X86, "tdpbf16ps"),
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


class _FakeCore:
    """Stands in for _core: a canned all-threads peak, and the calls it got."""

    def __init__(self, value):
        self.value, self.calls = value, []

    def measure_peak_threads(self, key, threads):
        self.calls.append((key, threads))
        return self.value


def test_threads_peak_is_measured_on_all_threads_not_scaled():
    lim = dict(X86)
    one = bench._threads_peak(_FakeCore(123.0), lim, "peak_maddubsw_gops", 1)
    assert one == 400.0  # one thread: the core's own peak, nothing measured
    core = _FakeCore(410.0)  # two threads that share one core's vector units
    two = bench._threads_peak(core, lim, "peak_maddubsw_gops", 2)
    assert two == 410.0 and core.calls == [("peak_maddubsw_gops", 2)]
    assert lim["peak_maddubsw_gops_2t"] == 410.0  # kept with the limits (the JSON's "limits")
    # asked again for the same peak (the int16-lane roof re-picks it): not measured twice
    assert bench._threads_peak(core, lim, "peak_maddubsw_gops", 2) == 410.0
    assert len(core.calls) == 1
    # an op this machine lacks stays 0 without a measurement
    assert bench._threads_peak(core, dict(X86, peak_vnni_gops=0.0), "peak_vnni_gops", 2) == 0.0


def test_measure_peak_threads_binding():
    _core = pytest.importorskip("kt_jit._core")
    if _core.isa() not in ("avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx"):
        pytest.skip("an x86-64 vector ISA runs the fma loop")
    assert _core.measure_peak_threads("peak_fma_gflops", 2) > 0
    with pytest.raises(ValueError, match="unknown peak"):
        _core.measure_peak_threads("peak_nope", 2)


def test_thp_mode_reads_the_bracketed_choice(tmp_path):
    """The bench's machine line names the transparent-huge-page mode the run had."""
    from kt_jit.bench import _thp_mode

    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert _thp_mode(str(f)) == "madvise"
    f.write_text("[always] madvise never\n")
    assert _thp_mode(str(f)) == "always"
    f.write_text("garbage\n")
    assert _thp_mode(str(f)) == "unavailable"
    assert _thp_mode(str(tmp_path / "missing")) == "unavailable"
