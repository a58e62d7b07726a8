"""Where a 1-page spill's time goes against raw kvikio's, call by call, interleaved (issue 14).

Three kinds of 1-page call are timed in turn (the order rotating call by call), so all see
the same state of the machine:

- ``gdskv``: a ``Tier.put`` of one page from a GPU pool (scattered token slots, the caller on
  its own stream, kvikio backend);
- ``raw``: a raw kvikio write + fdatasync of one contiguous page (what gdskv-bench compares);
- ``floor``: only the work a spill's guarantees need beyond raw's, in straight-line code with
  gdskv's own pieces: the page gathered, checksummed and its trailer sealed by the tier's
  CUDA graph (``GpuSpill``), the sync, the same kvikio write + fdatasync, and a COMMIT appended
  to a journal with fdatasync. No argument checks, no directory, no counters: what is left
  if every step of bookkeeping cost nothing.

Each call is cut into phases by stamps on its backend (the same wrappers on all):

- ``before_submit``: from the call to the backend's ``write`` (raw: nothing; gdskv: argument
  checks, the directory, trailers, the gather/checksum graph and its sync);
- ``submit``: the backend's ``write`` (kvikio's ``pwrite`` submit), the same code for both;
- ``in_flight``: from the submit's return to the wait (gdskv: the commit records, the host
  work it does while the write runs);
- ``wait``: waiting for kvikio's futures;
- ``after``: from the wait's end to the call's return (raw: fdatasync; gdskv: fdatasync, the
  journal COMMIT, the directory; floor: fdatasync, the COMMIT).

Each phase's median (µs) and the medians of the whole calls are printed, and ``--out`` takes
the per-call stamps. ``--io-poll-us N`` has all three poll their writes' completion before
sleeping (the tier's ``io_poll_us``: :class:`gdskv.backends.base.CompletionPoller`).
``--split-cpus`` keeps the calling thread on one CPU and kvikio's I/O
threads (every thread made before the timed calls) on the others: how much of the host time is
the calling thread's caches and CPU taken over by the I/O while it waits. With ``--gpu-sync`` the GPU sync (gdskv's ``Tier._copies_done``, the
floor's) is timed as a phase of its own inside ``before_submit``.

    python bench/experiments/spill_phases.py /dev/shm/phases [--calls 1000]

Results it produced: ``h200-2026-11-26/call-overhead-8/`` and ``h200-2026-11-26/call-overhead-9/``
(``--io-poll-us``; see their READMEs).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

PHASES = ("before_submit", "submit", "in_flight", "wait", "after")


class Stamps:
    """The stamps of one call, set by the wrappers :func:`stamp_backend` puts on a backend."""

    def __init__(self) -> None:
        self.t = {}

    def phases(self, t0: float, t1: float) -> dict[str, float]:
        s = self.t
        return {"before_submit": s["submit"] - t0, "submit": s["submitted"] - s["submit"],
                "in_flight": s["wait"] - s["submitted"], "wait": s["waited"] - s["wait"],
                "after": t1 - s["waited"], "call": t1 - t0,
                "gpu_sync": s.get("synced", 0.0) - s.get("sync", 0.0)}


def stamp_backend(backend, stamps: Stamps) -> None:
    """Stamp ``backend``'s submit and its futures' wait (instance attributes: the backend's
    ``_submit`` binds ``self._wait`` into each future when it is called)."""
    write, wait = backend.write, backend._wait
    clock = time.perf_counter

    def stamped_write(buffer, extents):
        stamps.t["submit"] = clock()
        fut = write(buffer, extents)
        stamps.t["submitted"] = clock()
        return fut

    def stamped_wait(*args):
        stamps.t["wait"] = clock()
        out = wait(*args)
        stamps.t["waited"] = clock()
        return out

    backend.write, backend._wait = stamped_write, stamped_wait


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("directory", help="scratch directory (emptied): two stores go under it")
    ap.add_argument("--calls", type=int, default=1000, help="1-page calls of each kind")
    ap.add_argument("--geometry", default="llama3-8b-p16", help="<preset>-p<page tokens>")
    ap.add_argument("--gpu-sync", action="store_true", help="time the GPU sync as a phase")
    ap.add_argument("--out", help="write the per-call phases here (JSON)")
    ap.add_argument("--io-poll-us", type=int, default=0,
                    help="all three kinds' kvikio backends poll their writes' completion for up "
                         "to this many µs before sleeping (io_poll_us; 0: they sleep at once)")
    ap.add_argument("--split-cpus", action="store_true",
                    help="keep the calling thread on CPU 0 and every thread made before the "
                         "timed calls (kvikio's I/O threads among them) on the other CPUs")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if args.split_cpus:
        if len(cpus) < 2:
            raise SystemExit("spill_phases: --split-cpus needs two CPUs or more")
        os.sched_setaffinity(0, cpus[1:])  # threads made from now on inherit this

    import json

    import torch
    from experiment_helpers import geometry

    import gdskv.kernels as kd
    from gdskv import slot_trailer
    from gdskv.backends import create_backend
    from gdskv.checksum import GPU_PAGE
    from gdskv.config import TierConfig
    from gdskv.copiers import PoolCopier
    from gdskv.gpu_spill import GpuSpill
    from gdskv.gpu_verdicts import VerdictBuffers
    from gdskv.journal import Journal, Record, RecordKind, encode_all
    from gdskv.layout import FORMAT_VERSION
    from gdskv.store import SlabStore
    from gdskv.streams import OnStream
    from gdskv.tier import Tier

    if not torch.cuda.is_available():
        raise SystemExit("spill_phases: needs a GPU (a 1-page spill from a GPU pool)")
    lay, dev, n = geometry(args.geometry), torch.device("cuda"), args.calls
    shutil.rmtree(args.directory, ignore_errors=True)
    dirs = [os.path.join(args.directory, w) for w in ("gdskv", "raw", "floor")]
    for d in dirs:
        os.makedirs(d)
    capacity = (n + 64) * lay.slot_bytes
    poll = args.io_poll_us
    tier = Tier(lay, TierConfig(directories=(dirs[0],), capacity=capacity, backend="kvikio",
                                io_poll_us=poll), device=dev)
    stores, backends = [], []
    for d in dirs[1:]:  # raw's and floor's: a store's files, written by a kvikio backend
        cfg = TierConfig(directories=(d,), capacity=capacity, backend="kvikio", io_poll_us=poll)
        stores.append(SlabStore(lay, cfg))
        backends.append(create_backend(cfg, dev))
        backends[-1].attach(stores[-1].files)
    (raw_store, floor_store), (raw, floor) = stores, backends
    journal = Journal(os.path.join(dirs[2], "journal"), sync=True)

    # the engine's pool, each page at a scattered place, as gdskv-bench's GPU jobs hold it
    shape = (lay.num_layers, n * lay.page_size, lay.kv_heads, lay.head_dim)
    pool = tuple(torch.randn(shape, device=dev).to(lay.torch_dtype) for _ in range(2))
    where = torch.randperm(n)
    offsets = torch.arange(lay.page_size, dtype=torch.int64)
    slots = [int(where[i]) * lay.page_size + offsets for i in range(n)]
    src = torch.randint(0, 255, (n * lay.slot_bytes,), dtype=torch.uint8, device=dev)
    stream = torch.cuda.Stream(dev)
    OnStream(stream).__enter__()  # an engine's transfer thread, on its stream
    kv_pool = tier._pools.get(pool)  # the floor's: checked once, not per call
    buffers = VerdictBuffers(dev, 1, lay.page_bytes, lay.page_size)
    part = torch.empty(lay.slot_bytes, dtype=torch.uint8, device=dev)
    store_id = floor_store.store_id
    torch.cuda.synchronize()

    stamps = {"gdskv": Stamps(), "raw": Stamps(), "floor": Stamps()}
    stamp_backend(tier.backend, stamps["gdskv"])
    stamp_backend(raw, stamps["raw"])
    stamp_backend(floor, stamps["floor"])
    if args.gpu_sync:
        copies_done = tier._copies_done

        def stamped_sync(gpu) -> None:
            stamps["gdskv"].t["sync"] = time.perf_counter()
            copies_done(gpu)
            stamps["gdskv"].t["synced"] = time.perf_counter()
        tier._copies_done = stamped_sync

    sb = lay.slot_bytes

    def gdskv_call(i: int) -> None:
        if tier.put([f"p{i}"], pool, slots[i]) != [True]:
            raise RuntimeError(f"put {i} failed")

    def raw_call(i: int) -> None:
        extents = raw_store.extents([i])
        outcome = raw.write(src[i * sb:(i + 1) * sb], extents).result()
        if outcome.errors:
            raise RuntimeError(f"raw write {i} failed: {outcome.errors}")
        os.fdatasync(raw_store.files[extents[0].file].fd)

    def floor_call(i: int) -> None:
        key = f"p{i}"
        spill = GpuSpill(PoolCopier(kv_pool, lay, slots[i], kd.gather_pages), [0], buffers,
                         lay.page_bytes, sb, stream)
        seq = journal.next_seq()
        spill.gather(part, [0], [slot_trailer.encode(FORMAT_VERSION, store_id, i, key, seq, 0,
                                                     GPU_PAGE)])
        extents = floor_store.extents([i])  # (while the GPU works, as the tier does)
        stamps["floor"].t["sync"] = time.perf_counter()
        stream.synchronize()
        stamps["floor"].t["synced"] = time.perf_counter()
        fut = floor.write(part, extents)
        checksum = int(spill.sums(1)[0])
        spill.done()
        commit = encode_all([Record(RecordKind.COMMIT, seq, i, checksum, GPU_PAGE, key)])
        if fut.result().errors:
            raise RuntimeError(f"floor write {i} failed")
        os.fdatasync(floor_store.files[extents[0].file].fd)
        journal.append(commit)

    calls = {"gdskv": gdskv_call, "raw": raw_call, "floor": floor_call}
    warm = 20  # the first calls of each (graph capture, first touches) are not counted
    for i in range(warm):  # (kvikio's threads exist once a call has used them)
        for who in calls:
            calls[who](i)
    if args.split_cpus:
        os.sched_setaffinity(0, cpus[:1])  # this (the calling) thread only
    rows: dict[str, list[dict]] = {who: [] for who in calls}
    turns = list(calls)
    for i in range(warm, n):
        order = turns[i % 3:] + turns[:i % 3]  # each kind first, second and last in turn
        for who in order:
            stamps[who].t.clear()
            t0 = time.perf_counter()
            calls[who](i)
            t1 = time.perf_counter()
            rows[who].append(stamps[who].phases(t0, t1))

    def med(who: str, key: str) -> float:
        return 1e6 * statistics.median(r[key] for r in rows[who])

    print(f"{n - warm} 1-page calls each ({lay.page_bytes} B pages, {sb} B slots), in turn, "
          f"{args.directory}"
          f"{', calling thread on CPU 0, the others off it' if args.split_cpus else ''}"
          f"{f', writes polled up to {poll} µs' if poll else ''}; "
          "medians in µs")
    print(f"{'phase':15s} {'gdskv':>9s} {'floor':>9s} {'raw':>9s} {'gdskv-raw':>10s} "
          f"{'floor-raw':>10s}")
    keys = PHASES + (("gpu_sync",) if args.gpu_sync else ()) + ("call",)
    for k in keys:
        g, f, r = med("gdskv", k), med("floor", k), med("raw", k)
        print(f"{k:15s} {g:9.1f} {f:9.1f} {r:9.1f} {g - r:10.1f} {f - r:10.1f}")
    raw_p50 = med("raw", "call")
    print(f"call p50 ratio to raw: gdskv {med('gdskv', 'call') / raw_p50:.3f}, "
          f"floor {med('floor', 'call') / raw_p50:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"geometry": args.geometry, "directory": args.directory, "rows": rows}, f)
    tier.close()
    journal.close()
    for b, st in zip(backends, stores):
        b.close()
        st.close()
    shutil.rmtree(args.directory, ignore_errors=True)


if __name__ == "__main__":
    main()
