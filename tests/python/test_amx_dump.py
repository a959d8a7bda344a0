"""AMX from Python on any x86 machine: ``kt-jit-dump --isa amx`` generates and prints the AMX
kernels (tile instructions in objdump's listing), and ``KT_JIT_ISA=amx`` is refused, naming the
missing features, where the CPU cannot run it. Execution is verified in C++ (tests/cpp/test_amx.cpp).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from kt_jit import _core

x86_only = pytest.mark.skipif(
    _core.cpu_features().get("aarch64", False), reason="AMX is an x86-64 extension"
)


@x86_only
def test_dump_kernels_amx_lists_amx_and_avx512bf16_kernels():
    ks = _core.dump_kernels("AMXINT8", 8, 2, 256, 80, "amx")
    names = [k["name"] for k in ks]
    amx = [n for n in names if "_amx_" in n]
    # gate/up (full + tail strip) and down (H = 256: no tail): 16-row AMX prefill tiles
    assert sorted(amx) == [
        "gemm_prefill_int8_amx_m16n32_siluup",
        "gemm_prefill_int8_amx_m16n64_accum",
        "gemm_prefill_int8_amx_m16n64_siluup",
    ]
    # decode and the remainder rows run the avx512_bf16 kernels
    assert any(n.startswith("gemm_decode_int8_avx512bf16_m1") for n in names)
    for k in ks:
        assert len(bytes(k["code"])) == int(k["size"]) > 100


@x86_only
def test_dump_kernels_amx_bf16_uses_tdpbf16ps_tiles():
    names = [k["name"] for k in _core.dump_kernels("BF16", 8, 2, 256, 80, "amx")]
    assert sorted(n for n in names if "_amx_" in n) == [
        "gemm_prefill_bf16_amx_m16n32_siluup",
        "gemm_prefill_bf16_amx_m16n64_accum",
        "gemm_prefill_bf16_amx_m16n64_siluup",
    ]
    assert any(n.startswith("gemm_decode_bf16_avx512bf16_m1") for n in names)


@x86_only
def test_dump_kernels_amx_decoded_formats_get_amx_tiles():
    # int4 (AMX-INT8 over the strip decoded to int8), fp8 and mx (AMX-BF16 over bf16 pairs)
    for method, fmt in (
        ("AMXINT4", "int4"),
        ("FP8", "fp8"),
        ("MXFP4", "mxfp4"),
        ("MXFP8", "mxfp8"),
    ):
        names = [k["name"] for k in _core.dump_kernels(method, 8, 2, 256, 96, "amx")]
        # I = 96: three whole gate/up strips (32 of gate, 32 of up), down (H = 256) no tail
        assert sorted(n for n in names if "_amx_" in n) == [
            f"gemm_prefill_{fmt}_amx_m16n64_accum",
            f"gemm_prefill_{fmt}_amx_m16n64_siluup",
        ], (method, names)
        assert any(n.startswith(f"gemm_decode_{fmt}_avx512bf16_m1") for n in names)


@x86_only
def test_dump_kernels_amx_k_group_formats_have_no_amx_kernels():
    # their per-group fold would cost more than AMX saves (docs/ARCHITECTURE.md "AMX")
    for method in ("RAWINT4", "GPTQ_INT4"):
        names = [k["name"] for k in _core.dump_kernels(method, 8, 2, 256, 128, "amx")]
        assert names and not any("_amx_" in n for n in names), (method, names)


@x86_only
@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) not installed")
def test_kt_jit_dump_cli_prints_tile_instructions(tmp_path):
    env = dict(os.environ)
    env.pop("KT_JIT_ISA", None)
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "kt_jit.dump",
            "--isa",
            "amx",
            "--hidden",
            "256",
            "--intermediate",
            "80",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        check=False,
        text=True,
        env=env,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "isa=amx" in out
    assert "== gemm_prefill_int8_amx_m16n64_siluup" in out
    for mnemonic in ("ldtilecfg", "tileloadd", "tdpbusd", "tilestored", "tilerelease"):
        assert mnemonic in out, mnemonic
    # the code (up to its ret; the constant pool follows) disassembles cleanly
    listing = out.split("== gemm_prefill_int8_amx_m16n64_siluup")[1].split("\n==")[0]
    code = listing.split("\tret")[0]
    assert "\tret" in listing and "(bad)" not in code
    assert (tmp_path / "gemm_prefill_int8_amx_m16n64_siluup.bin").stat().st_size > 100


@x86_only
@pytest.mark.skipif(_core.detected_isa() == "amx", reason="this CPU runs AMX")
def test_kt_jit_isa_amx_refused_with_missing_features():
    env = dict(os.environ)
    env["KT_JIT_ISA"] = "amx"
    p = subprocess.run(
        [sys.executable, "-c", "from kt_jit import _core; print(_core.isa())"],
        capture_output=True,
        check=False,
        text=True,
        env=env,
        timeout=120,
    )
    assert p.returncode != 0
    err = p.stderr
    assert "KT_JIT_ISA=amx" in err
    feats = _core.cpu_features()
    if not feats.get("amx_tile"):
        assert "amx_tile (CPUID)" in err
    if not feats.get("os_amx"):
        assert "XCR0" in err
    assert "the best available level is " + _core.detected_isa() in err


@x86_only
@pytest.mark.skipif(_core.detected_isa() != "amx", reason="needs a CPU with usable AMX")
def test_amx_layer_matches_reference_on_amx_hardware():
    from kt_jit.cli import _self_test

    assert _self_test("amx", "AMXINT8") == ""


@x86_only
@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) not installed")
def test_kt_jit_dump_cli_prints_bf16_tile_instructions(tmp_path):
    env = dict(os.environ)
    env.pop("KT_JIT_ISA", None)
    p = subprocess.run(
        [sys.executable, "-m", "kt_jit.dump", "--isa", "amx", "--method", "BF16"]
        + ["--hidden", "256", "--intermediate", "80", "--out", str(tmp_path)],
        capture_output=True,
        check=False,
        text=True,
        env=env,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    listing = p.stdout.split("== gemm_prefill_bf16_amx_m16n64_siluup")[1].split("\n==")[0]
    for mnemonic in ("ldtilecfg", "tileloadd", "tdpbf16ps", "tilerelease"):
        assert mnemonic in listing, mnemonic
    # x86 bf16 strips are k pairs: the B tiles load straight from the strip, no re-lay first
    assert "vpmovzxwd" not in listing
    assert "(bad)" not in listing.split("\tret")[0]
