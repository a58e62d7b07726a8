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
