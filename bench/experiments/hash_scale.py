"""Diagnostic for issue 13: does xxh3 (python-xxhash releases the GIL) scale over threads here?

64 pages of 1 MiB (about one sidecar call) hashed one-shot, hashed streamed (as gdskv's host
pages are), and copied (``np.copyto``) on 1 to 16 pool threads; best of 7, GB/s. One JSON line.

    python bench/experiments/hash_scale.py
"""
import json
import time

import numpy as np
import xxhash
from concurrent.futures import ThreadPoolExecutor
pages = [np.random.randint(0, 256, 1 << 20, dtype=np.uint8) for _ in range(64)]
dst = [np.empty_like(p) for p in pages]
def stream(p):
    s = xxhash.xxh3_64(); s.update(p); return s.intdigest()
out = {"xxhash": xxhash.VERSION}
for k in (1, 2, 4, 8, 16):
    with ThreadPoolExecutor(k) as pool:
        for name, fn in (("oneshot", xxhash.xxh3_64_intdigest), ("stream", stream),
                         ("copy", lambda i: np.copyto(dst[i], pages[i]))):
            best = 9
            for _ in range(7):
                args = range(64) if name == "copy" else pages
                t = time.perf_counter(); list(pool.map(fn, args)); best = min(best, time.perf_counter() - t)
            out[f"{name}_{k}t_GBps"] = round(64 * (1 << 20) / best / 1e9, 2)
print(json.dumps(out))
