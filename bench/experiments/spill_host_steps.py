"""Host time of a spill chunk's per-page bookkeeping at 1, 8 and 32 pages (issue 14).

A 128-page spill is four chunks of 32 pages (the default staging); with four such calls in
flight their threads take turns at the GIL between chunks, so every µs a chunk spends in
Python per page is a µs another call's next write waits. This times, one step at a time on a
real tier (CPU staging, posix backend, no write: the steps only), what a chunk does per page
besides its I/O:

- ``reserve``: ``PageDirectory.reserve`` of the chunk's keys;
- ``trailers``: their sequence numbers and slot trailers (``Tier._trailers``);
- ``commits``: their journal COMMITs encoded (done while the write runs);
- ``append``: the COMMITs appended to the journal (``sync=none`` here: no fdatasync);
- ``dcommit``: ``PageDirectory.commit`` (WRITING -> READY);

and the keys are then evicted, untimed. Medians over ``--calls`` chunks, µs. It runs on
whichever gdskv is imported: put another tree first on ``PYTHONPATH`` (or ``--tree DIR``) to
compare two.

    python bench/experiments/spill_host_steps.py [--tree .before] [--out steps.json]

Results it produced: ``cpu-2026-11-26/spill-host-steps/`` (the development machine, before
and after the COMMITs were encoded from columns and a batch commit took one numpy step).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import os
import shutil
import statistics
import sys
import tempfile
import time

STEPS = ("reserve", "trailers", "commits", "append", "dcommit")


def _import_tier(tree: str | None):
    """The Tier class and layout/config types, from ``tree`` when given (ahead of an editable
    install's finder, which would otherwise answer first)."""
    if tree:
        sys.meta_path = [m for m in sys.meta_path if "editable" not in repr(m).lower()]
        sys.path.insert(0, os.path.abspath(tree))
    import gdskv
    from gdskv.config import TierConfig
    from gdskv.layout import KVLayout
    from gdskv.tier import Tier
    return gdskv, Tier, TierConfig, KVLayout


def _commit_encoder(tier):
    """How this tree encodes a chunk's COMMITs: from ``1bb9b73`` on, ``Tier._commits`` encodes
    them from columns; before, it gave tuples to ``PersistentDirectory.encode_commits`` and
    needed the positions. (Found once, outside the timed steps.)"""
    positions = inspect.signature(tier._commits).parameters["positions"]
    if positions.default is not inspect.Parameter.empty:
        return tier._commits
    return lambda keys, chunk, sums, seqs: tier._persist.encode_commits(
        tier._commits(keys, chunk, sums, seqs, range(len(chunk))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", help="import gdskv from this folder (holding gdskv/)")
    ap.add_argument("--calls", type=int, default=400, help="chunks timed per size")
    ap.add_argument("--pages", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--directory", default=None, help="where the store goes (default: a temp "
                    "folder in /dev/shm where it exists)")
    ap.add_argument("--out", help="write the medians here as JSON too")
    args = ap.parse_args(argv)
    gdskv, Tier, TierConfig, KVLayout = _import_tier(args.tree)
    import json

    import numpy as np
    base = args.directory or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    d = tempfile.mkdtemp(prefix="gdskv-host-steps-", dir=base)
    # tiny pages: the steps are per page, not per byte
    layout = KVLayout(num_layers=2, page_size=16, head_dim=64, kv_heads=1, dtype="bf16")
    result = {"gdskv": os.path.dirname(gdskv.__file__), "calls": args.calls, "us": {}}
    try:
        with Tier(layout, TierConfig(directories=(d,), capacity=4096 * layout.slot_bytes,
                                     backend="posix", sync="none"), device="cpu") as tier:
            directory, made, encode_commits = tier.directory, 0, _commit_encoder(tier)
            for n in args.pages:  # (the first 20 chunks of each size: warm-up)
                times = {s: [] for s in STEPS}
                sums = np.zeros(n, dtype=np.uint64)
                for call in range(args.calls + 20):
                    made += 1
                    keys = [hashlib.sha256(f"{made}:{i}".encode()).hexdigest() for i in range(n)]
                    t = [time.perf_counter()]
                    chunk = list(enumerate(directory.reserve(keys).slots))
                    t.append(time.perf_counter())
                    seqs, _ = tier._trailers(keys, chunk, sums)
                    t.append(time.perf_counter())
                    commits = encode_commits(keys, chunk, sums, seqs)
                    t.append(time.perf_counter())
                    tier._persist.journal_commits(commits)
                    t.append(time.perf_counter())
                    directory.commit([s for _, s in chunk], sums, 3)
                    t.append(time.perf_counter())
                    tier.evict(keys)
                    if call >= 20:
                        for i, step in enumerate(STEPS):
                            times[step].append((t[i + 1] - t[i]) * 1e6)
                result["us"][n] = {s: round(statistics.median(v), 2) for s, v in times.items()}
    finally:
        shutil.rmtree(d, ignore_errors=True)
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text)
    for n, steps in result["us"].items():
        print(f"{n:>3} pages: " + "  ".join(f"{s} {v:.1f}" for s, v in steps.items())
              + f"  total {sum(steps.values()):.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
