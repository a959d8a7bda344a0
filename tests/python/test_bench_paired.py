"""`kt-jit bench`'s paired read probes: the ratio of each bandwidth-bound forward rep to the probes
taken right before and after it, the table column that reports it, and the probe object itself
(that it reads and reports a rate, never how fast)."""

from __future__ import annotations

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
