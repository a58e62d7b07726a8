"""Host time of a 1-page put into a full store, where every put evicts a page (issue 14).

A tier on the host (POSIX backend, 1-layer 1-token pages: 4 KiB slots, so a store of many slots
fits in a small file) is filled to its last slot; then 1-page puts of new keys each evict the
least recently used page. Printed: the put's p50/p99/mean and, on a bare
:class:`gdskv.directory.PageDirectory` of the same size, the reservation's (where the eviction
happens). Until eviction kept a candidate queue, the reservation scanned every slot per put.

    python bench/experiments/full_store_put.py /dev/shm/fs --slots 262144

Result it produced: ``h200-2026-11-26/call-overhead-7/call10/full_store_put.txt`` (the host
of an H200 VM; before and after).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time


def _summary(name: str, seconds: list[float]) -> str:
    s = sorted(seconds)
    return (f"{name:34s} p50 {1e6 * statistics.median(s):9.1f} µs  p99 "
            f"{1e6 * s[int(0.99 * (len(s) - 1))]:9.1f} µs  mean {1e6 * sum(s) / len(s):9.1f} µs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("directory", help="scratch directory for the store (emptied)")
    ap.add_argument("--slots", type=int, default=262144, help="slots in the store")
    ap.add_argument("--puts", type=int, default=2000, help="1-page puts timed once it is full")
    args = ap.parse_args()

    import torch

    from gdskv.config import TierConfig
    from gdskv.directory import PageDirectory
    from gdskv.layout import KVLayout
    from gdskv.tier import Tier

    # the directory alone: a full one, then 1-key reservations (each evicts) and commits
    d = PageDirectory(args.slots)
    d.commit(d.reserve([f"k{i}" for i in range(args.slots)]).slots, [1] * args.slots)
    times = []
    for i in range(args.puts):
        t0 = time.perf_counter()
        res = d.reserve([f"x{i}"])
        times.append(time.perf_counter() - t0)
        d.commit(res.slots, [1])
    print(f"{args.slots} slots, {args.puts} 1-page calls into a full store")
    print(_summary("PageDirectory.reserve", times))

    shutil.rmtree(args.directory, ignore_errors=True)
    os.makedirs(args.directory)
    lay = KVLayout(num_layers=1, page_size=1, head_dim=64, kv_heads=1, dtype="bf16")
    cfg = TierConfig(directories=(args.directory,), capacity=args.slots * lay.slot_bytes,
                     backend="posix", staging_size=f"{1024 * lay.slot_bytes}")
    pool = tuple(torch.zeros(1, 1024, 1, 64, dtype=torch.bfloat16) for _ in range(2))
    with Tier(lay, cfg, device="cpu") as tier:
        slots_total = tier.store.num_slots
        batch = torch.arange(1024)
        for first in range(0, slots_total, 1024):
            n = min(1024, slots_total - first)
            assert all(tier.put([f"k{first + j}" for j in range(n)], pool, batch[:n]))
        one = torch.arange(1)
        times = []
        for i in range(args.puts):
            t0 = time.perf_counter()
            ok = tier.put([f"x{i}"], pool, one)
            times.append(time.perf_counter() - t0)
            assert ok == [True]
        assert tier.stats()["evictions"] >= args.puts
    print(_summary("Tier.put (POSIX, 4 KiB slots)", times))


if __name__ == "__main__":
    main()
