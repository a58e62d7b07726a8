"""The repository stays light: the GPU machine's tool carries the working tree (and refuses one
over 64 MiB), and every clone carries it too. Run output goes in as README + JSON with the raw
logs packed (``bench/device/pack_run.sh``); these budgets fail loudly, naming the largest folders."""

from __future__ import annotations

import collections
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20
TREE_BUDGET = 16 * MiB
RESULTS_BUDGET = 8 * MiB


def _tracked_sizes() -> dict[str, int]:
    if shutil.which("git") is None or not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout: the budget is on tracked files")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    sizes = {}
    for name in out.stdout.decode().split("\0"):
        path = os.path.join(ROOT, name)
        if name and os.path.isfile(path):  # a file deleted but not yet committed counts as gone
            sizes[name] = os.path.getsize(path)
    return sizes


def _largest_folders(sizes: dict[str, int], depth: int, n: int = 5) -> str:
    per = collections.Counter()
    for name, size in sizes.items():
        per["/".join(name.split("/")[:depth])] += size
    return ", ".join(f"{k} {v / MiB:.1f} MiB" for k, v in per.most_common(n))


def test_tracked_tree_within_budget():
    sizes = _tracked_sizes()
    total = sum(sizes.values())
    assert total <= TREE_BUDGET, (
        f"tracked tree is {total / MiB:.1f} MiB, budget {TREE_BUDGET // MiB} MiB; "
        f"largest: {_largest_folders(sizes, 2)}")


def test_run_output_within_budget():
    sizes = {k: v for k, v in _tracked_sizes().items() if k.startswith("bench/results/")}
    total = sum(sizes.values())
    assert total <= RESULTS_BUDGET, (
        f"bench/results/ is {total / MiB:.1f} MiB, budget {RESULTS_BUDGET // MiB} MiB "
        f"(pack raw logs with bench/device/pack_run.sh); largest: {_largest_folders(sizes, 4)}")


def test_no_loose_raw_output():
    """Raw logs and text dumps live inside a run folder's raw.tar.xz, not beside it."""
    loose = sorted(k for k in _tracked_sizes()
                   if k.startswith("bench/results/") and k.endswith((".txt", ".log")))
    assert loose == [], f"pack these with bench/device/pack_run.sh: {loose[:10]}"
