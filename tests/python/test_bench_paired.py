"""`kt-jit bench`'s paired read probes: the ratio of each bandwidth-bound forward rep to the probes
taken right before and after it, the table column that reports it, and the probe object itself
(that it reads and reports a rate, never how fast)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kt_jit import _core, bench


def test_paired_ratio_uses_the_probes_on_each_side():
    # 1 GB in 0.1 s = 10 GB/s per rep; rep 0 sat between probes 10 and 10, rep 1 between 10 and
    # 30 (mean 20): ratios 1.0 and 0.5, median 0.75. A start-of-run probe (10) would say 1.0.
    ratio, probe = bench._paired_ratio([0.1, 0.1], [10.0, 10.0, 30.0], 1e9)
    assert ratio == pytest.approx(0.75)
    assert probe == pytest.approx(10.0)
    # odd rep count: the middle ratio; a rep twice as slow halves its own ratio only
    ratio, probe = bench._paired_ratio([0.2, 0.1, 0.1], [10.0, 10.0, 10.0, 10.0], 1e9)
    assert ratio == pytest.approx(1.0)
    ratio, _ = bench._paired_ratio([0.2, 0.2, 0.1], [10.0, 10.0, 10.0, 10.0], 1e9)
    assert ratio == pytest.approx(0.5)


def test_paired_ratio_rejects_mismatched_or_empty_input():
    with pytest.raises(ValueError, match="one more probe"):
        bench._paired_ratio([0.1, 0.1], [10.0, 10.0], 1e9)
    with pytest.raises(ValueError, match="one more probe"):
        bench._paired_ratio([], [10.0], 1e9)
    with pytest.raises(ValueError, match="positive"):
        bench._paired_ratio([0.1], [10.0, 0.0], 1e9)


def test_table_reports_the_paired_column_only_where_measured():
    row = {
        "tokens": 1,
        "us": 20000.0,
        "tokens_per_s": 50.0,
        "experts_touched": 8,
        "weight_gbs": 11.0,
        "gops": 30.0,
        "roof_pct": 80.0,
        "bound": "bandwidth",
    }
    plain = bench._markdown_table([dict(row)])
    assert "adjacent read probes" not in plain
    paired = dict(row, paired_roof_pct=91.25, paired_read_gbs=12.0, paired_reps=15)
    big = dict(row, tokens=1024, bound="compute")
    md = bench._markdown_table([paired, big]).splitlines()
    assert md[0].endswith("| % of adjacent read probes |")
    assert md[2].endswith("| 91.2% |")  # the T = 1 row
    assert md[3].endswith("| - |")  # compute-bound: no probes


def test_read_probe_reads_its_buffer():
    p = _core.ReadProbe(1 << 20)
    assert p.bytes == 1 << 20
    rates = [p.pass_gbs() for _ in range(3)]
    assert all(r > 0 for r in rates)
    assert _core.ReadProbe(5000).bytes == 4096  # whole KiB, as the start-of-run probe
    with pytest.raises(ValueError, match="bytes must be >= 1024"):
        _core.ReadProbe(100)


def test_read_probe_on_the_pool_splits_its_buffer_over_the_threads():
    # In a process of its own: the pools are process-wide and the first init_pool wins.
    code = """
from kt_jit import _core
try:
    _core.ReadProbe(1 << 20, on_pool=True)
except ValueError as e:
    print("no pool:", e)
_core.init_pool(3, 1)
p = _core.ReadProbe(10000, on_pool=True)  # 3333 bytes a thread: 3 KiB each
print(p.threads, p.bytes, all(p.pass_gbs() > 0 for _ in range(3)))
print(_core.ReadProbe(10000).threads)
try:
    _core.ReadProbe(2000, on_pool=True)
except ValueError as e:
    print("small:", e)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("no pool:") and "init_pool" in lines[0]
    assert lines[1] == "3 9216 True"
    assert lines[2] == "1"
    assert lines[3].startswith("small:") and "3 threads" in lines[3]


def test_two_thread_bench_pairs_its_decode_reps_with_pool_probes(tmp_path):
    out = tmp_path / "b.json"
    args = [sys.executable, "-m", "kt_jit.bench", "--method", "AMXINT8", "--tokens", "1"]
    args += ["--threads", "2", "--layers", "1", "--reps", "1", "--warmup", "1"]
    args += ["--shape", "qwen3", "--json", str(out)]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    row = json.loads(out.read_text())["results"][0]
    assert row["bound"] == "bandwidth"
    assert row["paired_reps"] == bench.PAIRED_REPS and row["paired_roof_pct"] > 0
    assert "of the adjacent read probes" in proc.stdout
