"""kvikio I/O on the calling thread against kvikio's thread pool, for small calls (issue 14).

A kvikio ``pwrite``/``pread`` hands the I/O to kvikio's thread pool and returns a future: the
calling thread submits, a pool thread wakes and moves the bytes, and the caller wakes again from
the future's wait. ``raw_write``/``raw_read`` move the same bytes on the calling thread (the GIL
released): no submit, no two wake-ups, and no parallelism within the call either. This times
both, call by call in turn (the order rotating), on one GPU buffer and one preallocated file:

- ``pool``: ``pwrite(...).get()`` / ``pread(...).get()`` with gdskv's task size (what the
  kvikio backend does and what gdskv-bench's raw kvikio does);
- ``caller``: ``raw_write`` / ``raw_read`` on the calling thread;

each write followed by fdatasync (the spill's sync policy), each read from a slot the earlier
writes left in the page cache. ``--pages`` sets the call sizes (Llama-3-8B 16-token page slots,
contiguous); kvikio's settings are the ones gdskv's backend claims (io_threads, bounce buffer
= task size). Prints each kind's p50/p99 (µs) per size and operation; ``--out`` keeps the
per-call times (JSON).

    python bench/experiments/calling_thread_io.py /dev/shm/cti [--calls 600] [--pages 1 8]

Results it produced: ``h200-2026-11-26/calling-thread-io/``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("directory", help="scratch directory (emptied)")
    ap.add_argument("--calls", type=int, default=600, help="calls of each kind per size and op")
    ap.add_argument("--pages", type=int, nargs="+", default=[1, 8], help="call sizes, in pages")
    ap.add_argument("--geometry", default="llama3-8b-p16", help="<preset>-p<page tokens>")
    ap.add_argument("--out", help="write the per-call times here (JSON)")
    args = ap.parse_args()

    import torch
    from experiment_helpers import geometry, preallocate

    from gdskv.backends.base import SlabFile
    from gdskv.backends.kvikio import KvikioBackend
    from gdskv.config import TierConfig

    if not torch.cuda.is_available():
        raise SystemExit("calling_thread_io: needs a GPU (kvikio moves GPU memory)")
    lay = geometry(args.geometry)
    shutil.rmtree(args.directory, ignore_errors=True)
    os.makedirs(args.directory)
    slots = 64  # rotating places in the file, each as large as the largest call
    biggest = max(args.pages) * lay.slot_bytes
    path = os.path.join(args.directory, "slab")
    preallocate(path, slots * biggest)
    fd = os.open(path, os.O_RDWR)
    cfg = TierConfig(directories=(args.directory,), backend="kvikio")
    backend = KvikioBackend(cfg, torch.device("cuda"))
    backend.attach([SlabFile(0, path, fd, False, slots * biggest)])  # claims kvikio's settings
    handle, task = backend._files[0], backend._task
    buf = torch.randint(0, 255, (biggest,), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()

    def pool_write(n: int, off: int) -> None:
        handle.pwrite(buf, n, off, task).get()
        os.fdatasync(fd)

    def caller_write(n: int, off: int) -> None:
        handle.raw_write(buf, n, off, 0)
        os.fdatasync(fd)

    def pool_read(n: int, off: int) -> None:
        handle.pread(buf, n, off, task).get()

    def caller_read(n: int, off: int) -> None:
        handle.raw_read(buf, n, off, 0)

    kinds = {"write": {"pool": pool_write, "caller": caller_write},
             "read": {"pool": pool_read, "caller": caller_read}}
    times: dict[str, dict[str, list[float]]] = {}
    print(f"{args.calls} calls of each kind, in turn, {args.directory}; kvikio task size "
          f"{task} B; µs")
    print(f"{'op':6s} {'pages':>5s} {'kind':7s} {'p50':>9s} {'p99':>9s}")
    for pages in args.pages:
        n = pages * lay.slot_bytes
        for op, fns in kinds.items():
            names = list(fns)
            rows = {k: [] for k in names}
            for i in range(args.calls + 20):  # the first 20 of each are not counted
                off = (i % slots) * biggest
                order = names[i % 2:] + names[:i % 2]
                for k in order:
                    t0 = time.perf_counter()
                    fns[k](n, off)
                    dt = time.perf_counter() - t0
                    if i >= 20:
                        rows[k].append(dt)
            for k in names:
                ts = sorted(rows[k])
                print(f"{op:6s} {pages:5d} {k:7s} {1e6 * statistics.median(ts):9.1f} "
                      f"{1e6 * ts[int(0.99 * (len(ts) - 1))]:9.1f}")
            times[f"{op}-{pages}"] = rows
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"geometry": args.geometry, "directory": args.directory, "task": task,
                       "times": times}, f)
    backend.close()
    os.close(fd)
    shutil.rmtree(args.directory, ignore_errors=True)


if __name__ == "__main__":
    main()
