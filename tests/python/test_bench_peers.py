"""`kt-jit bench`'s peer plumbing (kt-kernel, oneDNN, llama.cpp) on canned peer output: JSON
parsing, the ratios and the issue #5 item 4 / issue #4 checks. No peer is installed or run and
nothing is timed."""

from __future__ import annotations

import json
import math

import pytest

from kt_jit import bench

H, I, E, K = 2048, 768, 128, 8


def ktjit_rows():
    """kt-jit rows as bench.main builds them (only the keys the peer code reads)."""
    rows = []
    for t, us, touched in ((1, 3000.0, 8), (64, 60000.0, 128), (1024, 200000.0, 128)):
        wbytes = touched * 3 * H * I  # int8
        ops = 2.0 * t * K * 3 * H * I
        rows.append(
            {
                "tokens": t,
                "us": us,
                "experts_touched": touched,
                "weight_bytes": wbytes,
                "weight_gbs": wbytes / us / 1e3,
                "gops": ops / us / 1e3,
                "tokens_per_s": t / us * 1e6,
                "roof_pct": 90.0,
                "bound": "bandwidth",
            }
        )
    return rows


KTK_STDOUT = "\n".join(
    [
        "CPUInfer[0x55]: Hello",
        "WorkerPool[0x56] 1 subpools, [numa:threads][0:1]",
        json.dumps(
            {
                "peer": "kt-kernel",
                "version": "0.7.2",
                "variant": "avx512_vnni",
                "method": "AMXINT8",
                "class": "AMXInt8_MOE",
                "threads": 1,
                "layers": 4,
                "same_routing_as_ktjit": True,
                "error_rel_l1": 0.027,
                "results": [
                    {"tokens": 1, "us": 6000.0, "weight_gbs": 6.3},
                    {"tokens": 64, "us": 30000.0, "weight_gbs": 40.0},
                    {"tokens": 1024, "us": 400000.0, "weight_gbs": 1.5},
                ],
            }
        ),
        "CPUInfer[0x55]: Goodbye",
    ]
)


def onednn_doc(us_m1_gu=150.0, us_m1_dn=160.0, us_m64=(500.0, 520.0), us_m256=None):
    rows = []

    def add(n, k, m, us):
        wb = n * k
        rows.append(
            {
                "dtype": "int8",
                "n": n,
                "k": k,
                "m": m,
                "us": us,
                "weight_bytes": wb,
                "weight_gbs": wb / us / 1e3,
                "gops": 2.0 * m * n * k / us / 1e3,
                "impl": "brg:avx512_core_vnni",
                "weights_format": "BA16a64b4a",
            }
        )

    add(I, H, 1, us_m1_gu)
    add(H, I, 1, us_m1_dn)
    add(I, H, 64, us_m64[0])
    add(H, I, 64, us_m64[1])
    if us_m256:
        add(I, H, 256, us_m256[0])
        add(H, I, 256, us_m256[1])
    add(H, I, 16, 300.0)  # no matching gate/up row: must not form an expert
    return {
        "peer": "oneDNN",
        "version": "2.6.3",
        "effective_isa": "avx512_core_vnni",
        "results": rows,
    }


def test_parse_peer_json_skips_library_chatter():
    doc = bench.parse_peer_json(KTK_STDOUT)
    assert doc["peer"] == "kt-kernel"
    assert [r["tokens"] for r in doc["results"]] == [1, 64, 1024]
    # oneDNN: verbose lines before, pretty-printed JSON over several lines
    text = "onednn_verbose,info,cpu,isa:Intel AVX-512 with Intel DL Boost\n" + json.dumps(
        onednn_doc(), indent=1
    ).replace('{\n "peer"', '{"peer"', 1)
    assert bench.parse_peer_json(text)["version"] == "2.6.3"
    with pytest.raises(ValueError):
        bench.parse_peer_json("CPUInfer: Hello\nTraceback (most recent call last):\n")


def test_ktkernel_ratios():
    rows = ktjit_rows()
    pairs = bench.ktkernel_ratios(rows, bench.parse_peer_json(KTK_STDOUT))
    assert [p["tokens"] for p in pairs] == [1, 64, 1024]
    assert pairs[0]["speedup"] == pytest.approx(2.0)  # 6000 / 3000
    assert pairs[1]["speedup"] == pytest.approx(0.5)  # kt-kernel faster at T = 64
    assert rows[2]["speedup_vs_ktkernel"] == pytest.approx(2.0)
    assert rows[2]["ktkernel_us"] == 400000.0
    table = bench._markdown_table(rows)
    assert "vs kt-kernel" in table and "0.50x" in table


