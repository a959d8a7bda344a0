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


def check_matches_reference(name: str, layer, x, ids, w, out) -> bool:
    """``out`` (the generated kernels' forward) against the layer's plain C++ reference path on
    the same inputs, bit for bit."""
    import torch

    xs, ids_c, w_c = x.contiguous(), ids.contiguous(), w.contiguous()
    ref_out = torch.empty(out.shape, dtype=torch.float32)
    layer.forward_reference(
        x.shape[0], xs.data_ptr(), ids_c.data_ptr(), w_c.data_ptr(), 0, ref_out.data_ptr()
    )
    diff = (out - ref_out).abs().max().item()
    return check(name, torch.equal(out, ref_out), f"max |diff| = {diff:.3g}")


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
