"""What every long load shows: a tqdm bar (when tqdm is installed) and a bytes/seconds summary."""

from __future__ import annotations

import time

try:
    from tqdm import tqdm as _tqdm
except ImportError:  # pragma: no cover - tqdm is a dependency, but loads must not need it
    _tqdm = None


def progress_bar(total: int, desc: str, show: bool = True):
    """A tqdm bar on stderr counting experts, or None (tqdm missing or ``show`` false)."""
    if not show or _tqdm is None:
        return None
    return _tqdm(total=total, desc=desc, unit="expert", leave=False)


def load_stats(nbytes: int, t0: float) -> dict:
    """{bytes, seconds, gb_per_s} of a load that started at ``t0`` (time.perf_counter())."""
    secs = time.perf_counter() - t0
    return {"bytes": nbytes, "seconds": secs, "gb_per_s": nbytes / secs / 1e9 if secs > 0 else 0.0}
