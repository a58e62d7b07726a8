"""The bench/ tree says what ships: the installed ``gdskv.bench`` is what ``gdskv-bench`` runs;
device scripts, probes and run output sit apart, and the docs name paths that exist."""

from __future__ import annotations

import ast
import dataclasses
import glob
import os
import re
import subprocess
import sys
import tarfile
from functools import lru_cache

import pytest

from gdskv.config import FIELD_DOCS, TierConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
RESULTS = os.path.join(BENCH, "results")
EXPERIMENTS = os.path.join(BENCH, "experiments")


def test_installed_bench_is_what_the_cli_imports():
    """Every module of gdskv.bench is loaded by gdskv-bench itself: nothing else ships."""
    code = ("import sys, gdskv.bench.cli; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('gdskv.bench.'))))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                check=True, cwd=ROOT).stdout.split())
    shipped = {"gdskv.bench." + f[:-3] for f in os.listdir(BENCH)
               if f.endswith(".py") and f != "__init__.py"}
    assert shipped == loaded
    for sub in ("device", "experiments", "results", "jobs"):
        assert not os.path.exists(os.path.join(BENCH, sub, "__init__.py")), sub


@lru_cache(maxsize=None)
def _archived(run_folder: str) -> frozenset[str]:
    """Members of a run folder's raw.tar.xz (bench/device/pack_run.sh), relative to the folder."""
    archive = os.path.join(run_folder, "raw.tar.xz")
    if not os.path.isfile(archive):
        return frozenset()
    with tarfile.open(archive) as tar:
        names = {m.name.removeprefix("./") for m in tar.getmembers()}
    dirs = {"/".join(n.split("/")[:i]) + "/" for n in names for i in range(1, n.count("/") + 1)}
    return frozenset(names | dirs)


def result_exists(path: str) -> bool:
    """``path`` (relative to bench/results/, a glob allowed) is a file or folder there, or a
    member of its run folder's packed raw output."""
    if glob.glob(os.path.join(RESULTS, path)):
        return True
    parts = path.split("/")
    return len(parts) > 2 and "/".join(parts[2:]) in _archived(
        os.path.join(RESULTS, parts[0], parts[1]))


def _experiments() -> list[str]:
    return sorted(f for f in os.listdir(EXPERIMENTS)
                  if f.endswith(".py") and f != "experiment_helpers.py")


@pytest.mark.parametrize("name", _experiments())
def test_each_experiment_names_the_result_it_produced(name):
    with open(os.path.join(EXPERIMENTS, name), encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    assert re.search(r"Results? it produced", doc), f"{name}: no 'Result it produced' in its docstring"
    paths = re.findall(r"``((?:h[12]00|cpu)-\d{4}-\d\d-\d\d/[^`]*)``", doc)
    if "not kept as a file" not in doc:
        assert paths, f"{name}: names no folder or file under bench/results/"
    for p in paths:
        assert result_exists(p), f"{name}: bench/results/{p} is missing"


@pytest.mark.parametrize("name", [n for n in _experiments() if n != "read_timeline.py"])
def test_each_experiment_runs_as_a_script(name):
    """``python bench/experiments/NAME.py --help``: its imports (the shared helper included)
    resolve when it runs as documented, from any directory. (read_timeline.py takes no options
    and needs CUDA.)"""
    out = subprocess.run([sys.executable, os.path.join(EXPERIMENTS, name), "--help"],
                         capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout


def test_every_run_folder_has_a_readme_and_no_stderr_copies():
    for machine in os.listdir(RESULTS):
        top = os.path.join(RESULTS, machine)
        if not os.path.isdir(top):
            continue
        loose = [f for f in os.listdir(top) if os.path.isfile(os.path.join(top, f))]
        assert loose == [], f"{machine}: files outside a run folder: {loose}"
        for run in os.listdir(top):
            assert os.path.isfile(os.path.join(top, run, "README.md")), f"{machine}/{run}"
    for dirpath, _, files in os.walk(RESULTS):
        assert not [f for f in files if f.endswith((".err", ".py"))], dirpath


# a file or folder the docs name: bench/x.py, tests/, docs/sglang.md... (not prose like gdskv/raw)
_PATH = re.compile(r"(?<![\w/.-])((?:bench|tests|docs|docker|examples|gdskv|kernels)/"
                   r"(?:[\w.-]+/)*(?:[\w-]+\.(?:py|sh|md|ini|txt|json|png|toml|log))?)(?![\w/-])")


@pytest.mark.parametrize("doc", ["README.md", "bench/README.md", "bench/RESULTS.md",
                                 "bench/results/README.md", "docker/README.md"]
                         + sorted("docs/" + f for f in os.listdir(os.path.join(ROOT, "docs"))
                                  if f.endswith(".md")))
def test_docs_name_paths_that_exist(doc):
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        text = f.read()
    missing = sorted(p for p in set(_PATH.findall(text))
                     if not os.path.exists(os.path.join(ROOT, p)))
    assert missing == [], f"{doc} names paths that do not exist: {missing}"


_RUN_PATH = re.compile(r"`((?:h[12]00|cpu)-\d{4}-\d\d-\d\d/[^`]*)`")


def test_results_md_names_a_run_folder_for_every_table_and_each_path_exists():
    with open(os.path.join(BENCH, "RESULTS.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    since_heading: list[str] = []
    for i, line in enumerate(lines):
        if line.startswith("#"):
            since_heading = []
        elif line.startswith("|") and not (i and lines[i - 1].startswith("|")):
            assert _RUN_PATH.search("\n".join(since_heading)), \
                f"RESULTS.md line {i + 1}: a table with no run folder named above it"
        since_heading.append(line)
    for p in _RUN_PATH.findall("\n".join(lines)):
        assert result_exists(p), f"RESULTS.md names bench/results/{p}"


_CODE_RESULT = re.compile(r"bench/results/([^\s`'\")]+)")


def test_code_comments_name_result_paths_that_exist():
    """Library and tool comments that cite a measurement point at a file that is still there."""
    missing = []
    for top in ("gdskv", "kernels", "bench", "tests"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            if dirpath.startswith(RESULTS):
                continue
            for f in files:
                if not f.endswith((".py", ".sh")):
                    continue
                with open(os.path.join(dirpath, f), encoding="utf-8") as fh:
                    for p in _CODE_RESULT.findall(fh.read()):
                        p = p.rstrip(".,;:")
                        if re.match(r"(?:h[12]00|cpu)-\d{4}-", p) and not result_exists(p):
                            missing.append(f"{os.path.relpath(os.path.join(dirpath, f), ROOT)}: {p}")
    assert missing == []


def test_call_profile_plain_verify_runs():
    """``call_profile.py --plain-verify`` patches the tier's GPU verdict step; the patch must
    still fit the method it replaces (it broke once when the method gained an argument)."""
    out = subprocess.run([sys.executable, os.path.join(EXPERIMENTS, "call_profile.py"),
                          "--plain-verify", "--phases", "--backend", "posix", "--size", "4M",
                          "--bs", "2M", "--top", "1"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "write" in out.stdout and "read" in out.stdout


@pytest.mark.parametrize("script", sorted(f for f in os.listdir(os.path.join(BENCH, "device"))
                                          if f.endswith(".sh")))
def test_device_scripts_parse(script):
    subprocess.run(["bash", "-n", os.path.join(BENCH, "device", script)], check=True)


def test_every_config_field_has_a_doc_and_help_env_lists_it(capsys):
    from gdskv.bench import cli

    fields = [f.name for f in dataclasses.fields(TierConfig)]
    assert sorted(FIELD_DOCS) == sorted(fields)
    assert all(FIELD_DOCS[name].strip() for name in fields)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help-env"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name in fields:
        line = next(l for l in out.splitlines() if l.split()[:1] == [f"GDSKV_{name.upper()}"])
        assert FIELD_DOCS[name] in line
    assert re.search(r"GDSKV_CAPACITY\s+16GiB", out) and re.search(r"GDSKV_SYNC\s+data", out)


def test_configuration_doc_lists_every_variable():
    with open(os.path.join(ROOT, "docs", "configuration.md"), encoding="utf-8") as f:
        listed = set(re.findall(r"^\| `(GDSKV_[A-Z_]+)` \|", f.read(), re.M))
    assert listed == {f"GDSKV_{f.name.upper()}" for f in dataclasses.fields(TierConfig)}
