"""The host data path on its two page engines against raw preadv/pwritev threads (issue 47).

A CPU tier on the posix backend, pages as host regions (``put_pages``/``get_pages``, as the
engines' host pools call it), one store per directory and page size. For each thread count:

- ``restore``: every thread loops 1-page ``get_pages`` over 128 stored pages for ``--seconds``;
  ``spill``: every thread loops 1-page ``put_pages`` of new keys (``sync=data``: an fdatasync
  of the slab file and the journal per call; LRU evicts once the store is full);
- ``native`` / ``python``: the same tier with ``native=true`` / ``false`` (the C extension, or
  ``os.preadv``/``pwritev`` and the crc32c package);
- ``raw``: the same threads with ``os.preadv`` of one stored slot (the tier's files, its
  O_DIRECT flag) / ``os.pwritev`` of one slot then ``os.fdatasync`` (a file of its own beside
  the store); ``engine``: the native engine called directly, no tier (read + CRC-32C check /
  CRC-32C + write + fdatasync): the ceiling of a call that does a page's work in C. Both move
  the same memory as the tier's calls: the payload into the thread's 8 rotating regions (from
  the 128 source pages), the slot's rest into a row of the thread's own. (Before 2026-11-28 a
  raw thread read and wrote one slot-sized buffer of its own, hot in the cache: on the
  development machine's slow memory that flattered raw at 2 MiB.)

Each number is the aggregate pages/s of all threads (and each thread's p50 call time), the
median of ``--rounds`` rounds that take the kinds in a rotating order. Then ``big``: one
thread restores all 128 pages in one ``get_pages`` call, against raw ``preadv`` of the same
slots spread over ``io_threads`` threads, and against one native engine call reading and
checking them all on the calling thread (``engine_one_call``: what the posix pool's threads
add or cost), GB/s. Also the CRC-32C rate of one core (thread CPU
time, 2 MiB buffer): the native engine, the crc32c package, xxh3.

    python bench/experiments/host_page_engine.py --dirs /dev/shm/hpe [/mnt/nvme/hpe] \\
        [--threads 1 2] [--page-sizes 64KiB 256KiB 2MiB] [--seconds 1] [--rounds 3] \\
        [--out result.json]
    python bench/experiments/host_page_engine.py --dirs /dev/shm/hpe --page-sizes 64KiB \
        --profile profile.txt     # where a 1-page call's host time goes (cProfile)

``--hold-gil-below BYTES`` sets the native engine's bound under which checksums and copies
from mappings keep the GIL (``docs/native.md``, "The GIL"); each JSON records the bound.

Results it produced: ``cpu-2026-11-27/native/``, ``h100-2026-11-27/native/``,
``h100-2026-11-28/quick-calls/``, ``h200-2026-11-28/many-threads/`` and
``h200-2026-11-28/quick-reader/``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import threading
import time

KINDS = ("raw", "engine", "native", "python")
PRELOAD = 128


def parse_size(text: str) -> int:
    from gdskv.config import parse_size as parse
    return parse(text, what="page size")


def crc_rates() -> dict:
    """GB/s of one core (thread CPU time) over a 2 MiB buffer, hot in cache."""
    import crc32c
    import numpy as np
    import xxhash

    from gdskv import native
    buf = np.random.default_rng(0).integers(0, 256, 2 << 20, dtype=np.uint8)
    fns = {"crc32c package": crc32c.crc32c, "xxh3 (xxhash)": xxhash.xxh3_64_intdigest}
    if native.NATIVE is not None:
        fns = {f"native ({native.NATIVE.checksum})": native.NATIVE.crc32c, **fns}
    out = {}
    for name, fn in fns.items():
        best = 0.0
        for _ in range(5):
            t0 = time.thread_time()
            for _ in range(200):
                fn(buf)
            best = max(best, 200 * len(buf) / (time.thread_time() - t0) / 1e9)
        out[name] = round(best, 2)
    return out


def aligned(nbytes: int):
    from gdskv.memory import alloc_host
    return alloc_host(nbytes, pin=False)


def run_threads(threads: int, seconds: float, body) -> dict:
    """``body(thread_index, deadline)`` on ``threads`` threads started together; each returns
    its call times. Aggregate calls/s and the median of the threads' p50s."""
    times: list[list[float]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []
    start = threading.Barrier(threads + 1)
    deadline = [0.0]

    def worker(k: int) -> None:
        start.wait()
        try:
            times[k] = body(k, deadline[0])
        except BaseException as exc:  # noqa: BLE001 - raised in the main thread below
            errors.append(exc)

    pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    deadline[0] = time.perf_counter() + seconds
    start.wait()
    t0 = time.perf_counter()
    for t in pool:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    calls = sum(len(t) for t in times)
    return {"pages_per_s": calls / wall,
            "p50_us": statistics.median(statistics.median(t) for t in times if t) * 1e6}


def timed_loop(deadline: float, call) -> list[float]:
    out = []
    clock = time.perf_counter
    i = 0
    while True:
        t0 = clock()
        if t0 > deadline:
            return out
        call(i)
        out.append(clock() - t0)
        i += 1


class Cell:
    """One directory and page size: a store for each path, a raw file, the stored pages."""

    def __init__(self, directory: str, page_bytes: int, args) -> None:
        import numpy as np

        from gdskv.layout import BytePageLayout
        self.args = args
        self.layout = BytePageLayout(page_bytes=page_bytes, kind="bench/host-page-engine")
        self.root = os.path.join(directory, f"hpe-{page_bytes}")
        shutil.rmtree(self.root, ignore_errors=True)
        os.makedirs(self.root)
        self.capacity = 2 * PRELOAD * self.layout.slot_bytes
        rng = np.random.default_rng(page_bytes)
        self.src = []
        for _ in range(PRELOAD):
            t = aligned(page_bytes)
            t.numpy()[:] = rng.integers(0, 256, page_bytes, dtype=np.uint8)
            self.src.append(t)
        self.keys = [f"p{i}" for i in range(PRELOAD)]
        self.dst = {}  # per thread: its destination regions
        self.spills = 0

    def tier(self, path: str):
        from gdskv.config import TierConfig
        from gdskv.tier import Tier
        d = os.path.join(self.root, path)
        os.makedirs(d, exist_ok=True)
        cfg = TierConfig.from_env(directories=(d,), capacity=self.capacity, backend="posix",
                                  native=path == "native")
        tier = Tier(self.layout, cfg, device="cpu")
        if not tier.directory.contains(self.keys[-1]):
            assert all(tier.put_pages(self.keys, [[s] for s in self.src]))
        return tier

    def regions(self, k: int):
        if k not in self.dst:
            self.dst[k] = [aligned(self.layout.page_bytes) for _ in range(8)]
        return self.dst[k]

    # -- the kinds --------------------------------------------------------------------------
    def gdskv(self, tier, op: str, threads: int) -> dict:
        def restore(k, deadline):
            out = self.regions(k)

            def call(i):
                if not tier.get_pages([self.keys[(k * 17 + i) % PRELOAD]], [[out[i % 8]]])[0]:
                    raise AssertionError(f"restore missed {self.keys[(k * 17 + i) % PRELOAD]}")
            return timed_loop(deadline, call)

        def spill(k, deadline):
            tag = f"s{self.spills}-{k}-"

            def call(i):
                if not tier.put_pages([f"{tag}{i}"], [[self.src[(k + i) % PRELOAD]]])[0]:
                    raise AssertionError("spill not stored")
            return timed_loop(deadline, call)

        self.spills += 1
        return run_threads(threads, self.args.seconds, restore if op == "restore" else spill)

    def raw(self, tier, op: str, threads: int, engine: bool) -> dict:
        import numpy as np

        from gdskv import native
        slot = self.layout.slot_bytes
        files = tier.store.files
        where = [tier.store.location(tier.directory._index[k]) for k in self.keys] \
            if op == "restore" else []
        flags = os.O_DIRECT if files[0].direct else 0
        fds = [os.open(f.path, os.O_RDONLY | flags) for f in files]
        raw_path = os.path.join(self.root, "raw.bin")
        with open(raw_path, "wb") as fh:
            fh.truncate(threads * 8 * slot)
        wfd = os.open(raw_path, os.O_RDWR | flags)
        page = self.layout.page_bytes
        # the same memory as the tier's calls: a page's payload goes to (comes from) the
        # thread's 8 rotating regions (the 128 source pages), the slot's rest to (from) a row of
        # the thread's own -- not one buffer read again and again, hot in the cache
        dst = {k: [r.numpy() for r in self.regions(k)] for k in range(threads)}
        src = [s.numpy() for s in self.src]
        rest = {k: aligned(slot - page).numpy() for k in range(threads)}
        eng = native.NATIVE
        want = np.array([eng.crc32c(s.numpy()) for s in self.src], np.uint64) if engine else None

        def read_call(k, i):
            j = (k * 17 + i) % PRELOAD
            f, off = where[j]
            memory = [dst[k][i % 8], rest[k]]
            if not engine:
                return os.preadv(fds[f], memory, off)
            res, sums, status = np.empty((2, 2), np.int64), np.empty(1, np.uint64), \
                np.empty(1, np.uint8)
            eng.read_pages(np.array([[fds[f], off, page], [fds[f], off + page, slot - page]],
                                    np.int64), memory, res, slot, page, want[j:j + 1], sums,
                           status, 0)
            assert status[0] == 0 and not res[:, 1].any()

        def write_call(k, i):
            off = (k * 8 + i % 8) * slot
            memory = [src[(k + i) % PRELOAD], rest[k]]
            if engine:
                sums, res = np.empty(1, np.uint64), np.empty((2, 2), np.int64)
                eng.page_sums(memory[:1], page, page, sums)
                eng.write_pages(np.array([[wfd, off, page], [wfd, off + page, slot - page]],
                                         np.int64), memory, res)
            else:
                os.pwritev(wfd, memory, off)
            os.fdatasync(wfd)

        call = read_call if op == "restore" else write_call
        try:
            return run_threads(threads, self.args.seconds,
                               lambda k, deadline: timed_loop(deadline, lambda i: call(k, i)))
        finally:
            for fd in fds + [wfd]:
                os.close(fd)

    def big(self, tier, raw: bool, one_call: bool = False) -> dict:
        """One 128-page restore (best of 5), or the same slots read raw on io_threads threads,
        or (``one_call``) read and checked in one native engine call on this thread."""
        import numpy as np

        from gdskv import native
        slot = self.layout.slot_bytes
        out = [aligned(self.layout.page_bytes) for _ in range(PRELOAD)]
        best = float("inf")
        if one_call:
            files = tier.store.files
            flags = os.O_DIRECT if files[0].direct else 0
            fds = [os.open(f.path, os.O_RDONLY | flags) for f in files]
            where = [tier.store.location(tier.directory._index[k]) for k in self.keys]
            order = sorted(range(PRELOAD), key=lambda j: where[j])  # adjacent slots coalesce
            segs = np.array([(fds[where[j][0]], where[j][1], slot) for j in order], np.int64)
            bufs = [aligned(slot).numpy() for _ in range(PRELOAD)]
            eng = native.NATIVE
            want = np.array([eng.crc32c(self.src[j].numpy()) for j in order], np.uint64)
            res = np.empty((PRELOAD, 2), np.int64)
            sums, status = np.empty(PRELOAD, np.uint64), np.empty(PRELOAD, np.uint8)
            for _ in range(5):
                t0 = time.perf_counter()
                eng.read_pages(segs, bufs, res, slot, self.layout.page_bytes, want, sums, status,
                               0)
                best = min(best, time.perf_counter() - t0)
                assert not status.any()
            for fd in fds:
                os.close(fd)
        elif raw:
            files = tier.store.files
            flags = os.O_DIRECT if files[0].direct else 0
            fds = [os.open(f.path, os.O_RDONLY | flags) for f in files]
            where = [tier.store.location(tier.directory._index[k]) for k in self.keys]
            bufs = [aligned(slot).numpy() for _ in range(PRELOAD)]
            n = tier.config.io_threads

            def share(k):
                for j in range(k, PRELOAD, n):
                    f, off = where[j]
                    os.preadv(fds[f], [bufs[j]], off)
            for _ in range(5):
                pool = [threading.Thread(target=share, args=(k,)) for k in range(n)]
                t0 = time.perf_counter()
                for t in pool:
                    t.start()
                for t in pool:
                    t.join()
                best = min(best, time.perf_counter() - t0)
            for fd in fds:
                os.close(fd)
        else:
            for _ in range(5):
                t0 = time.perf_counter()
                assert all(tier.get_pages(self.keys, [[o] for o in out]))
                best = min(best, time.perf_counter() - t0)
            assert all(bool((o == s).all()) for o, s in zip(out, self.src))
        return {"GBps": PRELOAD * self.layout.page_bytes / best / 1e9, "ms": best * 1e3}


def profile(args) -> str:
    """cProfile of 2000 1-page restores and 2000 1-page spills on a native tier (the first
    directory and page size): where a call's host time goes."""
    import cProfile
    import io
    import pstats
    cell = Cell(args.dirs[0], parse_size(args.page_sizes[0]), args)
    tier = cell.tier("native")
    out = io.StringIO()
    try:
        dst = cell.regions(0)
        calls = {"restore": lambda i: tier.get_pages([cell.keys[i % PRELOAD]], [[dst[i % 8]]]),
                 "spill": lambda i: tier.put_pages([f"prof{i}"], [[cell.src[i % PRELOAD]]])}
        for op, call in calls.items():
            for i in range(200):  # warm
                call(i + 10_000)
            prof = cProfile.Profile()
            prof.enable()
            for i in range(2000):
                call(i)
            prof.disable()
            out.write(f"== 2000 1-page {op}s, {args.page_sizes[0]} pages, native\n")
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    finally:
        tier.close()
        shutil.rmtree(cell.root, ignore_errors=True)
    return out.getvalue()


def measure(args) -> dict:
    from gdskv import native
    import gdskv
    if args.hold_gil_below is not None:
        if native.NATIVE is None or not hasattr(native._pages, "hold_gil_below"):
            raise SystemExit("--hold-gil-below: this tree's native engine has no such bound")
        native._pages.hold_gil_below(args.hold_gil_below)
    result = {"gdskv": os.path.dirname(gdskv.__file__),
              "hold_gil_below": native._pages.hold_gil_below()
              if native.NATIVE is not None and hasattr(native._pages, "hold_gil_below") else None,
              "threads": args.threads, "page_sizes": args.page_sizes, "dirs": args.dirs,
              "seconds": args.seconds, "rounds": args.rounds, "cpus": os.cpu_count(),
              "loadavg_start": os.getloadavg(), "native": native.engine().describe(),
              "crc_GBps_one_core": crc_rates(), "cells": [], "big": []}
    for directory in args.dirs:
        for size in args.page_sizes:
            cell = Cell(directory, parse_size(size), args)
            tiers = {p: cell.tier(p) for p in ("native", "python")}
            kinds = tuple(k for k in KINDS if (k in args.kinds or k == "raw")
                          and (k != "engine" or native.NATIVE is not None))
            try:
                # (in this order: spills evict the stored pages)
                for op in (o for o in ("restore", "big", "spill") if o in args.ops):
                    if op == "big":
                        big = {"raw": cell.big(tiers["native"], True),
                               **{p: cell.big(tiers[p], False) for p in ("native", "python")}}
                        if native.NATIVE is not None:
                            big["engine_one_call"] = cell.big(tiers["native"], False, True)
                        result["big"].append({"dir": directory, "pages": PRELOAD,
                                              "page_bytes": cell.layout.page_bytes, **big})
                        print(f"{directory} {size:>7} 128-page restore GB/s: " + ", ".join(
                            f"{k} {v['GBps']:.2f}" for k, v in big.items()), flush=True)
                        continue
                    for threads in args.threads:
                        rounds: dict[str, list] = {k: [] for k in kinds}
                        for r in range(args.rounds):
                            n = r % len(kinds)
                            for kind in kinds[n:] + kinds[:n]:
                                if kind in ("raw", "engine"):
                                    got = cell.raw(tiers["native"], op, threads, kind == "engine")
                                else:
                                    got = cell.gdskv(tiers[kind], op, threads)
                                rounds[kind].append(got)
                        for kind, got in rounds.items():
                            row = {"dir": directory, "page_bytes": cell.layout.page_bytes,
                                   "op": op, "threads": threads, "kind": kind,
                                   "pages_per_s": statistics.median(g["pages_per_s"] for g in got),
                                   "p50_us": statistics.median(g["p50_us"] for g in got),
                                   "rounds": got}
                            result["cells"].append(row)
                            print(f"{directory} {size:>7} {op:7} t={threads} {kind:6} "
                                  f"{row['pages_per_s']:10.0f} pages/s  p50 {row['p50_us']:8.1f} "
                                  "us", flush=True)
            finally:
                for t in tiers.values():
                    t.close()
                shutil.rmtree(cell.root, ignore_errors=True)
    result["loadavg_end"] = os.getloadavg()
    return result


def table(result: dict) -> str:
    """Ratios to raw, per cell: gdskv native and python, the engine alone."""
    lines = ["dir | page | op | threads | raw pages/s | engine | native | python "
             "(x raw) | p50 native/raw | p50 python/raw"]
    rows = {}
    for c in result["cells"]:
        rows.setdefault((c["dir"], c["page_bytes"], c["op"], c["threads"]), {})[c["kind"]] = c
    for (d, pb, op, t), k in rows.items():
        raw = k["raw"]
        lines.append(f"{d} | {pb >> 10} KiB | {op} | {t} | {raw['pages_per_s']:.0f} | " +
                     " | ".join(f"{k[x]['pages_per_s'] / raw['pages_per_s']:.2f}" if x in k
                                else "-" for x in ("engine", "native", "python")) + " | " +
                     " | ".join(f"{k[x]['p50_us'] / raw['p50_us']:.2f}" if x in k else "-"
                                for x in ("native", "python")))
    for b in result["big"]:
        lines.append(f"{b['dir']} | {b['page_bytes'] >> 10} KiB | 128-page restore | 1 | "
                     f"raw {b['raw']['GBps']:.2f} GB/s | native {b['native']['GBps']:.2f} "
                     f"({b['native']['GBps'] / b['raw']['GBps']:.2f}x) | python "
                     f"{b['python']['GBps']:.2f} ({b['python']['GBps'] / b['raw']['GBps']:.2f}x)"
                     + (f" | one engine call {b['engine_one_call']['GBps']:.2f}"
                        if "engine_one_call" in b else ""))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dirs", nargs="+", required=True, help="scratch directories (a store in "
                    "each; e.g. /dev/shm/hpe and one on the disk)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                    help="threads issuing calls at once (each a cell)")
    ap.add_argument("--page-sizes", nargs="+", default=["64KiB", "256KiB", "2MiB"])
    ap.add_argument("--seconds", type=float, default=1.0, help="duration of one measurement")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per cell (median)")
    ap.add_argument("--ops", nargs="+", choices=("restore", "big", "spill"),
                    default=["restore", "big", "spill"], help="what to measure (default: all)")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS),
                    help="which kinds the thread cells run (default: all; raw always)")
    ap.add_argument("--hold-gil-below", type=int, metavar="BYTES",
                    help="the native engine's bound under which checksums and copies from "
                    "mappings keep the GIL (default: the engine's own)")
    ap.add_argument("--out", help="write the result here (JSON)")
    ap.add_argument("--profile", metavar="FILE", help="instead: cProfile 1-page restores and "
                    "spills on a native tier (first directory and page size) into FILE")
    args = ap.parse_args()
    for d in args.dirs:
        os.makedirs(d, exist_ok=True)
    if args.profile:
        with open(args.profile, "w", encoding="utf-8") as f:
            f.write(profile(args))
        return
    result = measure(args)
    text = table(result)
    result["table"] = text.splitlines()
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