def test_ktkernel_ratios_missing_rows():
    rows = ktjit_rows()
    doc = {"peer": "kt-kernel", "results": [{"tokens": 64, "us": 120000.0}]}
    pairs = bench.ktkernel_ratios(rows, doc)
    assert [p["tokens"] for p in pairs] == [64]
    assert "ktkernel_us" not in rows[0]
    acc = bench.peer_acceptance(pairs, None, "int8", E, K)
    assert [a["ok"] for a in acc] == [None, None]  # neither T = 1 nor T = 1024 measured


def test_onednn_expert_combines_gate_up_and_down():
    ex = bench.onednn_expert(onednn_doc(), H, I, "int8")
    assert sorted(ex) == [1, 64]  # M = 16 lacks its gate/up row
    us = 2 * 150.0 + 160.0
    assert ex[1]["us"] == pytest.approx(us)
    assert ex[1]["weight_gbs"] == pytest.approx(3 * H * I / us / 1e3)
    assert ex[64]["gops"] == pytest.approx(2.0 * 64 * 3 * H * I / (2 * 500.0 + 520.0) / 1e3)
    assert bench.onednn_expert(onednn_doc(), H, I, "bf16") == {}


def test_onednn_ratios_match_rows_per_expert():
    rows = ktjit_rows()
    ex = bench.onednn_expert(onednn_doc(), H, I, "int8")
    pairs = bench.onednn_ratios(rows, ex, K)
    # T = 1: 8 rows over 8 experts -> M = 1; T = 1024: 8192 / 128 = 64 -> M = 64; T = 64: M = 4,
    # no oneDNN row within 1.25x.
    assert [(p["tokens"], p["m"]) for p in pairs] == [(1, 1), (1024, 64)]
    p1 = pairs[0]
    # bandwidth ratio at M = 1 = oneDNN's expert time x experts touched / kt-jit's time
    assert p1["bw_ratio"] == pytest.approx((2 * 150.0 + 160.0) * 8 / 3000.0)
    assert p1["ratio"] == p1["bw_ratio"]
    p64 = pairs[1]
    assert p64["ratio"] == p64["gops_ratio"]
    assert p64["gops_ratio"] == pytest.approx(rows[2]["gops"] / ex[64]["gops"])
    assert "| 1024 | 64.0 | 64 |" in bench._onednn_table(pairs)


def test_acceptance_flags_pass_and_fail():
    rows = ktjit_rows()
    ktk = bench.ktkernel_ratios(rows, bench.parse_peer_json(KTK_STDOUT))
    # kt-jit's T = 1 is 3000 µs for 8 experts; oneDNN's expert 460 µs -> 1.23x: int8 target met
    ex = bench.onednn_expert(onednn_doc(), H, I, "int8")
    acc = bench.peer_acceptance(ktk, bench.onednn_ratios(rows, ex, K), "int8", E, K)
    by = {a["check"].split(" (")[0]: a for a in acc}
    assert by["faster than kt-kernel at T = 1"]["ok"] is True
    assert by["faster than kt-kernel at T = 1024"]["ok"] is True
    m1 = by[">= 1.15x oneDNN's int8 weight bandwidth at M = 1"]
    assert m1["ok"] is True and m1["value"] == pytest.approx(460.0 * 8 / 3000.0)
    m256 = [a for a in acc if "M = 256" in a["check"]][0]
    assert m256["ok"] is None and "T ~ 4096" in m256["check"]
    # The same rows against bf16's 1.5x target, and a faster oneDNN: both fail.
    ex = bench.onednn_expert(onednn_doc(us_m1_gu=100.0, us_m1_dn=100.0), H, I, "int8")
    acc = bench.peer_acceptance(ktk, bench.onednn_ratios(rows, ex, K), "bf16", E, K)
    m1 = [a for a in acc if "M = 1 " in a["check"]][0]
    assert m1["target"] == 1.5 and m1["ok"] is False
    lines = bench._acceptance_lines(acc)
    assert any("NOT met" in line for line in lines)
    assert any("not measured" in line for line in lines)


def test_acceptance_m256_uses_matching_row():
    rows = ktjit_rows()
    t = 4096
    us = 800000.0
    ops = 2.0 * t * K * 3 * H * I
    rows.append(
        {
            "tokens": t,
            "us": us,
            "experts_touched": 128,
            "weight_gbs": 128 * 3 * H * I / us / 1e3,
            "gops": ops / us / 1e3,
        }
    )
    # oneDNN expert at M = 256 takes (2 * 2000 + 2100) µs -> 128 experts 780.8 ms, kt-jit 800 ms:
    # 0.976x, within 5 %
    doc = onednn_doc(us_m256=(2000.0, 2100.0))
    pairs = bench.onednn_ratios(rows, bench.onednn_expert(doc, H, I, "int8"), K)
    acc = bench.peer_acceptance(None, pairs, "int8", E, K)
    assert len(acc) == 2  # no kt-kernel checks without the kt-kernel peer
    m256 = acc[1]
    assert "T = 4096" in m256["check"]
    assert m256["value"] == pytest.approx(128 * 6100.0 / us)
    assert m256["ok"] is True
    assert not math.isnan(m256["value"])


