"""The opt-in ``kt_kernel`` alias (SPEC.md §1): works on PYTHONPATH or after
``python -m kt_jit.alias install``, is removed by ``uninstall``, and never shadows a real
kt-kernel. Everything happens in temporary directories; the real site-packages is never touched.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_python
from kt_jit import alias

REPO = Path(__file__).resolve().parents[2]
ALIAS_DIR = REPO / "python" / "kt_kernel_alias"

IMPORT_CHECK = r"""
import kt_jit
from kt_kernel import KTMoEWrapper, generate_gpu_experts_masks
import kt_kernel
assert KTMoEWrapper is kt_jit.KTMoEWrapper
assert generate_gpu_experts_masks is kt_jit.generate_gpu_experts_masks
assert kt_kernel.__kt_jit_alias__ is True
assert kt_kernel.__cpu_variant__ in ("amx", "avx512_bf16", "avx512_vnni", "avx512_base", "avx2")
print("alias ok", kt_kernel.__file__)
"""


def _env(*paths):
    old = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": os.pathsep.join([str(p) for p in paths] + ([old] if old else []))}


def _cli(*args, env_paths=()):
    env = dict(os.environ)
    env.update(_env(*env_paths))
    return subprocess.run(
        [sys.executable, "-m", "kt_jit.alias", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def _fake_real_kt_kernel(root: Path) -> Path:
    pkg = root / "kt_kernel"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("REAL = True\n")
    return root


def test_embedded_source_matches_the_repo_package():
    assert alias.ALIAS_SOURCE == (ALIAS_DIR / "kt_kernel" / "__init__.py").read_text()


def test_not_installed_by_default():
    found = alias.find_kt_kernel()
    assert found is None or not found[1], f"kt-jit's alias is installed at {found[0]}"


def test_alias_on_pythonpath():
    r = run_python(IMPORT_CHECK, env_extra=_env(ALIAS_DIR))
    assert r.returncode == 0, r.stderr
    assert "alias ok" in r.stdout


def test_install_and_uninstall_in_a_temporary_target(tmp_path):
    target = tmp_path / "site"
    r = _cli("install", "--target", str(target))
    assert r.returncode == 0, r.stderr
    assert (target / "kt_kernel" / "__init__.py").is_file()
    assert (target / "kt_kernel" / alias.MARKER).is_file()
    r = run_python(IMPORT_CHECK, env_extra=_env(target))
    assert r.returncode == 0, r.stderr
    assert str(target) in r.stdout
    assert "kt-jit alias" in _cli("status", "--target", str(target)).stdout
    assert _cli("install", "--target", str(target)).returncode == 0  # idempotent
    r = _cli("uninstall", "--target", str(target))
    assert r.returncode == 0, r.stderr
    assert not (target / "kt_kernel").exists()
    r = run_python("import kt_kernel", env_extra=_env(target))
    assert r.returncode != 0
    assert "no kt_kernel alias" in _cli("uninstall", "--target", str(target)).stdout


def test_install_refuses_when_real_kt_kernel_is_importable(tmp_path):
    real = _fake_real_kt_kernel(tmp_path / "real")
    target = tmp_path / "site"
    r = _cli("install", "--target", str(target), env_paths=[real])
    assert r.returncode == 1
    assert "already importable" in r.stderr
    assert not (target / "kt_kernel").exists()
    # nor over a kt_kernel directory that is not ours, nor remove one
    _fake_real_kt_kernel(target)
    r = _cli("install", "--target", str(target))
    assert r.returncode == 1
    r = _cli("uninstall", "--target", str(target))
    assert r.returncode == 1 and (target / "kt_kernel" / "__init__.py").exists()


def test_alias_never_shadows_a_real_kt_kernel(tmp_path):
    real = _fake_real_kt_kernel(tmp_path / "real")
    # alias first on sys.path, real kt-kernel after it: the alias refuses to load
    r = run_python("import kt_kernel", env_extra=_env(ALIAS_DIR, real))
    assert r.returncode != 0
    assert "refuses to" in r.stderr and "shadow" in r.stderr
    # real kt-kernel first: it wins, the alias is never imported
    r = run_python("import kt_kernel; print(kt_kernel.REAL)", env_extra=_env(real, ALIAS_DIR))
    assert r.returncode == 0 and "True" in r.stdout


@pytest.mark.parametrize("user", [False, True])
def test_default_targets_are_site_dirs(user):
    t = alias.default_target(user)
    assert isinstance(t, str) and t
