"""The PASS / FAIL bookkeeping of the emulated smoke tests (haswell_smoke.py, aarch64_smoke.py):
one line per check, a summary line, and the exit status the run scripts count."""

from __future__ import annotations

import sys
import time
import traceback
from typing import Callable

counts = {"passed": 0, "failed": 0}


def check(name: str, ok: bool, detail: str = "") -> bool:
    key = "passed" if ok else "failed"
    counts[key] += 1
    sep = " (" if ok else ": "
    end = ")" if ok else ""
    print(
        f"{'PASS' if ok else 'FAIL'} {name}" + (f"{sep}{detail}{end}" if detail else ""), flush=True
    )
    return ok


def run(main: Callable[[], object], t0: float) -> None:
    """Runs ``main``; a crash is a failed check with its traceback, never a silent exit. Prints
    ``smoke: N passed, M failed`` and exits 1 if anything failed."""
    try:
        main()
    except Exception:
        traceback.print_exc()
        check("smoke ran to the end", False, "exception (traceback above)")
    print(
        f"smoke: {counts['passed']} passed, {counts['failed']} failed "
        f"({time.time() - t0:.1f} s in total)",
        flush=True,
    )
    sys.exit(1 if counts["failed"] else 0)
