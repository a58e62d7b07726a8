"""NIXL POSIX plugin vs plain os.pwrite/os.pread of the same bytes, host memory, on CPU.

    python bench/experiments/nixl_cpu_compare.py --dir /tmp/x --size 256MiB [--queue aio]

The machine's page cache is dropped before reads when root (otherwise reads with O_DIRECT files
still bypass it); prints GB/s per method as JSON.

Result it produced (bench/RESULTS.md, "NIXL backend"), under bench/results/:
``cpu-2026-11-23/nixl-cpu-compare/nixl_cpu_compare.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from experiment_helpers import drop_all_caches, open_slab
from gdskv.backends.base import Extent
from gdskv.backends.nixl import NixlBackend
from gdskv.config import TierConfig, parse_size
from gdskv.memory import alloc_host, host_numpy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--bs", default="1MiB", help="extent size")
    ap.add_argument("--queue", default="aio")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    size, bs = parse_size(args.size), parse_size(args.bs)
    d = args.dir or tempfile.mkdtemp(prefix="nixlcmp")
    files = [open_slab(os.path.join(d, f"cmp{i}.bin"), size // args.files, i)
             for i in range(args.files)]
    ext = [Extent(k % args.files, (k // args.files) * bs, bs, k * bs) for k in range(size // bs)]
    src = alloc_host(size)
    src.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    dst = alloc_host(size)
    results = {}

    def timed(fn):
        best = []
        for _ in range(args.reps):
            t = time.perf_counter()
            fn()
            best.append(time.perf_counter() - t)
        return size / min(best) / 1e9

    with NixlBackend(TierConfig(nixl_posix_queue=args.queue), torch.device("cpu")) as b:
        b.attach(files)
        b.write(src, ext[:1]).result()   # warm registrations
        results["nixl_write_GBps"] = timed(lambda: b.write(src, ext).result())
        dropped = drop_all_caches()
        results["nixl_read_GBps"] = timed(lambda: b.read(dst, ext).result())
        assert torch.equal(src, dst), "NIXL round trip not bit-exact"
        results["nixl"] = b.describe()

    sv, dv = host_numpy(src), host_numpy(dst)

    def pw():
        for e in ext:
            os.pwrite(files[e.file].fd, sv[e.buffer_offset:e.buffer_offset + e.length],
                      e.file_offset)

    def pr():
        for e in ext:
            os.preadv(files[e.file].fd, [dv[e.buffer_offset:e.buffer_offset + e.length]],
                      e.file_offset)

    results["pwrite_GBps"] = timed(pw)
    drop_all_caches()
    dst.zero_()
    results["pread_GBps"] = timed(pr)
    assert torch.equal(src, dst)
    results.update(size=size, bs=bs, files=args.files, direct=files[0].direct,
                   caches_dropped=dropped, dir=d)
    for f in files:
        os.close(f.fd)
        os.unlink(f.path)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
