"""What each step of a small restore costs on its own, on the GPU (issue 14's breakdown).

A 1-page ``Tier.get`` in compat mode on /dev/shm took 1.1-1.3 ms against 0.6 ms for raw kvikio
(``call_profile.py``). This times, in isolation and with the same buffers a 1-page (and an
8-page) call uses, every step such a call makes: Triton launches, the checksum's readback,
events, the slot-index upload, and kvikio's read with and without a waiter thread. Host time
per step, median of many repetitions, after a warm-up.

    python bench/experiments/small_call_steps.py --directory /dev/shm/x [--pages 1 8]

Result it produced (bench/RESULTS.md, "Where the time goes"), under bench/results/:
``h200-2026-11-23/call-overhead/steps.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from experiment_helpers import geometry

import gdskv.kernels as kd
from gdskv.checksum import GpuPageChecksummer
from gdskv.copiers import PoolCopier
from gdskv.gpu_verdicts import GpuVerdicts, VerdictBuffers
from gdskv.pool import KVPool


def _median_us(fn, reps: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(1e6 * statistics.median(times), 1)


def steps(directory: str, pages: int, reps: int) -> dict:
    import kvikio
    lay = geometry("llama3-8b-p16")
    dev = torch.device("cuda")
    stream = torch.cuda.Stream(dev)
    staging = torch.empty(pages * lay.slot_bytes, dtype=torch.uint8, device=dev)
    shape = (lay.num_layers, 64 * lay.page_size, lay.kv_heads, lay.head_dim)
    pool = KVPool(lay, tuple(torch.zeros(shape, dtype=lay.torch_dtype, device=dev)
                             for _ in range(lay.kv_count)))
    slots_cpu = torch.arange(pages * lay.page_size, dtype=torch.int64) + 3 * lay.page_size
    slots_gpu = slots_cpu.to(dev)
    summer = GpuPageChecksummer(lay)
    path = os.path.join(directory, "steps.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(staging.numel()))
    cf = kvikio.CuFile(path, "r+")
    hop = ThreadPoolExecutor(1)
    out: dict = {"pages": pages, "page_bytes": lay.page_bytes}

    def sync():
        torch.cuda.current_stream().synchronize()

    with torch.cuda.stream(stream):
        out["checksum_launch_us"] = _median_us(
            lambda: kd.page_checksums(staging, pages, lay.page_bytes, lay.slot_bytes), reps)
        out["checksum_launch_and_sync_us"] = _median_us(
            lambda: (kd.page_checksums(staging, pages, lay.page_bytes, lay.slot_bytes), sync()),
            reps)
        out["checksum_compute_readback_us"] = _median_us(
            lambda: summer.compute(staging, pages), reps)
        # The fused restore path (gdskv.gpu_verdicts): partial sums, the verifying scatter,
        # and the call's stored checksums up / flags down.
        want = kd.page_checksums(staging, pages, lay.page_bytes, lay.slot_bytes)
        ok = torch.empty(pages, dtype=torch.int8, device=dev)
        partial = kd.page_partial_sums(staging, pages, lay.page_bytes, lay.slot_bytes)
        verdicts = kd.Verdicts(partial, want, ok, lay.page_bytes)
        out["partial_sums_launch_us"] = _median_us(
            lambda: kd.page_partial_sums(staging, pages, lay.page_bytes, lay.slot_bytes), reps)
        out["verified_scatter_launch_us"] = _median_us(
            lambda: kd.scatter_pages_verified(pool, lay, slots_gpu, staging, verdicts), reps)
        buffers = VerdictBuffers(dev, pages, lay.page_bytes)
        wants = [int(w) for w in want.cpu().numpy().view("uint64")]

        def verdicts_round_trip():
            v = GpuVerdicts(wants, buffers, lay.page_bytes, lay.slot_bytes)
            v.scatter(PoolCopier(pool, lay, slots_gpu, kd.scatter_pages),
                      staging, 0, list(range(pages)))
            v.read_back()
            sync()
            matched, failed = v.settle()
            assert len(matched) == pages and not failed
        out["verdicts_upload_verify_scatter_readback_us"] = _median_us(verdicts_round_trip, reps)
        out["scatter_launch_us"] = _median_us(
            lambda: kd.scatter_pages(pool, lay, slots_gpu, staging), reps)
        out["scatter_launch_and_sync_us"] = _median_us(
            lambda: (kd.scatter_pages(pool, lay, slots_gpu, staging), sync()), reps)
        out["empty_sync_us"] = _median_us(sync, reps)
        out["event_record_and_sync_us"] = _median_us(
            lambda: torch.cuda.Event().record(stream) or torch.cuda.current_stream().synchronize(),
            reps)
        out["slots_upload_pinned_us"] = _median_us(
            lambda: slots_cpu.pin_memory().to(dev, non_blocking=True), reps)
        out["slots_upload_pageable_us"] = _median_us(lambda: slots_cpu.to(dev), reps)
    n = staging.numel()
    out["kvikio_pread_inline_us"] = _median_us(lambda: cf.pread(staging, n, 0).get(), reps)
    out["kvikio_pread_waiter_thread_us"] = _median_us(
        lambda: hop.submit(cf.pread(staging, n, 0).get).result(), reps)
    cf.close()
    hop.shutdown()
    os.unlink(path)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--directory", required=True)
    p.add_argument("--pages", type=int, nargs="+", default=[1, 8])
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("small_call_steps: needs a CUDA device")
    res = {"device": torch.cuda.get_device_name(), "runs": [steps(args.directory, n, args.reps)
                                                             for n in args.pages]}
    for run in res["runs"]:
        print(f"--- {run['pages']} page(s)")
        for k, v in run.items():
            if k.endswith("_us"):
                print(f"  {v:8.1f} us  {k[:-3]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
