"""Diagnostic for issue 13: one sidecar read call alone, against raw reads of the same bytes.

SGLang's 128-page ``batch_get_v2`` of a DeepSeek-V3.2 DSA indexer pool (515,328 B pages, 66 MB)
through a sidecar tier set up as the adapter sets it (``store_config``), read into a host buffer
in place, every page verified; median of ``reps`` calls. Then, from the same slab file into one
buffer: ``os.preadv`` on 1, 4 and 16 threads (no checksum), and xxh3 of the same bytes on one
thread -- the two costs a call is made of.

    python bench/experiments/sidecar_call.py /dev/shm 30

Environment: ``GDSKV_*`` as usual (``GDSKV_IO_THREADS``, ``GDSKV_BACKEND``); ``SWITCH_US`` sets
the interpreter's GIL switch interval (µs) to test whether GIL hand-offs are the cost. Prints one
JSON line. Results: ``bench/results/h100-2026-11-23/hybrid-read-3/``.
"""
import json
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
import numpy as np
import torch
import xxhash
from gdskv.adapters.sglang.sidecar import store_config
from gdskv.config import TierConfig
from gdskv.layout import BytePageLayout
from gdskv.tier import Tier

if os.environ.get("SWITCH_US"): sys.setswitchinterval(int(os.environ["SWITCH_US"]) * 1e-6)
d = sys.argv[1]; reps = int(sys.argv[2]) if len(sys.argv) > 2 else 30
pb = 61 * 132 * 64
lay = BytePageLayout(page_bytes=pb, kind="sglang/indexer/bench/page_first_direct/regions",
                     model_name="x")
n = 128
root = os.path.join(d, f"sc-{os.getpid()}"); os.makedirs(root)
out = {"threads": os.environ.get("GDSKV_IO_THREADS", "16"), "switch_us": os.environ.get("SWITCH_US", "5000"), "backend": os.environ.get("GDSKV_BACKEND", "auto")}
try:
    base = TierConfig.from_env(directories=(root,), capacity=(n + 256) * 4 * pb * 10)
    cfg = store_config(base, lay, directories=(root,), kv_capacity=base.capacity,
                       pool_host_bytes=pb, kv_host_bytes=pb * 9,
                       capacity=(n + 256) * lay.slot_bytes)
    src = torch.randint(0, 256, (n, pb), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    keys = [f"{i:064x}" for i in range(n)]
    with Tier(lay, cfg, device="cpu") as t:
        assert all(t.put_pages(keys, [[src[i]] for i in range(n)]))
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            ok = t.get_pages(keys, [[dst[i]] for i in range(n)])
            ts.append(time.perf_counter() - t0)
            assert all(ok)
        assert torch.equal(src, dst)
        out["get_ms_p50"] = statistics.median(ts) * 1e3
        out["get_ms_min"] = min(ts) * 1e3
        slab = t.store.files[0].path
        out["backend_used"] = t.backend.name
    # raw: the same bytes read from the slab with preadv on k threads (no hash)
    fd = os.open(slab, os.O_RDONLY)
    buf = np.empty(n * lay.slot_bytes, dtype=np.uint8)
    for k in (1, 4, 16):
        step = -(-len(buf) // k); pool = ThreadPoolExecutor(k)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            list(pool.map(lambda o: os.preadv(fd, [buf[o:o + step]], o), range(0, len(buf), step)))
            ts.append(time.perf_counter() - t0)
        out[f"raw_preadv_{k}t_ms_p50"] = statistics.median(ts) * 1e3
        pool.shutdown()
    t0 = time.perf_counter(); [xxhash.xxh3_64_intdigest(src[i].numpy()) for i in range(n)]
    out["xxh3_1t_ms"] = (time.perf_counter() - t0) * 1e3
    os.close(fd)
finally:
    shutil.rmtree(root, ignore_errors=True)
print(json.dumps(out))
