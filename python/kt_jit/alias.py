"""Opt-in ``kt_kernel`` alias for SGLang: ``python -m kt_jit.alias install | uninstall | status``.

SGLang's kvcache-ai fork does ``from kt_kernel import KTMoEWrapper, generate_gpu_experts_masks``.
This command writes a tiny ``kt_kernel`` package (python/kt_kernel_alias/kt_kernel in the source
tree; embedded below for wheel installs) that re-exports kt-jit under that name. It is never
installed by default, refuses to install where a real kt-kernel is importable, marks its directory
with a ``KT_JIT_ALIAS`` file and ``uninstall`` removes only a directory carrying that mark. The
package itself also refuses to import when a real kt-kernel is anywhere else on sys.path.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import os
import shutil
import sys
import sysconfig
from typing import List, Optional

MARKER = "KT_JIT_ALIAS"

#: The alias package's __init__.py (kept identical to python/kt_kernel_alias/kt_kernel/__init__.py;
#: tests/python/test_alias.py checks it).
ALIAS_SOURCE = r'''"""kt-jit's opt-in ``kt_kernel`` alias: ``from kt_kernel import KTMoEWrapper`` runs kt-jit.

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
'''


def alias_source() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    repo_copy = os.path.join(here, "..", "kt_kernel_alias", "kt_kernel", "__init__.py")
    if os.path.isfile(repo_copy):
        with open(repo_copy, encoding="utf-8") as f:
            return f.read()
    return ALIAS_SOURCE


def default_target(user: bool = False) -> str:
    if user:
        import site

        return site.getusersitepackages()
    return sysconfig.get_paths()["purelib"]


def find_kt_kernel(search_path: Optional[List[str]] = None):
    """(directory, is_our_alias) of the kt_kernel package importable from search_path, or None."""
    spec = importlib.machinery.PathFinder.find_spec(
        "kt_kernel", list(sys.path if search_path is None else search_path)
    )
    if spec is None:
        return None
    if spec.origin:
        d = os.path.dirname(spec.origin)
    else:  # namespace package
        d = list(spec.submodule_search_locations or [""])[0]
    return d, os.path.exists(os.path.join(d, MARKER))


def install(target: Optional[str] = None, force: bool = False) -> str:
    """Write <target>/kt_kernel/ (the alias). Raises RuntimeError if a real kt-kernel is
    importable (from sys.path or target) unless force."""
    target = os.path.abspath(target or default_target())
    found = find_kt_kernel(sys.path + [target])
    if found is not None and not found[1] and not force:
        raise RuntimeError(
            f"kt_kernel is already importable from {found[0]} (a real kt-kernel installation?); "
            "refusing to install kt-jit's alias over or in front of it"
        )
    pkg = os.path.join(target, "kt_kernel")
    if os.path.exists(pkg) and not os.path.exists(os.path.join(pkg, MARKER)):
        raise RuntimeError(f"{pkg} exists and is not kt-jit's alias; refusing to overwrite it")
    os.makedirs(pkg, exist_ok=True)
    with open(os.path.join(pkg, "__init__.py"), "w", encoding="utf-8") as f:
        f.write(alias_source())
    with open(os.path.join(pkg, MARKER), "w", encoding="utf-8") as f:
        f.write(
            "kt_kernel alias written by `python -m kt_jit.alias install`; "
            "remove with `python -m kt_jit.alias uninstall`\n"
        )
    return pkg


def uninstall(target: Optional[str] = None) -> Optional[str]:
    """Remove <target>/kt_kernel if it is kt-jit's alias; returns the path removed (or None)."""
    target = os.path.abspath(target or default_target())
    pkg = os.path.join(target, "kt_kernel")
    if not os.path.exists(pkg):
        return None
    if not os.path.exists(os.path.join(pkg, MARKER)):
        raise RuntimeError(f"{pkg} is not kt-jit's alias (no {MARKER} file); not removing it")
    shutil.rmtree(pkg)
    return pkg


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kt_jit.alias",
        description="Install or remove the opt-in `kt_kernel` alias package (for SGLang).",
    )
    p.add_argument("action", choices=("install", "uninstall", "status"))
    g = p.add_mutually_exclusive_group()
    g.add_argument("--target", help="directory to write kt_kernel/ into (default: site-packages)")
    g.add_argument("--user", action="store_true", help="use the user site-packages")
    p.add_argument(
        "--force",
        action="store_true",
        help="install even though another kt_kernel is importable (not recommended)",
    )
    a = p.parse_args(argv)
    target = a.target or default_target(a.user)
    try:
        if a.action == "install":
            print(f"installed kt-jit's kt_kernel alias: {install(target, a.force)}")
        elif a.action == "uninstall":
            removed = uninstall(target)
            print(f"removed {removed}" if removed else f"no kt_kernel alias in {target}")
        else:
            found = find_kt_kernel(sys.path + [os.path.abspath(target)])
            if found is None:
                print("kt_kernel: not importable")
            else:
                kind = "kt-jit alias" if found[1] else "real kt-kernel (or another package)"
                print(f"kt_kernel: {found[0]} ({kind})")
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
