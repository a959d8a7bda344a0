#!/usr/bin/env python3
"""Repeats a `kt-jit bench` command in fresh processes and reports per-token-count medians.

On a shared VM both kt-jit's and a peer's times move by up to ±25 % between processes (a
neighbour's load comes and goes over minutes), so one same-run ratio says little. This runs the
same bench command R times, one process after the other, and prints every round's kt-jit time,
peer times and speed-ups with the median over the rounds (of the ratios themselves, not a ratio
of medians), plus each round's read probe so a slowed process shows, each round's roof% (against
that round's own measured limits) with its median, and for bandwidth-bound rows each round's
"% of adjacent read probes" (the bench's paired reps) with their median.

    python tools/bench_rounds.py --rounds 3 [--json OUT.json] -- \\
        --method LLAMAFILE --gguf-type Q6_K --tokens 1,64,1024 --llamacpp-peer
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List

#: peers whose per-row times the bench writes as <name>_us and speedup_vs_<name>
PEERS = ("llamacpp", "ktkernel", "torch")


def summarize(docs: List[Dict]) -> Dict:
    """Per token count: each round's kt-jit µs and, per peer, its µs and speed-up, with medians.
    `docs` are the bench's --json documents, one per round."""
    by_t: Dict[int, Dict] = {}
    for i, doc in enumerate(docs):
        for r in doc.get("results", []):
            t = int(r["tokens"])
            row = by_t.setdefault(
                t,
                {
                    "tokens": t,
                    "ktjit_us": [None] * len(docs),
                    "roof_pct": [None] * len(docs),
                    "paired_pct": [None] * len(docs),
                    "peers": {},
                },
            )
            row["ktjit_us"][i] = r.get("us")
            row["roof_pct"][i] = r.get("roof_pct")
            row["paired_pct"][i] = r.get("paired_roof_pct")
            for p in PEERS:
                if f"speedup_vs_{p}" not in r:
                    continue
                pr = row["peers"].setdefault(
                    p, {"us": [None] * len(docs), "speedup": [None] * len(docs)}
                )
                pr["us"][i] = r.get(f"{p}_us")
                pr["speedup"][i] = r[f"speedup_vs_{p}"]

    def med(v):
        v = [x for x in v if x is not None]
        return statistics.median(v) if v else None

    rows = []
    for t in sorted(by_t):
        row = by_t[t]
        row["ktjit_us_median"] = med(row["ktjit_us"])
        row["roof_pct_median"] = med(row["roof_pct"])
        row["paired_pct_median"] = med(row["paired_pct"])
        for pr in row["peers"].values():
            pr["us_median"] = med(pr["us"])
            pr["speedup_median"] = med(pr["speedup"])
        rows.append(row)
    probes = [doc.get("limits", {}).get("read_gbs_1t") for doc in docs]
    return {"rounds": len(docs), "read_gbs_1t": probes, "rows": rows}


def _fmt(v, unit=""):
    if v is None:
        return "-"
    return f"{v:.2f}x" if unit == "x" else f"{v:,.0f}"


def render(summary: Dict) -> str:
    lines = [
        "read probe per round (GB/s, 1 thread): "
        + ", ".join("-" if p is None else f"{p:.2f}" for p in summary["read_gbs_1t"])
    ]
    for row in summary["rows"]:
        t = row["tokens"]
        lines.append(
            f"T={t:5d}: kt-jit µs {' / '.join(_fmt(v) for v in row['ktjit_us'])}"
            f" (median {_fmt(row['ktjit_us_median'])})"
        )
        if row.get("roof_pct_median") is not None:
            per_round = " / ".join("-" if v is None else f"{v:.1f}" for v in row["roof_pct"])
            lines.append(f"         roof% {per_round} (median {row['roof_pct_median']:.1f})")
        if row.get("paired_pct_median") is not None:
            lines.append(
                f"         % of adjacent read probes "
                f"{' / '.join('-' if v is None else f'{v:.1f}' for v in row['paired_pct'])}"
                f" (median {row['paired_pct_median']:.1f})"
            )
        for name, pr in row["peers"].items():
            lines.append(
                f"         {name} µs {' / '.join(_fmt(v) for v in pr['us'])}; kt-jit speed-up "
                f"{' / '.join(_fmt(v, 'x') for v in pr['speedup'])} "
                f"(median {_fmt(pr['speedup_median'], 'x')})"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="bench processes to run (default 3)")
    ap.add_argument("--json", help="write the per-round values and medians here")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then the bench's arguments")
    args = ap.parse_args(argv)
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if "--json" in bench_args:
        ap.error("the bench's --json is set per round by this script")
    docs = []
    with tempfile.TemporaryDirectory(prefix="ktjit-rounds-") as tmp:
        for i in range(args.rounds):
            path = os.path.join(tmp, f"round{i}.json")
            cmd = [sys.executable, "-m", "kt_jit.bench", *bench_args, "--json", path]
            print(f"== round {i + 1}/{args.rounds}: {' '.join(cmd[1:])}", flush=True)
            proc = subprocess.run(cmd)
            if proc.returncode != 0 or not os.path.isfile(path):
                print(f"round {i + 1} failed (exit {proc.returncode})", file=sys.stderr)
                return proc.returncode or 1
            with open(path) as f:
                docs.append(json.load(f))
    summary = summarize(docs)
    print(render(summary), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(summary, command=bench_args), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
