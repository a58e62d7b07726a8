"""Where a 1-page quick spill's time goes, part by part (issue 47).

A CPU tier on the posix backend, native page engine, pages as aligned host regions
(``put_pages``, as the engines' host pools call it), ``sync=data``, a store of 256 slots kept
full (every spill evicts one page, as a spill tier does in its steady state). Each part of
the call is wrapped in a timer: the tier's entry (``put_pages``), the quick spill's ``run``,
its slot reservation (``reserve_slots``: the directory's ``reserve`` and the journaling of the
evicted page), its ``_write`` (the frame of addresses, the page engine's ``page_sums`` and
``seal_slots``, the lost-file check, the write, the slab's sync, the COMMIT's encoding and
append) and the directory's commit. The wrappers cost about 0.3 µs each, counted in their
parents. Beside it: a raw ``pwritev`` + ``fdatasync`` of one slot in a file of its own in the
same directory, from the same regions. Medians of ``--calls`` calls, µs.

    python bench/experiments/quick_spill_parts.py --directory /dev/shm/qsp \\
        [--page-sizes 64KiB 2MiB] [--calls 3000] [--out parts.json]

Results it produced: ``h200-2026-11-28/one-append/``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import shutil
import statistics
import time

SLOTS = 256


def timed(times: dict, label: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            times[label].append(time.perf_counter_ns() - t0)
    return wrapper


def instrument(tier, times: dict) -> None:
    """Wrap the quick spill's parts of ``tier`` in timers (instance attributes, and the page
    engine's fields through a copy of its dataclass)."""
    import gdskv.quick_calls as quick_calls
    spill = tier._quick["put"]
    ctx = spill.ctx
    quick_calls.reserve_slots = timed(times, "reserve_slots", quick_calls.reserve_slots)
    for obj, names in ((ctx.directory, ("reserve", "commit")),
                       (ctx.persist, ("journal_evictions", "encode_commits", "journal_commits",
                                      "next_seqs")),
                       (ctx, ("lost_files",)), (ctx.backend, ("write_on_caller",)),
                       (ctx.store, ("sync",)), (spill, ("_frame", "_write", "run")),
                       (tier, ("put_pages",))):
        for name in names:
            if hasattr(obj, name):
                setattr(obj, name, timed(times, name, getattr(obj, name)))
    engine = spill.host_pages.engine
    spill.host_pages.engine = dataclasses.replace(engine, **{
        name: timed(times, name, getattr(engine, name)) for name in ("page_sums", "seal_slots")})


def aligned(nbytes: int):
    from gdskv.memory import alloc_host
    return alloc_host(nbytes, pin=False)


def raw_spills(directory: str, regions, slot_bytes: int, calls: int) -> float:
    """p50 µs of pwritev (a region, then the rest of the slot) + fdatasync of one slot."""
    import numpy as np
    page = regions[0].numel()
    tail = np.zeros(slot_bytes - page, np.uint8)
    views = [r.numpy() for r in regions]
    path = os.path.join(directory, "raw")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, SLOTS * slot_bytes)
        out = []
        for i in range(calls + 200):
            t0 = time.perf_counter_ns()
            os.pwritev(fd, [views[i % len(views)], tail], (i % SLOTS) * slot_bytes)
            os.fdatasync(fd)
            out.append(time.perf_counter_ns() - t0)
        return statistics.median(out[200:]) / 1e3
    finally:
        os.close(fd)
        os.unlink(path)


def measure(directory: str, page_bytes: int, calls: int) -> dict:
    import numpy as np

    from gdskv.config import TierConfig
    from gdskv.layout import BytePageLayout
    from gdskv.tier import Tier
    layout = BytePageLayout(page_bytes=page_bytes, kind="bench/quick-spill-parts")
    root = os.path.join(directory, f"qsp-{page_bytes}")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    rng = np.random.default_rng(page_bytes)
    regions = [aligned(page_bytes) for _ in range(8)]
    for r in regions:
        r.numpy()[:] = rng.integers(0, 256, page_bytes, dtype=np.uint8)
    cfg = TierConfig.from_env(directories=(root,), capacity=SLOTS * layout.slot_bytes,
                              backend="posix", native=True, sync="data")
    tier = Tier(layout, cfg, device="cpu")
    times: dict = collections.defaultdict(list)
    try:
        if "put" not in tier._quick:
            raise SystemExit(f"no quick spill here: {tier._quick_why_not}")
        for i in range(SLOTS + 200):  # fill the store: from here on every spill evicts
            assert tier.put_pages([f"warm{i}"], [[regions[i % 8]]])[0]
        instrument(tier, times)
        for i in range(calls):
            assert tier.put_pages([f"k{i}"], [[regions[i % 8]]])[0]
        parts = {name: {"per_call": len(v) / calls, "p50_us": statistics.median(v) / 1e3,
                        "mean_us": statistics.mean(v) / 1e3} for name, v in times.items()}
        raw = raw_spills(root, regions, layout.slot_bytes, calls)
        return {"page_bytes": page_bytes, "calls": calls, "parts": parts, "raw_p50_us": raw,
                "stats": {k: v for k, v in tier.stats().items()
                          if k in ("data_path", "page_engine")}}
    finally:
        tier.close()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--directory", required=True)
    ap.add_argument("--page-sizes", nargs="+", default=["64KiB", "2MiB"])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--out")
    args = ap.parse_args()
    os.makedirs(args.directory, exist_ok=True)
    results = []
    for size in args.page_sizes:
        from gdskv.config import parse_size
        res = measure(args.directory, parse_size(size), args.calls)
        results.append(res)
        print(f"== {size}: raw pwritev+fdatasync p50 {res['raw_p50_us']:.1f} us")
        for name, p in res["parts"].items():
            print(f"  {name:18s} {p['per_call']:.2f}/call  p50 {p['p50_us']:8.1f} us"
                  f"  mean {p['mean_us']:8.1f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
