"""Where a gdskv call's time goes inside `lmcache bench l2` (issue 47): the script
``lmcache_l2.py`` run in this process with the adapter's and the tier's steps timed.

Timed, each call: the adapter's ``submit_load_task`` (until it returns), a load's submit to
its completion callback (``_load_done``) and to the bench's ``query_load_result`` that finds
it done, the quick restore and quick spill on the tier's worker thread, the posix backend's
``run_split`` and each of its parts. Prints ``PROBE <step> n= median= p90=`` lines at the end
(all the cells of the run together: run one cell a process).

    python bench/experiments/lmcache_probe.py bench/experiments/lmcache_l2.py --in-process \
        --batch-mb 16 --rounds 10 --media /dev/shm --sizes-kb 64 --in-flight 1 \
        --only-adapters gdskv "fs_native odirect" --out OUT

Results it produced: ``h200-2026-11-28/lmcache-probe/``.
"""
from __future__ import annotations

import argparse
import collections
import runpy
import statistics
import sys
import time

#: step -> seconds each (``parts``: counts)
T: dict[str, list[float]] = collections.defaultdict(list)
clock = time.perf_counter


def instrument() -> None:
    """Time the adapter's and the tier's steps (imports lmcache: run in its venv)."""
    from gdskv import quick_calls
    from gdskv.adapters import lmcache as adapter
    from gdskv.backends import posix

    marks: dict = {}  # load task -> its submit's start
    cls = adapter.GdskvL2Adapter
    orig_submit, orig_done, orig_query = cls.submit_load_task, cls._load_done, \
        cls.query_load_result
    orig_split = posix.PosixBackend.run_split

    def submit(self, keys, objects):
        t0 = clock()
        task = orig_submit(self, keys, objects)
        T["submit"].append(clock() - t0)
        marks[task] = t0
        return task

    def done(self, task, keys, fut):
        t0 = clock()
        if task in marks:
            T["submit->done"].append(t0 - marks[task])
        orig_done(self, task, keys, fut)
        T["done"].append(clock() - t0)

    def query(self, task):
        r = orig_query(self, task)
        if r is not None and task in marks:
            T["submit->query"].append(clock() - marks.pop(task))
        return r

    def split(self, fn, count, nbytes):
        def part(a, b):
            t0 = clock()
            try:
                return fn(a, b)
            finally:
                T["part"].append(clock() - t0)
        t0 = clock()
        out = orig_split(self, part, count, nbytes)
        T["run_split"].append(clock() - t0)
        T["parts"].append(len(out))
        return out

    def timed(owner, name: str, label: str) -> None:
        f = getattr(owner, name)

        def call(self, *a, **k):
            t0 = clock()
            try:
                return f(self, *a, **k)
            finally:
                T[label].append(clock() - t0)
        setattr(owner, name, call)

    cls.submit_load_task, cls._load_done, cls.query_load_result = submit, done, query
    posix.PosixBackend.run_split = split
    timed(quick_calls.QuickRestore, "run", "quick restore")
    timed(quick_calls.QuickSpill, "run", "quick spill")


def report() -> None:
    for k, v in T.items():
        if k == "parts":
            print(f"PROBE {k:14s} n={len(v):5d} median={statistics.median(v):g}", flush=True)
        elif v:
            print(f"PROBE {k:14s} n={len(v):5d} median={statistics.median(v) * 1e3:8.3f} ms "
                  f"p90={sorted(v)[int(len(v) * 0.9)] * 1e3:8.3f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("script", help="the bench script to run (bench/experiments/lmcache_l2.py)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = p.parse_args()
    instrument()
    sys.argv = [args.script, *args.args]
    try:
        runpy.run_path(args.script, run_name="__main__")
    finally:
        report()


if __name__ == "__main__":
    main()
