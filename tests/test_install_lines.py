"""Every ``pip install`` line in README.md and docs/*.md installs gdskv in a form a test proves
works, with brackets quoted (zsh and others expand ``gdskv[gpu]``). gdskv is not on the package
index, so a line that asks the index for it fails for every user (docs/vllm.md once did).

The forms and what proves each:

- ``-e <clone>[extras]``: an editable install of a clone, what ``tests/run.sh`` and the README's
  main command do; every test run imports gdskv that way (tests/test_packaging.py);
- ``<clone>/dist/gdskv-<version>-cp311-abi3-linux_x86_64.whl[extras]``: the wheel ``python -m build <clone>``
  makes, under exactly that name, installed into a fresh venv where it runs the README's main
  command (tests/test_distribution.py);
- ``<clone>/integrations/light_mem``: built and installed beside that wheel (same file);
- any other distribution by name (``torch==2.13.0``, ``build``), never gdskv's own.

``<clone>`` is ``.`` or a path ending in ``/gdskv``; extras are pyproject's.
"""

from __future__ import annotations

import glob
import os
import re
import shlex

import pytest
from packaging.requirements import InvalidRequirement, Requirement  # pytest's own dependency
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib", reason="needs Python 3.11+ (tomllib)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                              for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
CLONE = r"(?:\.|\S*/gdskv)"
OWN = {"gdskv", "gdskv-light-mem"}


def _project() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def built_wheel_name() -> str:
    """The file name ``python -m build`` gives gdskv's wheel, as the docs install it."""
    # one abi3 wheel (the C page engine, gdskv/native) for CPython 3.11 and later, tagged with
    # the platform it was built on: linux_x86_64 on the machines the docs were checked on
    return f"gdskv-{_project()['version']}-cp311-abi3-linux_x86_64.whl"


def _install_lines() -> list[tuple[str, str]]:
    """(where, what follows ``pip install``) for every install in the docs, up to the end of
    the command: a closing backtick, ``&&``, ``;`` or a ``#`` comment."""
    found = []
    for doc in DOCS:
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                for m in re.finditer(r"\bpip3? install\b", line):
                    args = re.split(r"`|&&|;|\s#", line[m.end():], maxsplit=1)[0]
                    found.append((f"{doc}:{n}", args.strip()))
    return found


def _form(word: str, editable: bool) -> str | None:
    """Which proven form an install argument is (as the shell passes it), or None."""
    m = re.fullmatch(r"([^\[\]]+)(?:\[([\w,-]+)\])?", word)
    if not m:
        return None
    target, extras = m.group(1), m.group(2)
    if extras and not set(extras.split(",")) <= set(_project()["optional-dependencies"]):
        return None
    if editable:
        return "editable clone" if re.fullmatch(CLONE, target) else None
    if re.fullmatch(rf"{CLONE}/dist/{re.escape(built_wheel_name())}", target):
        return "built wheel"
    if re.fullmatch(rf"{CLONE}/integrations/light_mem", target) and not extras:
        return "light_mem folder"
    try:
        req = Requirement(word)
    except InvalidRequirement:  # a path, and none of the above
        return None
    return None if canonicalize_name(req.name) in OWN else "another distribution"


def _problems(args: str) -> list[str]:
    problems, editable = [], False
    for raw in args.split():
        if raw == "-e" or raw == "--editable":
            editable = True
            continue
        if raw.startswith("-"):  # -q, --upgrade, --no-deps: options that take no value
            continue
        (word,) = shlex.split(raw)
        if "[" in word and raw[0] not in "'\"":
            problems.append(f"{raw}: brackets unquoted (zsh expands them)")
        elif _form(word, editable) is None:
            problems.append(f"{raw}: not an install form a test proves (see this file's "
                            "docstring)")
        editable = False
    return problems


def test_the_docs_have_install_lines_to_check():
    where = {w.split(":")[0] for w, _ in _install_lines()}
    assert {"README.md", "docs/sglang.md", "docs/vllm.md", "docs/lightllm.md"} <= where, where


@pytest.mark.parametrize("where, args", _install_lines())
def test_every_install_line_is_a_proven_form(where, args):
    assert _problems(args) == [], f"{where}: pip install {args}"


@pytest.mark.parametrize("args, ok", [
    ("gdskv[gpu]", False), ("'gdskv[gpu]'", False), ("gdskv", False), ("-e gdskv", False),
    ("-e '/path/to/gdskv[gpu]'", True), ("-e /path/to/gdskv[gpu]", False),
    ("-q torch==2.13.0 -e '.[bench]'", True), ("-e '.[nosuchextra]'", False),
    (f"'/path/to/gdskv/dist/{built_wheel_name()}[gpu]'", True),
    ("'/path/to/gdskv/dist/gdskv-9.9.9-cp311-abi3-linux_x86_64.whl[gpu]'", False),
    ("'/path/to/gdskv/dist/gdskv-0.1.0-py3-none-any.whl[gpu]'", False),
    ("/path/to/gdskv/integrations/light_mem", True), ("gdskv-light-mem", False),
    ("/path/to/gdskv", False), ("build", True),
])
def test_the_checker_tells_proven_forms_from_others(args, ok):
    assert (_problems(args) == []) is ok, _problems(args)
