"""tools/bench_rounds.py: the per-round medians on canned bench documents, and one real round
through the bench (tiny, no peer; nothing is timed against a bar)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "bench_rounds.py")


def _tool():
    spec = importlib.util.spec_from_file_location("bench_rounds", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _doc(probe, rows):
    return {"limits": {"read_gbs_1t": probe}, "results": rows}


def test_medians_of_ratios_per_token_count():
    br = _tool()
    docs = [
        _doc(14.0, [{"tokens": 1024, "us": 600.0, "llamacpp_us": 1800.0, "speedup_vs_llamacpp": 3.0,
                     "roof_pct": 70.0},
                    {"tokens": 1, "us": 3.0, "paired_roof_pct": 91.0}]),
        _doc(12.0, [{"tokens": 1024, "us": 800.0, "llamacpp_us": 1600.0, "speedup_vs_llamacpp": 2.0,
                     "roof_pct": 60.0}]),
        _doc(15.0, [{"tokens": 1024, "us": 500.0, "llamacpp_us": 1250.0, "speedup_vs_llamacpp": 2.5,
                     "roof_pct": 80.0},
                    {"tokens": 1, "us": 5.0, "paired_roof_pct": 85.0}]),
    ]  # fmt: skip
    s = br.summarize(docs)
    assert s["rounds"] == 3 and s["read_gbs_1t"] == [14.0, 12.0, 15.0]
    by_t = {r["tokens"]: r for r in s["rows"]}
    assert list(by_t) == [1, 1024]
    r = by_t[1024]
    assert r["ktjit_us"] == [600.0, 800.0, 500.0] and r["ktjit_us_median"] == 600.0
    p = r["peers"]["llamacpp"]
    # the median of the ratios (2.5), not the ratio of the medians (1600 / 600 = 2.67)
    assert p["speedup"] == [3.0, 2.0, 2.5] and p["speedup_median"] == 2.5
    assert p["us_median"] == 1600.0
    # a token count missing from a round stays missing there, the median over the others
    assert by_t[1]["ktjit_us"] == [3.0, None, 5.0] and by_t[1]["ktjit_us_median"] == 4.0
    assert by_t[1]["peers"] == {}
    # the paired-probe roof% per round (bandwidth-bound rows only) and its median
    assert by_t[1]["paired_pct"] == [91.0, None, 85.0] and by_t[1]["paired_pct_median"] == 88.0
    assert by_t[1024]["paired_pct_median"] is None
    # each round's roof% (its own limits) and the median of those
    assert by_t[1024]["roof_pct"] == [70.0, 60.0, 80.0] and by_t[1024]["roof_pct_median"] == 70.0
    assert by_t[1]["roof_pct_median"] is None
    text = br.render(s)
    assert "roof% 70.0 / 60.0 / 80.0 (median 70.0)" in text
    assert "median 2.50x" in text and "3.00x / 2.00x / 2.50x" in text
    assert "% of adjacent read probes 91.0 / - / 85.0 (median 88.0)" in text
    assert text.count("adjacent read probes") == 1


def test_one_real_round(tmp_path):
    out = tmp_path / "rounds.json"
    args = [sys.executable, TOOL, "--rounds", "1", "--json", str(out), "--"]
    args += ["--method", "AMXINT8", "--tokens", "1", "--layers", "1", "--reps", "1"]
    args += ["--warmup", "1", "--shape", "qwen3"]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    s = json.loads(out.read_text())
    assert s["rounds"] == 1 and s["rows"][0]["tokens"] == 1
    assert s["rows"][0]["ktjit_us"][0] > 0
    assert "T=    1: kt-jit µs" in proc.stdout
    # T = 1 is bandwidth-bound: the bench paired reps with read probes (a ratio, never a bar)
    assert s["rows"][0]["paired_pct"][0] > 0
    assert "of the adjacent read probes" in proc.stdout


def test_refuses_its_own_json_flag():
    proc = subprocess.run(
        [sys.executable, TOOL, "--rounds", "1", "--", "--json", "x.json"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "--json" in proc.stderr
