"""What the probes in bench/experiments/ share: one copy of each helper they used to repeat.

The probes run as scripts (``python bench/experiments/NAME.py``), so Python puts this folder on
``sys.path`` and ``import experiment_helpers`` finds this file; the tests reach the probes
through pytest's ``pythonpath`` setting in pyproject.toml.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from types import ModuleType

from gdskv.backends.base import SlabFile
from gdskv.bench.cache import drop_page_cache
from gdskv.bench.presets import get_preset
from gdskv.layout import KVLayout

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def drop_all_caches() -> bool:
    """Drop the whole machine's page cache (root only; the probes ran on a machine of their
    own). True if it was dropped."""
    return drop_page_cache([], machine_wide=True)["drop_caches"]


def preallocate(path: str, size: int) -> None:
    """Create ``path`` (0600) with ``size`` bytes reserved on disk."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


def open_slab(path: str, size: int, index: int) -> SlabFile:
    """A preallocated slab file as the store opens one: O_DIRECT where the file system takes it,
    buffered otherwise (``SlabFile.direct`` says which)."""
    preallocate(path, size)
    try:
        return SlabFile(index, path, os.open(path, os.O_RDWR | os.O_DIRECT), True, size)
    except OSError:
        return SlabFile(index, path, os.open(path, os.O_RDWR), False, size)


def geometry(name: str) -> KVLayout:
    """``<preset>-p<page tokens>`` (``llama3-8b-p16``) as a layout, from gdskv-bench's presets."""
    model, sep, tokens = name.rpartition("-p")
    if not sep or not tokens.isdigit():
        raise ValueError(f"geometry {name!r}: expected <preset>-p<page tokens>, e.g. "
                         "llama3-8b-p16")
    return get_preset(model).layout(int(tokens))


#: the three geometries every probe measured: Llama-3-8B at 16/64-token pages, DeepSeek-V3 MLA
GEOMETRIES: dict[str, KVLayout] = {n: geometry(n) for n in
                                   ("llama3-8b-p16", "llama3-8b-p64", "deepseek-v3-p64")}


def load_test_helper(name: str) -> ModuleType:
    """Import ``tests/<name>.py`` (a helper the tests own, e.g. ``sglang_pools``) by its path."""
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(REPO, "tests", name + ".py")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or not os.path.isfile(path):
        raise ImportError(f"test helper {name!r} not found at {path} (run from a clone)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def print_result(result: dict, out: str | None, summary: str) -> None:
    """A probe's ending: its JSON result, also written to ``out`` when given, then the short
    summary (last, so it is what a device call's output tail shows)."""
    text = json.dumps(result, indent=1)
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text)
    print(summary)
