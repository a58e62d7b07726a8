"""examples/ stay runnable (on CPU here; on the GPU machine they take the GPU path)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_engine_direct_example_runs(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env = {k: v for k, v in env.items() if not k.startswith("GDSKV_")}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "engine_direct.py"),
                           "--dir", str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "spilled 50/50 pages" in proc.stdout
    assert "restored 50/50 pages into new slots, bit-exact: True" in proc.stdout


def readme_block(marker: str, doc: str = "docs/api.md") -> str:
    """The code between ``<!-- marker -->`` and ``<!-- /marker -->`` in ``doc``."""
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        text = f.read()
    body = text.split(f"<!-- {marker} -->", 1)[1].split(f"<!-- /{marker} -->", 1)[0]
    return "\n".join(line for line in body.strip().splitlines() if not line.startswith("```"))


def test_readme_quickstart_runs_as_pasted(tmp_path):
    """The Python API doc's quickstart block, run as a user would paste it: from another directory,
    on the installed package, with no GDSKV_* variables set."""
    script = tmp_path / "quickstart.py"
    script.write_text(readme_block("quickstart"))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GDSKV_") and k != "PYTHONPATH"}
    env["TMPDIR"] = str(tmp_path)  # where the example's temporary store goes
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[:3] == ["stored: [True, True, True, True]",
                                            "restored: [True, True, True, True]",
                                            "same bytes: True"]
    assert proc.stdout.splitlines()[3].startswith("restored again: [True, True, True, True] on ")
    assert os.listdir(tmp_path) == ["quickstart.py"]  # the store went with its directory
