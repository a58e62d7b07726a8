"""bench/experiments/concurrency_matrix.py (issue 47's concurrency/latency matrix) runs
gdskv-bench --compare from a chosen source tree and keeps both engines' figures per cell."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

import concurrency_matrix as cm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_page_sizes_map_to_llama_token_shape():
    assert cm.geometry(64 << 10) == (1, 16)
    assert cm.geometry(256 << 10) == (4, 16)
    assert cm.geometry(2 << 20) == (32, 16)  # the llama3-8b preset's 16-token page
    assert cm.geometry(8 << 10) == (1, 2)
    assert cm.geometry(4 << 20) == (32, 32)
    with pytest.raises(ValueError, match="token-layers"):
        cm.geometry(6000)
    assert cm.parse_size("64KiB") == cm.parse_size("64k") == 65536


def test_one_cell_end_to_end(tmp_path, capsys):
    """One restore cell on the posix backend: both engines' pages/s and p50, their ratios,
    the page engine, and gdskv imported from the tree given."""
    out = tmp_path / "cm.json"
    rc = cm.main(["--dirs", f"shm={tmp_path / 'store'}", "--pages", "64KiB", "--ops", "restore",
                  "--threads", "1", "--runtime", "0.2", "--ramp", "0", "--backend", "posix",
                  "--mem", "host", "--tree", f"after={REPO}", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    r = json.loads(out.read_text())
    assert r["trees"]["after"]["imports"]["gdskv"] == os.path.join(
        os.path.realpath(REPO), "gdskv", "__init__.py")
    [cell] = r["cells"]
    assert (cell["op"], cell["threads"], cell["page_bytes"]) == ("restore", 1, 65536)
    assert set(cell["engines"]) == {"gdskv", "raw"}  # --no-hicachefile: sglang kept out
    for e in cell["engines"].values():
        assert e["pages_per_s"] > 0 and e["clat_p50_ns"] > 0 and e["calls"] > 0
        assert e["backend"] == "posix"
    assert cell["ratio_aggregate"] > 0 and cell["ratio_p50"] > 0 and not cell["errors"]
    assert cell["engines"]["gdskv"]["page_engine"] in ("native", "python")
    assert "| shm | 64 KiB | restore | " in printed
    assert os.listdir(tmp_path / "store") == []  # unlink: each engine's store is gone


def _extract_tree(dest) -> str:
    """This checkout's committed gdskv, bench and kernels, as ``git archive`` gives them (no
    built extension)."""
    dest.mkdir()
    archive = subprocess.run(["git", "-C", REPO, "archive", "HEAD", "gdskv", "bench", "kernels"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return str(dest.resolve())


needs_git = pytest.mark.skipif(
    shutil.which("git") is None or not os.path.exists(os.path.join(REPO, ".git")),
    reason="needs a git checkout to extract a tree from")


@needs_git
def test_tree_bench_imports_from_the_tree_given(tmp_path):
    """An extracted tree's gdskv, bench and kernels are the ones imported, not the installed
    tree's, and its unbuilt native engine is not taken from the installed tree either."""
    tree = _extract_tree(tmp_path / "tree")
    proc = subprocess.run([sys.executable, cm.TREE_BENCH, "--no-hicachefile", tree,
                           "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    info = cm.check_imports(proc.stderr, tree)
    assert info["gdskv"] == os.path.join(tree, "gdskv", "__init__.py")
    assert info["kernels"] == os.path.join(tree, "kernels", "__init__.py")
    assert info["native"].startswith("not loaded")
    with pytest.raises(RuntimeError, match="imported from elsewhere"):
        cm.check_imports(proc.stderr.replace(tree, "/elsewhere"), tree)


@needs_git
def test_a_module_the_tree_lacks_stays_missing(tmp_path):
    """A gdskv module the tree does not have is not found in an editable install of another
    tree (whose finder answers for gdskv's immediate children)."""
    tree = _extract_tree(tmp_path / "tree")
    os.unlink(os.path.join(tree, "gdskv", "tier_protocol.py"))  # `import gdskv` skips it
    code = ("import sys; sys.path.insert(0, sys.argv[2]); import tree_bench; "
            "sys.meta_path.insert(0, tree_bench.TreeFinder(sys.argv[1])); import gdskv\n"
            "try:\n import gdskv.tier_protocol as m; print('found', m.__file__)\n"
            "except ModuleNotFoundError as e:\n print('missing', gdskv.__file__)")
    proc = subprocess.run([sys.executable, "-c", code, tree, os.path.dirname(cm.TREE_BENCH)],
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == f"missing {tree}/gdskv/__init__.py", proc.stderr


def test_not_a_tree_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="not a gdskv source tree"):
        cm.main(["--dirs", str(tmp_path), "--tree", f"x={tmp_path}", "--out",
                 str(tmp_path / "o.json")])
