"""kt-jit's opt-in ``kt_kernel`` alias: ``from kt_kernel import KTMoEWrapper`` runs kt-jit.

Not installed by default. Put this package's parent directory on PYTHONPATH, or run
``python -m kt_jit.alias install`` (``uninstall`` removes it). It refuses to load when a real
kt-kernel is importable from anywhere else on sys.path, so it never shadows one silently.
"""

import importlib.machinery as _machinery
import os as _os
import sys as _sys

__kt_jit_alias__ = True

_here = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
_others = [
    p
    for p in _sys.path
    if _os.path.abspath(p or _os.getcwd()) != _here and _os.path.isdir(p or _os.getcwd())
]
_real = _machinery.PathFinder.find_spec("kt_kernel", _others)
if _real is not None and _real.origin and not _os.path.exists(
    _os.path.join(_os.path.dirname(_real.origin), "KT_JIT_ALIAS")
):
    raise ImportError(
        "kt_kernel: a real kt-kernel is installed at "
        + _os.path.dirname(_real.origin)
        + "; kt-jit's alias (" + _os.path.dirname(_os.path.abspath(__file__)) + ") refuses to "
        "shadow it. Remove the alias (python -m kt_jit.alias uninstall, or drop it from "
        "PYTHONPATH) or uninstall kt-kernel."
    )

from kt_jit import KTMoEWrapper, generate_gpu_experts_masks  # noqa: E402
from kt_jit import __isa__ as _isa  # noqa: E402
from kt_jit import __version__  # noqa: E402

#: kt-kernel's six variant names for the level kt-jit selected.
__cpu_variant__ = {
    "amx": "amx",
    "avx512_bf16": "avx512_bf16",
    "avx512_vnni": "avx512_vnni",
    "avx512": "avx512_base",
}.get(_isa, "avx2")
__int8_kernel__ = "kt-jit"
AMXSFTMoEWrapper = None  # LoRA fine-tuning is not built in kt-jit

__all__ = [
    "KTMoEWrapper",
    "AMXSFTMoEWrapper",
    "generate_gpu_experts_masks",
    "__cpu_variant__",
    "__int8_kernel__",
    "__version__",
]
