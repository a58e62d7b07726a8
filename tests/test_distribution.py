"""The package as users get it: ``python -m build`` makes a wheel and an sdist that pass
``twine check``, carry the Apache-2.0 LICENSE that pyproject declares, ship only the library and
``gdskv-bench``; the built wheel, installed into a fresh venv (not this editable tree), runs
the README's main command; and integrations/light_mem builds and installs beside it. These are
the install forms the docs may give (tests/test_install_lines.py holds them to it)."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

import pytest

from test_install_lines import built_wheel_name

# the test extra brings both; a machine without them (the GPU machine) skips with the reason
pytest.importorskip("build", reason="needs the build package (pip install -e '.[test]')")
pytest.importorskip("twine", reason="needs twine (pip install -e '.[test]')")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IGNORE = shutil.ignore_patterns(".git", ".venv*", "build", "*.egg-info", "__pycache__",
                                ".hypothesis", ".pytest_cache", "dist", ".whl*")


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> str:
    """sdist and wheel built from a copy of the tree (the build writes into its source)."""
    base = tmp_path_factory.mktemp("dist")
    src = base / "src"
    shutil.copytree(ROOT, src, ignore=IGNORE)
    out = base / "dist"
    # --no-isolation: the build backend comes from this venv (the test extra pins it), so the
    # test needs no package index
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out),
                           str(src)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return str(out)


def _one(dist: str, pattern: str) -> str:
    (path,) = glob.glob(os.path.join(dist, pattern))
    return path


def test_wheel_and_sdist_pass_twine_check(dist):
    proc = subprocess.run([sys.executable, "-m", "twine", "check", "--strict",
                           _one(dist, "*.whl"), _one(dist, "*.tar.gz")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("PASSED") == 2


def test_the_wheel_is_abi3_with_the_native_engine(dist):
    """One wheel for every CPython from 3.11 (the limited API), with both extensions (the
    page engine and the yielding lock); the sdist carries the C sources that ``pip install``
    compiles."""
    whl = os.path.basename(_one(dist, "*.whl"))
    if sys.version_info >= (3, 11):
        assert "-cp311-abi3-" in whl, whl
    with zipfile.ZipFile(_one(dist, "*.whl")) as z:
        for ext in ("_pages", "_locks"):
            assert [n for n in z.namelist() if n.startswith(f"gdskv/native/{ext}.")
                    and n.endswith(".so")], z.namelist()
    with tarfile.open(_one(dist, "*.tar.gz")) as sdist:
        # (the page engine is _pages.c, the quick reader's quick_read.c, the slot trailers'
        # trailer.c and the journal records' records.c, sharing engine.h)
        for source in ("_pages.c", "quick_read.c", "trailer.c", "records.c", "engine.h",
                       "_locks.c"):
            assert any(n.endswith(f"/gdskv/native/{source}") for n in sdist.getnames())
        assert any(n.endswith("/setup.py") for n in sdist.getnames())


def test_license_is_the_apache_2_text_pyproject_declares(dist):
    with open(os.path.join(ROOT, "LICENSE"), encoding="utf-8") as f:
        license_text = f.read()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        assert re.search(r'^license = "Apache-2.0"$', f.read(), re.M)
    with zipfile.ZipFile(_one(dist, "*.whl")) as whl:
        names = whl.namelist()
        meta = whl.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        shipped = whl.read(next(n for n in names if n.endswith("/licenses/LICENSE"))).decode()
    assert shipped == license_text
    assert "License-Expression: Apache-2.0" in meta
    with tarfile.open(_one(dist, "*.tar.gz")) as sdist:
        assert any(n.endswith("/LICENSE") for n in sdist.getnames())


def test_wheel_ships_the_library_and_gdskv_bench_only(dist):
    with zipfile.ZipFile(_one(dist, "*.whl")) as whl:
        modules = {n for n in whl.namelist() if n.endswith(".py")}
        (entry,) = [n for n in whl.namelist() if n.endswith(".dist-info/entry_points.txt")]
        scripts = whl.read(entry).decode()
    # the console scripts: the benchmark and the store's operator command
    assert "gdskv-bench = gdskv.bench.cli:main" in scripts and "gdskv = gdskv.cli:run" in scripts
    bench = {n for n in modules if n.startswith("gdskv/bench/")}
    assert bench == {f"gdskv/bench/{f}" for f in os.listdir(os.path.join(ROOT, "bench"))
                     if f.endswith(".py")}
    assert {f"gdskv/kernels/{f}" for f in os.listdir(os.path.join(ROOT, "kernels"))
            if f.endswith(".py")} <= modules
    assert all(n.startswith("gdskv/") for n in modules), sorted(modules)
    # LightLLM's adapter ships; the light_mem module (LightMem's import name) never does: it is
    # the separate gdskv-light-mem distribution (integrations/light_mem)
    assert "gdskv/adapters/lightllm.py" in modules
    assert not any("light_mem" in n for n in modules)


def _main_command_args() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    block = text.split("<!-- main-command -->", 1)[1].split("<!-- /main-command -->", 1)[0]
    (cmd,) = [line for line in block.splitlines() if "gdskv-bench" in line]
    return cmd.split(".venv/bin/gdskv-bench", 1)[1]


def _fresh_venv(tmp_path, wheels: list[str]) -> tuple[str, str, dict]:
    """A new venv with these wheels installed (no index): its directory, its site-packages and
    an environment to run it in."""
    pytest.importorskip("ensurepip", reason="python3 -m venv needs ensurepip (python3-venv)")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    proc = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                           *wheels], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    # torch and the other dependencies come from this test venv (a second 2 GB torch install
    # would only test pip); its editable gdskv stays invisible: a plain path in a .pth file
    # does not run that directory's own .pth hooks, and the venv's site-packages comes first.
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True, check=True
                          ).stdout.strip()
    with open(os.path.join(site, "test-venv-dependencies.pth"), "w", encoding="utf-8") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GDSKV_") and k != "PYTHONPATH"}
    env["TMPDIR"] = str(tmp_path)
    return str(venv), site, env


def test_the_wheel_is_named_as_the_docs_install_it(dist):
    assert os.path.basename(_one(dist, "*.whl")) == built_wheel_name()


def test_built_wheel_in_a_fresh_venv_runs_the_readme_main_command(dist, tmp_path):
    venv, site, env = _fresh_venv(tmp_path, [_one(dist, "*.whl")])
    py = f"{venv}/bin/python"
    where = subprocess.run([py, "-c", "import gdskv, gdskv.kernels, gdskv.bench.cli; "
                            "import gdskv.native as n; print(gdskv.__file__); "
                            "print(gdskv.kernels.__file__); print(n._pages.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, check=True)
    assert all(p.startswith(site) for p in where.stdout.split()), where.stdout
    cmd = f"{venv}/bin/gdskv-bench {_main_command_args()}"
    run = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "verify: OK" in run.stdout and "err= 0" in run.stdout
    assert "page engine: native" in run.stdout
    # the store is kept (fio's unlink=0) and named exactly: gdskv info reads it
    (store,) = re.findall(r"store: kept in (\S+) \(", run.stdout)
    assert os.path.dirname(os.path.dirname(store)) == str(tmp_path), store
    info = subprocess.run([f"{venv}/bin/gdskv", "info", store, "--json"], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=300)
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["pages"] == 128  # 256 MiB of 2 MiB pages


def test_light_mem_folder_builds_and_installs_beside_the_wheel(dist, tmp_path):
    """The docs' ``pip install /path/to/gdskv/integrations/light_mem``: pip builds the folder
    into a wheel, as here, and installs it; beside gdskv's wheel, ``light_mem`` imports."""
    src = tmp_path / "light_mem_src"
    shutil.copytree(os.path.join(ROOT, "integrations", "light_mem"), src, ignore=IGNORE)
    out = tmp_path / "light_mem_dist"
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--wheel",
                           "--outdir", str(out), str(src)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    venv, site, env = _fresh_venv(tmp_path, [_one(dist, "*.whl"), _one(str(out), "*.whl")])
    where = subprocess.run([f"{venv}/bin/python", "-c", "import light_mem, gdskv; "
                            "print(light_mem.__file__); print(gdskv.__file__); "
                            "print(light_mem.PyLocalCacheService.__name__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert where.returncode == 0, where.stderr
    *paths, name = where.stdout.split()
    assert all(p.startswith(site) for p in paths) and name == "PyLocalCacheService", where.stdout
