"""LightLLM's disk cache path through gdskv against a file-per-block stand-in of LightMem.

Both sides get the calls LightLLM's ``DiskCacheWorker`` makes on LightMem's service, in its
order: an offload is ``query`` then ``create(mode="w")`` and a wait for ``data_safe()``, one
request's pages at a time (the worker's loop); a load is ``create(mode="r", start_pos=)`` and a
wait for ``ready()`` with every block ``Finished``, from several threads at once (LightLLM's
cache manager loads from a thread pool). Same CPU cache tensor, same pages, same directory.

- gdskv: :class:`gdskv.adapters.lightllm.LocalCacheService` (what ``light_mem`` serves), one
  page per block, slab files, O_DIRECT where the file system takes it, checksums, journal.
- stand-in: each block of ``_n`` pages (LightMem's 64 MiB blocks: ``_n = 64 MiB // page``) is
  one file named by its hash, written whole and fsynced before ``data_safe`` (gdskv's durability),
  read back with buffered I/O. LightMem itself (C++, CMake, Boost) is not built here; this is
  its file-per-block shape, not its code.

Before each load pass the page cache is emptied of every file in the directory (fadvise; the
machine's other cache is left alone: the machine is shared), so buffered reads come from the
device. Every loaded byte is checked against what was offloaded (outside the timing).

    python bench/experiments/lightllm_disk.py --dir /mnt/nvme/bench --out lightllm.json

Results it produced (bench/RESULTS.md, "LightLLM's disk cache"), under bench/results/:
``cpu-2026-11-23/lightllm/`` and ``h200-2026-11-23/lightllm/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from gdskv.adapters.lightllm import CacheTask, LocalCacheService, PageState
from gdskv.bench.cache import drop_page_cache
from gdskv.config import TierConfig

BLOCK_BYTES = 64 << 20  # LightMem's largest block (KVCACHE_MAX_BLOCK_SIZE)


class FilePerBlock:
    """LightMem's service API over one file per block (the baseline)."""

    def __init__(self, cache: torch.Tensor, directory: str, num_worker: int):
        self._cache = cache
        self._dir = directory
        self._n = max(1, BLOCK_BYTES // cache.shape[1])
        self._pool = ThreadPoolExecutor(max_workers=num_worker)
        self._active = {"r": 0, "w": 0}

    def _path(self, h: int) -> str:
        return os.path.join(self._dir, format(h, "032x"))

    def _blocks(self, hashes, first=0):
        n = self._n
        return [list(range(b, min(b + n, len(hashes)))) for b in range(first, len(hashes), n)]

    def query(self, hash_128s):
        return [os.path.exists(self._path(hash_128s[b[-1]])) for b in self._blocks(hash_128s)]

    def active_threads(self, mode):
        return self._active[mode]

    def create(self, hash_128s, kv_page_indexer, mode, start_pos=0):
        blocks = self._blocks(hash_128s, start_pos // self._n * self._n)
        task = CacheTask(mode, blocks, [], kv_page_indexer.tolist(), [])
        self._active[mode] += 1
        self._pool.submit(self._run, task, hash_128s)
        return task

    def _run(self, task, hashes):
        for b, positions in enumerate(task._blocks):
            rows = [self._cache[task._page_indexes[i]].numpy() for i in positions]
            path = self._path(hashes[positions[-1]])
            try:
                if task.mode == "w":
                    with open(path + ".tmp", "wb") as f:
                        for r in rows:
                            f.write(r)
                        f.flush()
                        os.fsync(f.fileno())
                    os.rename(path + ".tmp", path)
                else:
                    with open(path, "rb", buffering=0) as f:
                        for r in rows:
                            if f.readinto(r) != r.nbytes:
                                raise OSError("short read")
                task._states[b] = PageState.Finished
            except OSError:
                task._states[b] = PageState.Aborted
        task._finish()
        self._active[task.mode] -= 1

    def close(self):
        self._pool.shutdown(wait=True)


def wait(task, attr):
    cond = getattr(task, attr)
    while not cond():
        time.sleep(0.001)


def offload(service, requests, indexes):
    """DiskCacheWorker._persist_pages_to_disk for each request, one after another."""
    for hashes, idx in zip(requests, indexes):
        if not all(service.query(hashes)):
            wait(service.create(hash_128s=hashes, kv_page_indexer=idx, mode="w"), "data_safe")


def load(service, requests, indexes, loaders):
    """DiskCacheWorker.load_pages for every request, from ``loaders`` threads."""
    def one(i):
        task = service.create(hash_128s=requests[i], kv_page_indexer=indexes[i], mode="r",
                              start_pos=0)
        wait(task, "ready")
        return all(s is PageState.Finished for s in task.state())
    with ThreadPoolExecutor(max_workers=loaders) as pool:
        return all(pool.map(one, range(len(requests))))


def files_under(directory):
    return [os.path.join(d, f) for d, _, fs in os.walk(directory) for f in fs]


def run_side(name, make, cache, src, dst, requests, directory, passes, loaders):
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    service = make(directory)
    out = {"write_s": [], "read_s": []}
    try:
        for p in range(passes):
            # a fresh set of hashes each pass: every pass writes everything
            reqs = [[h + (p << 64) for h in r] for r in requests]
            t0 = time.perf_counter()
            offload(service, reqs, src)
            out["write_s"].append(time.perf_counter() - t0)
            drop_page_cache(files_under(directory))
            for d in dst:
                cache[d.long()] = 0
            t0 = time.perf_counter()
            ok = load(service, reqs, dst, loaders)
            out["read_s"].append(time.perf_counter() - t0)
            wrong = sum(not torch.equal(cache[s.long()], cache[d.long()]) for s, d in zip(src, dst))
            if not ok or wrong:
                raise SystemExit(f"{name}: pass {p}: load ok={ok}, {wrong} requests with wrong "
                                 f"bytes")
        if isinstance(service, LocalCacheService):
            stats = service.tier.stats()
            out["tier"] = {k: stats[k] for k in ("backend", "o_direct", "o_direct_reason")}
    finally:
        service.close()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="directory both sides store in (emptied)")
    ap.add_argument("--page-bytes", type=int, default=4 << 20,
                    help="bytes of one CPU cache page (default 4 MiB: Llama-3-8B, 32 tokens)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--pages-per-request", type=int, default=8)
    ap.add_argument("--loaders", type=int, default=8, help="threads loading at once")
    ap.add_argument("--workers", type=int, default=24, help="service threads (LightLLM: 24)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--out", help="JSON file for the results")
    a = ap.parse_args(argv)
    for opt in ("page_bytes", "requests", "pages_per_request", "loaders", "workers", "passes"):
        if getattr(a, opt) < 1:
            ap.error(f"--{opt.replace('_', '-')} must be at least 1, got {getattr(a, opt)}")

    pages = a.requests * a.pages_per_request
    cache = torch.randint(0, 256, (2 * pages, a.page_bytes), dtype=torch.uint8)
    src = [torch.arange(i * a.pages_per_request, (i + 1) * a.pages_per_request, dtype=torch.int32)
           for i in range(a.requests)]
    dst = [s + pages for s in src]
    requests = [[(i << 32) + j + 1 for j in range(a.pages_per_request)]
                for i in range(a.requests)]
    total = pages * a.page_bytes

    def gdskv_side(d):
        config = TierConfig.from_env(directories=(d,), capacity=2 * total + (64 << 20),
                                     backend="posix")
        return LocalCacheService(cache, os.path.join(d, "cache_file"), 0, config=config,
                                 capacity_from_config=True, num_worker=a.workers)

    sides = {"gdskv": gdskv_side,
             "file_per_block": lambda d: FilePerBlock(cache, d, a.workers)}
    results = {}
    for name, make in sides.items():
        r = run_side(name, make, cache, src, dst, requests, os.path.join(a.dir, name),
                     a.passes, a.loaders)
        r["write_GBps"] = total / statistics.median(r["write_s"]) / 1e9
        r["read_GBps"] = total / statistics.median(r["read_s"]) / 1e9
        results[name] = r
    shutil.rmtree(a.dir + "/gdskv", ignore_errors=True)
    shutil.rmtree(a.dir + "/file_per_block", ignore_errors=True)
    report = {"dir": a.dir, "page_bytes": a.page_bytes, "pages": pages,
              "pages_per_request": a.pages_per_request, "loaders": a.loaders,
              "workers": a.workers, "passes": a.passes, "machine": platform.node(),
              "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "results": results}
    text = json.dumps(report, indent=1)
    print(text)
    for name, r in results.items():
        print(f"{name:>15}: offload {r['write_GBps']:.2f} GB/s, load {r['read_GBps']:.2f} GB/s "
              f"(median of {a.passes})")
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
