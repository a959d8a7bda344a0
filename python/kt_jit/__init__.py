"""kt-jit: a CPU Mixture-of-Experts kernel engine with run-time generated kernels.

The public surface mirrors kt-kernel (``KTMoEWrapper``, ``generate_gpu_experts_masks``) and adds a
thin native layer (``MoELayer``) plus a few introspection helpers.
"""

from __future__ import annotations

import logging
import os

from . import _core

__all__ = [
    "__version__",
    "__isa__",
    "cpu_features",
    "KTMoEWrapper",
    "generate_gpu_experts_masks",
    "MoELayer",
]

logger = logging.getLogger("kt_jit")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


# The start-up line (version, ISA, threads, method) and load summaries are INFO messages that a
# user should see without configuring logging: they go to stderr through kt-jit's own handler.
# KT_JIT_LOG_LEVEL=WARNING silences them; KT_JIT_DEBUG=1 adds the debug detail.
if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[kt_jit] %(message)s"))
    logger.addHandler(_handler)
    logger.propagate = False
logger.setLevel(
    logging.DEBUG
    if _env_flag("KT_JIT_DEBUG")
    else getattr(logging, os.environ.get("KT_JIT_LOG_LEVEL", "INFO").upper(), logging.INFO)
)

__version__: str = _core.__version__
__isa__: str = _core.isa()

#: The native MoE layer (pointer-level API); ``KTMoEWrapper`` is the kt-kernel compatible one.
MoELayer = _core.MoELayer


def cpu_features() -> dict:
    """What the CPU probe found: CPUID bits, OS (XCR0) support, AMX permission, chosen ISA."""
    return dict(_core.cpu_features())


logger.debug("kt-jit %s imported; isa=%s features=%s", __version__, __isa__, cpu_features())

from .wrapper import KTMoEWrapper, generate_gpu_experts_masks  # noqa: E402
