"""tests/run.sh reuses its venvs while their inputs are unchanged (tests/venv.sh), prints skip
reasons, and the README's numbers and re-run line match it."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _stale(venv, *inputs) -> tuple[int, str]:
    script = f'. "{ROOT}/tests/venv.sh"; venv_stale "{venv}" ' + " ".join(map(str, inputs))
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout


def _built(venv) -> None:
    subprocess.run(["bash", "-c", f'. "{ROOT}/tests/venv.sh"; venv_built "{venv}"'], check=True)


def test_venv_is_built_once_and_rebuilt_when_an_input_changes(tmp_path):
    pytest.importorskip("ensurepip", reason="python3 -m venv needs ensurepip (python3-venv)")
    venv, req = tmp_path / "venv", tmp_path / "requirements.txt"
    req.write_text("torch==2.13.0\n")
    assert _stale(venv, req)[0] == 0 and (venv / "bin" / "python").exists()
    # not stamped until the installs are done: an interrupted build is redone
    assert not (venv / ".inputs.sha256").exists()
    (venv / "marker").write_text("a package")
    _built(venv)
    rc, out = _stale(venv, req)
    assert rc == 1 and "reusing" in out and (venv / "marker").exists()
    req.write_text("torch==2.14.1\n")
    assert _stale(venv, req)[0] == 0 and not (venv / "marker").exists()
    assert not (venv / ".inputs.sha256").exists()


def test_run_scripts_print_skip_reasons_and_readme_gives_the_rerun_line():
    for name in ("run.sh", "run_engine.sh", "run_lightllm.sh"):
        with open(os.path.join(ROOT, "tests", name), encoding="utf-8") as f:
            text = f.read()
        assert re.search(r"-m pytest -q -rs\b", text), name
        assert "venv_stale" in text and "venv_built" in text, name
    for name in ("run_sglang.sh", "run_vllm.sh", "run_lmcache.sh"):  # the engines' venvs: through run_engine.sh
        with open(os.path.join(ROOT, "tests", name), encoding="utf-8") as f:
            assert "exec bash tests/run_engine.sh" in f.read(), name
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert '.venv/bin/python -m pytest -q -rs -m "not slow"' in readme
