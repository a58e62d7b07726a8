"""The kernels load under one name, ``gdskv.kernels``, from the installed (editable) package.

``kernels/`` sits at the repository top level and installs as ``gdskv.kernels`` through
``package-dir`` in pyproject.toml; nothing may import it as the top-level ``kernels`` (a second
module copy with its own caches, and a popular name on the package index)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys

import pytest

import gdskv
import gdskv.kernels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gdskv_kernels_is_the_top_level_kernels_folder():
    assert os.path.dirname(gdskv.kernels.__file__) == os.path.join(ROOT, "kernels")
    assert list(gdskv.__path__) == [os.path.join(ROOT, "gdskv")]  # no search-path additions


def test_installed_package_resolves_outside_the_tree(tmp_path):
    """From another directory (the repository not on sys.path) the install alone resolves it."""
    code = ("import sys, gdskv.kernels.checksum as c, gdskv.tier; "
            "print(c.__file__); print('kernels' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [os.path.join(ROOT, "kernels", "checksum.py"), "False"]


def _imports_of(path: str) -> set[str]:
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_nothing_imports_the_top_level_name_kernels():
    offenders = []
    for top in ("gdskv", "kernels", "bench", "tests", "examples"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                path = os.path.join(dirpath, name)
                if name.endswith(".py") and "kernels" in _imports_of(path):
                    offenders.append(os.path.relpath(path, ROOT))
    assert offenders == []


@pytest.mark.parametrize("path", [
    "dist/gdskv-0.1.0-py3-none-any.whl", "dist/gdskv-0.1.0.tar.gz", "build/lib/gdskv/tier.py",
    "gdskv.egg-info/PKG-INFO", ".eggs/setuptools.egg",
    "gdskv/_native.cpython-312-x86_64-linux-gnu.so",
    "integrations/light_mem/dist/x.whl", "wheels/x.whl"])
def test_build_outputs_are_ignored_by_git(path):
    """``python -m build`` (the README's wheel line) leaves dist/ and build/ in the clone."""
    if not os.path.exists(os.path.join(ROOT, ".git")) or shutil.which("git") is None:
        pytest.skip("not a git checkout with git at hand (an unpacked sdist?): .gitignore "
                    "does not apply")
    proc = subprocess.run(["git", "check-ignore", "--no-index", "-q", path], cwd=ROOT)
    assert proc.returncode == 0, f"{path} is not ignored by .gitignore"
