"""Lock convoys under the GIL: a CPU tier's 1-page restores from many threads with the data
path's locks as the C ``YieldingLock`` (what ships), a yielding lock written in Python (the
first version, ``--python-lock FILE``: a module defining ``YieldingLock``) and plain
``threading.Lock`` (what the data path falls back to without the extension).

Each kind runs in a process of its own (the locks are bound when gdskv is imported): a tier on
``--directory`` (tmpfs: the copies from the files' mappings keep the GIL, so the locks and the
Python are all there is), 16 pages of ``--page-size`` stored, then ``threads`` threads each
looping ``get_pages`` of one page for ``--seconds``; calls/s of all threads together.

    python bench/experiments/lock_convoy.py --directory /dev/shm --threads 1 4 \\
        [--python-lock old_yielding_lock.py] [--rounds 2] [--out result.json]

Result it produced: ``cpu-2026-11-28/yielding-lock/``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import importlib.util, json, shutil, sys, tempfile, threading, time, types
kind, lock_file, directory, page, threads, seconds = sys.argv[1:7]
page, threads, seconds = int(page), int(threads), float(seconds)
if kind != "native":  # before gdskv binds the name in its modules
    m = types.ModuleType("gdskv.yielding_lock")
    if kind == "python":
        spec = importlib.util.spec_from_file_location("old_lock", lock_file)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        m.YieldingLock = old.YieldingLock
    else:
        m.YieldingLock = threading.Lock
    m.IMPLEMENTATION, m.DEFAULT_YIELDS = kind, 0
    sys.modules["gdskv.yielding_lock"] = m
import torch
from gdskv.config import TierConfig
from gdskv.directory import YieldingLock
from gdskv.layout import BytePageLayout
from gdskv.tier import Tier
d = tempfile.mkdtemp(dir=directory)
lay = BytePageLayout(page_bytes=page, kind="bench/lock-convoy")
tier = Tier(lay, TierConfig.from_env(directories=(d,), capacity=64 * lay.slot_bytes,
                                     backend="posix"), device="cpu")
def aligned(n):
    t = torch.empty(n + 4096, dtype=torch.uint8)
    off = (-t.data_ptr()) % 4096
    return t[off:off + n]
src = [aligned(page) for _ in range(16)]
for i, s in enumerate(src):
    s.fill_(i)
keys = [f"k{i}" for i in range(16)]
assert all(tier.put_pages(keys, [[s] for s in src]))
counts, stop = [0] * threads, threading.Event()
def work(k):
    out, n = [[aligned(page)]], 0
    while not stop.is_set():
        assert tier.get_pages([keys[(k * 7 + n) % 16]], out)[0]
        n += 1
    counts[k] = n
pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
for t in pool:
    t.start()
time.sleep(seconds)
stop.set()
for t in pool:
    t.join()
tier.close()
shutil.rmtree(d)
print(json.dumps({"kind": kind, "lock": repr(YieldingLock), "threads": threads,
                  "calls_per_s": sum(counts) / seconds, "per_thread": counts}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--directory", default="/dev/shm", help="where the tiers' stores go")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--page-size", type=int, default=65536)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=2, help="rounds, the kinds alternating")
    ap.add_argument("--python-lock", metavar="FILE", help="a module with a Python "
                    "YieldingLock to compare (e.g. `git show 891993b:gdskv/yielding_lock.py`)")
    ap.add_argument("--out", help="write the runs here (JSON)")
    args = ap.parse_args()
    kinds = ["native", "plain"] + (["python"] if args.python_lock else [])
    runs = []
    for _ in range(args.rounds):
        for kind in kinds:
            for threads in args.threads:
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, kind, args.python_lock or "", args.directory,
                     str(args.page_size), str(threads), str(args.seconds)],
                    capture_output=True, text=True, check=True)
                run = json.loads(out.stdout.strip().splitlines()[-1])
                runs.append(run)
                print(f"{kind:7} threads={threads:2} {run['calls_per_s']:9.0f} calls/s",
                      flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"page_size": args.page_size, "directory": args.directory,
                       "cpus": os.cpu_count(), "runs": runs}, fh, indent=1)


if __name__ == "__main__":
    main()
