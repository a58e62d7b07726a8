"""bench/experiments/lightllm_disk.py runs as a script (gdskv only, no LightLLM), drives both
sides through LightMem's service calls, verifies every loaded byte and reports both."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "bench", "experiments", "lightllm_disk.py")


def run(*args):
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_lightllm_disk_runs_and_reports(tmp_path):
    out = tmp_path / "lightllm.json"
    proc = run("--dir", str(tmp_path / "d"), "--page-bytes", "10000", "--requests", "3",
               "--pages-per-request", "2", "--loaders", "2", "--workers", "2", "--passes", "2",
               "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["pages"] == 6 and set(r["results"]) == {"gdskv", "file_per_block"}
    for side in r["results"].values():
        assert len(side["write_s"]) == len(side["read_s"]) == 2
        assert side["write_GBps"] > 0 and side["read_GBps"] > 0
    assert r["results"]["gdskv"]["tier"]["backend"] == "posix"
    assert "file_per_block: offload" in proc.stdout
    assert os.listdir(tmp_path / "d") == []  # both stores are gone


def test_bad_option_names_itself(tmp_path):
    proc = run("--dir", str(tmp_path), "--loaders", "0")
    assert proc.returncode == 2 and "--loaders must be at least 1, got 0" in proc.stderr
