"""Diagnostic for issue 13: one sidecar read call alone, against raw reads of the same bytes.

SGLang's 128-page ``batch_get_v2`` of a DeepSeek-V3.2 DSA indexer pool (515,328 B pages, 66 MB)
through a sidecar tier set up as the adapter sets it (``store_config``), read in place into a
host buffer, every page verified; median of ``--reps`` calls. Then, from the same slab file into
one buffer: ``os.preadv`` on 1, 4 and 16 threads (no checksum), and xxh3 of the same bytes on one
thread: the two costs a call is made of. Prints one JSON line.

    python bench/experiments/sidecar_call.py --dir /dev/shm
    python bench/experiments/sidecar_call.py --dir /dev/shm --phases     # where the time goes
    python bench/experiments/sidecar_call.py --hash-scale                # xxh3 over 1-16 threads

``--phases`` wraps the tier's steps and sums their wall time per call: on the calling thread
(checks, pin, extents, submitting the reads, waiting and verifying) and on the I/O threads
(``_vector_io``: the preadv and, since the page engine, the pages' checksums;
``_ReadChecks.__call__``: recording them; thread sums over a call's time say how many threads
were busy), then a cProfile of 10 calls.
``--hash-scale``: 64 pages of 1 MiB hashed one-shot, hashed streamed (as gdskv hashes host
pages) and copied, on 1 to 16 pool threads, best of 7, GB/s.

Environment: ``GDSKV_*`` as usual (``GDSKV_IO_THREADS``, ``GDSKV_BACKEND``); ``SWITCH_US`` sets
the interpreter's GIL switch interval (µs), to test whether GIL hand-offs are the cost.

Results it produced: ``h100-2026-11-23/hybrid-read-3/`` (run from the three scripts this one
merges, same code).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import xxhash

import gdskv.backends.posix as posix_backend
import gdskv.directory as directory
import gdskv.host_pages as host_pages
import gdskv.store as store
import gdskv.tier as tier_module
from gdskv.adapters.sglang.sidecar import store_config
from gdskv.config import TierConfig
from gdskv.layout import BytePageLayout
from gdskv.tier import Tier

PAGES = 128
PAGE_BYTES = 61 * 132 * 64   # DeepSeek-V3.2 indexer: 61 layers x 132 B x 64 tokens


@contextlib.contextmanager
def sidecar_tier(where: str):
    """A sidecar tier holding PAGES random pages; yields (tier, keys, source, destination)."""
    layout = BytePageLayout(page_bytes=PAGE_BYTES,
                            kind="sglang/indexer/bench/page_first_direct/regions",
                            model_name="deepseek-ai/DeepSeek-V3.2")
    root = os.path.join(where, f"gdskv-sidecar-call-{os.getpid()}")
    os.makedirs(root)
    try:
        base = TierConfig.from_env(directories=(root,), capacity=(PAGES + 256) * PAGE_BYTES * 40)
        cfg = store_config(base, layout, directories=(root,), kv_capacity=base.capacity,
                           pool_host_bytes=PAGE_BYTES, kv_host_bytes=PAGE_BYTES * 9,
                           capacity=(PAGES + 256) * layout.slot_bytes)
        src = torch.randint(0, 256, (PAGES, PAGE_BYTES), dtype=torch.uint8)
        dst = torch.zeros_like(src)
        keys = [f"{i:064x}" for i in range(PAGES)]
        with Tier(layout, cfg, device="cpu") as tier:
            if not all(tier.put_pages(keys, [[src[i]] for i in range(PAGES)])):
                raise RuntimeError("a page write failed")
            yield tier, keys, src, dst
    finally:
        shutil.rmtree(root, ignore_errors=True)


def timed_gets(tier, keys, dst, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        ok = tier.get_pages(keys, [[dst[i]] for i in range(PAGES)])
        out.append(time.perf_counter() - t0)
        if not all(ok):
            raise RuntimeError("a page read failed")
    return out


def call_and_ceilings(args) -> dict:
    out = {"threads": os.environ.get("GDSKV_IO_THREADS", "16"),
           "switch_us": os.environ.get("SWITCH_US", "5000"),
           "backend": os.environ.get("GDSKV_BACKEND", "auto")}
    with sidecar_tier(args.dir) as (tier, keys, src, dst):
        ts = timed_gets(tier, keys, dst, args.reps)
        if not torch.equal(src, dst):
            raise RuntimeError("bytes read differ from bytes written")
        out.update(get_ms_p50=statistics.median(ts) * 1e3, get_ms_min=min(ts) * 1e3,
                   backend_used=tier.backend.name)
        fd = os.open(tier.store.files[0].path, os.O_RDONLY)
        try:   # raw: the same bytes from the slab, preadv on k threads, no checksum
            buf = np.empty(PAGES * tier.layout.slot_bytes, dtype=np.uint8)
            for k in (1, 4, 16):
                step = -(-len(buf) // k)
                with ThreadPoolExecutor(k) as pool:
                    ts = []
                    for _ in range(args.reps):
                        t0 = time.perf_counter()
                        list(pool.map(lambda o: os.preadv(fd, [buf[o:o + step]], o),
                                      range(0, len(buf), step)))
                        ts.append(time.perf_counter() - t0)
                out[f"raw_preadv_{k}t_ms_p50"] = statistics.median(ts) * 1e3
        finally:
            os.close(fd)
        t0 = time.perf_counter()
        for i in range(PAGES):
            xxhash.xxh3_64_intdigest(src[i].numpy())
        out["xxh3_1t_ms"] = (time.perf_counter() - t0) * 1e3
    return out


def phases(args) -> str:
    spent: dict[str, float] = collections.defaultdict(float)
    lock = threading.Lock()

    def wrap(owner, name: str, tag: str) -> None:
        real = getattr(owner, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                with lock:
                    spent[tag] += time.perf_counter() - t0
        setattr(owner, name, timed)

    for owner, name, tag in (
            (tier_module.Tier, "_get", "main:_get total"),
            (tier_module.Tier, "_region_calls", "main:_region_calls"),
            (tier_module.Tier, "_finish_read_in_place", "main:_finish_read_in_place(incl wait)"),
            (host_pages.InPlacePages, "read_extents", "main:read_extents"),
            (posix_backend.PosixBackend, "read", "main:backend.read(submit)"),
            (store.SlabStore, "extents", "main:store.extents"),
            (directory.PageDirectory, "pin", "main:pin"),
            (directory.PageDirectory, "unpin", "main:unpin"),
            (posix_backend, "_vector_io", "io:_vector_io"),
            (host_pages._ReadChecks, "__call__", "io:moved(sums)")):
        wrap(owner, name, tag)
    with sidecar_tier(args.dir) as (tier, keys, _src, dst):
        timed_gets(tier, keys, dst, 3)
        spent.clear()
        ts = timed_gets(tier, keys, dst, args.reps)
        lines = [f"get p50 ms {statistics.median(ts) * 1e3:.2f} calls {args.reps}"]
        lines += [f"  {k:45s} {v / args.reps * 1e3:8.3f} ms/call" for k, v in sorted(spent.items())]
        prof = cProfile.Profile()
        prof.enable()
        timed_gets(tier, keys, dst, 10)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    return "\n".join(lines) + "\n" + text.getvalue()


def hash_scale() -> dict:
    pages = [np.random.randint(0, 256, 1 << 20, dtype=np.uint8) for _ in range(64)]
    dst = [np.empty_like(p) for p in pages]

    def stream(p) -> int:
        h = xxhash.xxh3_64()
        h.update(p)
        return h.intdigest()

    out = {"xxhash": xxhash.VERSION}
    for k in (1, 2, 4, 8, 16):
        with ThreadPoolExecutor(k) as pool:
            for name, fn, items in (("oneshot", xxhash.xxh3_64_intdigest, pages),
                                    ("stream", stream, pages),
                                    ("copy", lambda i: np.copyto(dst[i], pages[i]), range(64))):
                best = float("inf")
                for _ in range(7):
                    t0 = time.perf_counter()
                    list(pool.map(fn, items))
                    best = min(best, time.perf_counter() - t0)
                out[f"{name}_{k}t_GBps"] = round(64 * (1 << 20) / best / 1e9, 2)
    return out


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="directory on the medium under test (a subdirectory is made "
                    "and removed); not needed with --hash-scale")
    ap.add_argument("--reps", type=int, default=30, help="timed calls")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--phases", action="store_true", help="where a call's time goes")
    mode.add_argument("--hash-scale", action="store_true", help="xxh3 and copy over 1-16 threads")
    args = ap.parse_args(argv)
    if not args.hash_scale and not args.dir:
        ap.error("--dir is required (except with --hash-scale)")
    return args


if __name__ == "__main__":
    a = _args()
    if os.environ.get("SWITCH_US"):
        sys.setswitchinterval(int(os.environ["SWITCH_US"]) * 1e-6)
    if a.hash_scale:
        print(json.dumps(hash_scale()))
    elif a.phases:
        print(phases(a))
    else:
        print(json.dumps(call_and_ceilings(a)))
