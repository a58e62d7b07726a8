"""Run gdskv-bench from a given source tree, whichever gdskv the interpreter has installed.

    python bench/experiments/tree_bench.py [--no-hicachefile] TREE [gdskv-bench options...]

TREE is a checkout, or an older commit extracted with ``git archive`` (its native page engine
built in place with ``python setup.py build_ext --inplace``, where it has one). ``gdskv``,
``gdskv.kernels`` and ``gdskv.bench`` are imported from TREE, mapped as pyproject.toml's
package-dir maps them on install (``kernels/`` and ``bench/`` sit at the top level), ahead of an
editable install of another tree: a plain ``PYTHONPATH=TREE`` would take ``gdskv`` from TREE
but ``gdskv.kernels`` from the installed tree. So a before/after pair runs in one process
environment (the GPU machine's, where ``bench/device/device_check.sh`` installs the current tree
editable).

The first stderr line, ``tree_bench: {...}`` (JSON), names the files imported and the native
engine's state, so a caller can check which tree ran. ``--no-hicachefile`` keeps ``--compare``
to gdskv and raw where sglang is installed (a ``None`` in ``sys.modules`` makes its import fail,
which gdskv-bench reports as "hicachefile skipped").

Results it produced: through ``concurrency_matrix.py --tree``, the before/after tables of
``h100-2026-11-27/concurrency/``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys

#: package -> folder of the tree, as pyproject.toml's ``package-dir``
PACKAGE_DIRS = {"gdskv": "gdskv", "gdskv.kernels": "kernels", "gdskv.bench": "bench"}


class TreeFinder(importlib.abc.MetaPathFinder):
    """Answers for every ``gdskv`` module: the three mapped packages from their folders, any
    other from its parent's ``__path__`` (the tree's), and a module the tree lacks is missing,
    rather than found by an installed tree's finder further down ``sys.meta_path``."""

    def __init__(self, tree: str) -> None:
        self.tree = tree
        self.folders = {name: os.path.join(tree, sub) for name, sub in PACKAGE_DIRS.items()}

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "gdskv" and not fullname.startswith("gdskv."):
            return None
        folder = self.folders.get(fullname)
        if folder is not None:
            return importlib.util.spec_from_file_location(
                fullname, os.path.join(folder, "__init__.py"),
                submodule_search_locations=[folder])
        parent = sys.modules[fullname.rpartition(".")[0]]  # imported first, by importlib
        spec = importlib.machinery.PathFinder.find_spec(fullname, parent.__path__)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {fullname!r} in {self.tree}",
                                      name=fullname)
        return spec


def native_state() -> str:
    """The tree's native page engine: loaded (from which file), failed to load, or absent."""
    try:
        native = importlib.import_module("gdskv.native")
    except ModuleNotFoundError:
        return "absent (this tree has no gdskv.native)"
    if getattr(native, "NATIVE", None) is not None:
        return f"loaded from {native._pages.__file__}"
    return f"not loaded: {getattr(native, 'LOAD_ERROR', '?')}"


def main(argv: list[str]) -> int:
    no_hicachefile = bool(argv) and argv[0] == "--no-hicachefile"
    if no_hicachefile:
        argv = argv[1:]
    usage = "usage: tree_bench.py [--no-hicachefile] TREE [gdskv-bench options...]"
    if argv and argv[0] in ("-h", "--help"):
        print(usage + "\n\n" + __doc__.split("\n\n", 2)[2].strip())
        return 0
    if not argv:
        print(usage, file=sys.stderr)
        return 2
    tree, bench_args = os.path.realpath(argv[0]), argv[1:]
    missing = [sub for sub in PACKAGE_DIRS.values()
               if not os.path.isfile(os.path.join(tree, sub, "__init__.py"))]
    if missing:
        print(f"tree_bench: {tree} is not a gdskv source tree (no {', '.join(missing)} "
              "package)", file=sys.stderr)
        return 2
    # this script's folder (Python's sys.path[0]) holds nothing gdskv-bench should import
    here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != here]
    sys.meta_path.insert(0, TreeFinder(tree))
    if no_hicachefile:
        sys.modules["sglang"] = None  # type: ignore[assignment]
    import gdskv
    import gdskv.bench.cli
    print("tree_bench: " + json.dumps({
        "tree": tree, "gdskv": gdskv.__file__, "bench": gdskv.bench.__file__,
        # where an import of gdskv.kernels would come from (found, not imported: triton)
        "kernels": importlib.util.find_spec("gdskv.kernels").origin, "native": native_state()}),
        file=sys.stderr, flush=True)
    return gdskv.bench.cli.main(bench_args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