def test_peers_markdown_reports_skips():
    peers = {
        "ktkernel": {"skipped": "/opt/ktk-venv/bin/python not found"},
        "onednn": {"skipped": "oneDNN not installed"},
    }
    md = "\n".join(bench._peers_markdown(peers, [], "int8", H, I))
    assert "kt-kernel: skipped (/opt/ktk-venv/bin/python not found)" in md
    assert "oneDNN: skipped (oneDNN not installed)" in md
    assert bench._peers_markdown({}, [], None, H, I) == []


# tools/peers/ggml_bench.cpp's document: a line of ggml's own chatter before it.
GGML_STDOUT = (
    "repack: repack tensor  with q4_K_8x8\n"
    + json.dumps(
        {
            "peer": "ggml",
            "ggml_version": "0.25.3",
            "ggml_commit": "0c1e570",
            "gu_type": "Q4_K",
            "down_type": "Q6_K",
            "gu_buffer": "CPU_REPACK",
            "down_buffer": "CPU",
            "threads": 1,
            "layers": 4,
            "rel_l1_vs_f64": 0.015,
            "results": [
                {"tokens": 1, "us": 3300.0, "experts_touched": 8},
                {"tokens": 1024, "us": 500000.0, "experts_touched": 128},
            ],
        }
    )
    + "\n"
)


def test_llamacpp_ratios_table_and_issue4_check():
    rows = ktjit_rows()
    doc = bench.parse_peer_json(GGML_STDOUT)
    pairs = bench.llamacpp_ratios(rows, doc)
    assert [p["tokens"] for p in pairs] == [1, 1024]  # the peer ran no T = 64
    assert pairs[0]["speedup"] == pytest.approx(1.1)  # 3300 / 3000
    assert rows[2]["speedup_vs_llamacpp"] == pytest.approx(2.5)  # 500000 / 200000
    assert "llamacpp_us" not in rows[1]
    table = bench._markdown_table(rows)
    assert "vs llama.cpp" in table and "2.50x" in table and "| - | - |" in table
    (acc,) = bench.llamacpp_acceptance(pairs)
    assert acc["ok"] is False and acc["value"] == pytest.approx(2.5)  # under the 3x target
    (acc,) = bench.llamacpp_acceptance(pairs[:1])
    assert acc["ok"] is None  # no T = 1024 row
    md = "\n".join(bench._peers_markdown({"llamacpp": dict(doc, pairs=pairs)}, [], None, H, I))
    assert "Q4_K gate/up in CPU_REPACK, Q6_K down in CPU" in md and "0.015" in md
    md = "\n".join(bench._peers_markdown({"llamacpp": {"skipped": "no ggml"}}, [], None, H, I))
    assert "llama.cpp: skipped (no ggml)" in md


def test_int16_lane_kernels_take_the_vpmaddubsw_vpaddw_roof():
    # Kernels that add vpmaddubsw pair sums in int16 lanes are measured against that pair's peak
    # only when every kernel of the layer does (bench.main checks all names).
    int16 = [
        "gemm_prefill_qg4bu0iws_avx2_m2n32_siluup",
        "gemm_prefill_qg8fs_avx2_m2n32_accum",
        "gemm_prefill_int4_avx2_m2n32_siluup",
        "gemm_decode_int4_avx512_m1n64_accum",
        "gemm_prefill_qg8bu0wls_avx2_m4n32_siluup_halves",  # Q5_K's int16-lane folds
    ]
    chain = [
        "gemm_prefill_qg8bu0s_avx2_m2n32_siluup",  # Q5_K without the folds: int32 sums
        "gemm_prefill_int8_avx2_m3n32_siluup",
        "gemm_decode_int4_avx512vnni_m1n64_accum",
        "gemm_prefill_int4_avx512bf16_m6n64_siluup",
        "gemm_prefill_qg8u32s_avx2_m2n32_store",
    ]
    assert all(bench._INT16_SUMS.search(n) for n in int16)
    assert not any(bench._INT16_SUMS.search(n) for n in chain)
    assert "AMXINT4" in bench.INT4_METHODS and "MOE_INT4" in bench.INT4_METHODS
