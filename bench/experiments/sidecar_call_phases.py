"""Diagnostic for issue 13: where :mod:`sidecar_call`'s 128-page indexer read spends its time.

Wraps the tier's steps to sum their wall time per call: on the calling thread (checks, pin,
extents, submitting the reads, waiting and verifying) and on the I/O threads (``_vector_io``: the
preadv; ``_ReadHasher.moved``: hashing the pages a piece completed), then a cProfile of 10 calls.
Thread sums over a call's wall time say how many threads were busy on average.

    python bench/experiments/sidecar_call_phases.py /dev/shm

Result: ``bench/results/h100-2026-11-23/hybrid-read-3/sidecar_call_phases_abd5c2b.txt``.
"""
import os, sys, time, json, statistics, shutil, threading, cProfile, pstats, io, collections
import torch
from gdskv.adapters.sglang.sidecar import store_config
from gdskv.config import TierConfig
from gdskv.layout import BytePageLayout
from gdskv.tier import Tier
import gdskv.tier as T, gdskv.host_pages as H, gdskv.backends.posix as P, gdskv.store as S, gdskv.directory as D

acc = collections.defaultdict(float); lock = threading.Lock()
def wrap(obj, name, tag):
    real = getattr(obj, name)
    def f(*a, **k):
        t0 = time.perf_counter()
        try: return real(*a, **k)
        finally:
            with lock: acc[tag] += time.perf_counter() - t0
    setattr(obj, name, f)
wrap(T.Tier, "_region_calls", "main:_region_calls")
wrap(T.Tier, "_finish_read_in_place", "main:_finish_read_in_place(incl wait)")
wrap(H.InPlacePages, "read_extents", "main:read_extents")
wrap(P.PosixBackend, "read", "main:backend.read(submit)")
wrap(S.SlabStore, "extents", "main:store.extents")
wrap(D.PageDirectory, "pin", "main:pin"); wrap(D.PageDirectory, "unpin", "main:unpin")
wrap(P, "_vector_io", "io:_vector_io")
wrap(H._ReadHasher, "moved", "io:moved(hash)")
wrap(T.Tier, "_get", "main:_get total")

d = sys.argv[1]; reps = 30
pb = 61 * 132 * 64; n = 128
lay = BytePageLayout(page_bytes=pb, kind="sglang/indexer/bench/page_first_direct/regions", model_name="x")
root = os.path.join(d, f"sp-{os.getpid()}"); os.makedirs(root)
try:
    base = TierConfig.from_env(directories=(root,), capacity=(n + 256) * pb * 40)
    cfg = store_config(base, lay, directories=(root,), kv_capacity=base.capacity,
                       pool_host_bytes=pb, kv_host_bytes=pb * 9, capacity=(n + 256) * lay.slot_bytes)
    src = torch.randint(0, 256, (n, pb), dtype=torch.uint8); dst = torch.zeros_like(src)
    keys = [f"{i:064x}" for i in range(n)]
    with Tier(lay, cfg, device="cpu") as t:
        assert all(t.put_pages(keys, [[src[i]] for i in range(n)]))
        for _ in range(3): t.get_pages(keys, [[dst[i]] for i in range(n)])
        acc.clear(); ts = []
        for _ in range(reps):
            t0 = time.perf_counter(); assert all(t.get_pages(keys, [[dst[i]] for i in range(n)])); ts.append(time.perf_counter() - t0)
        print("get p50 ms", round(statistics.median(ts) * 1e3, 2), "calls", reps)
        for k, v in sorted(acc.items()): print(f"  {k:45s} {v / reps * 1e3:8.3f} ms/call")
        pr = cProfile.Profile(); pr.enable()
        for _ in range(10): t.get_pages(keys, [[dst[i]] for i in range(n)])
        pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); print(s.getvalue()[:6000])
finally:
    shutil.rmtree(root, ignore_errors=True)
