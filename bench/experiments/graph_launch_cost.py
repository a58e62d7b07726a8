"""Host time of launching a 1-page spill's CUDA graph, by graph shape and launcher (issue 14).

A real tier spills 1-page calls (Llama-3-8B bf16, 16-token pages, GPU pool, kvikio) until its
thread has captured the spill graph (:mod:`gdskv.gpu_spill`); then the same launches (gather,
partial sums, seal, checksums back) are captured again in three shapes:

- ``memcpy uploads``: the slot indices and trailers go up as memcpy nodes (the code before
  ``kernels/triton_upload.py``), the checksums come back by a memcpy node;
- ``kernel uploads``: they go up as kernels reading pinned memory (the code after);
- ``host buffers``: the slot indices go up by a kernel, the seal kernel reads the trailers
  from pinned memory and writes the checksums there (the code after ``call-overhead-8``);
- ``kernels only``: no uploads and no copy back (a floor);

and each is launched by ``CUDAGraph.replay`` and by ``cudaGraphLaunch`` through cupy
(:func:`gdskv.launch_graphs.graph_launcher`). A launch call is timed alone, 500 times, cold
(after a 0.7 ms sleep, as a spill's launch comes after the thread slept through its previous
call's write) and hot (back to back); the stream is synchronized after each, and the launch
and that sync are timed together too (hot: the graph's time on the GPU as the host sees it).
The medians are printed, with a few torch calls for scale.

    python bench/experiments/graph_launch_cost.py /dev/shm/x

Results it produced: ``h200-2026-11-26/call-overhead-7/call3/graph_launch_cost.txt`` (the
first three shapes), ``h200-2026-11-26/call-overhead-8/`` (all four, with the sync).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("directory", help="scratch directory for the tier (emptied)")
    ap.add_argument("--reps", type=int, default=500)
    args = ap.parse_args()

    import torch

    from gdskv import gpu_spill, slot_trailer
    from gdskv import kernels as kd
    from gdskv.config import TierConfig
    from gdskv.launch_graphs import LaunchGraphs, graph_launcher
    from gdskv.layout import KVLayout
    from gdskv.streams import OnStream
    from gdskv.tier import Tier

    seen = {}
    gather = gpu_spill.GpuSpill.gather

    def spy(self, part, page_idx, trailers):  # the last spill's chunk, to rebuild its launches
        seen["chunk"] = (self, part, list(page_idx))
        return gather(self, part, page_idx, trailers)
    gpu_spill.GpuSpill.gather = spy

    shutil.rmtree(args.directory, ignore_errors=True)
    os.makedirs(args.directory)
    dev = torch.device("cuda")
    lay = KVLayout(32, 16, 128, 8)
    tier = Tier(lay, TierConfig(directories=(args.directory,), capacity=4 << 30,
                                backend="kvikio"), device=dev)
    pool = tuple(torch.randn(32, 64 * 16, 8, 128, device=dev).to(torch.bfloat16)
                 for _ in range(2))
    stream = torch.cuda.Stream(dev)
    OnStream(stream).__enter__()
    for i in range(40):
        tier.put([f"k{i}"], pool, torch.arange(i % 64 * 16, i % 64 * 16 + 16))
    tier_graph = next(g for o in gc.get_objects() if isinstance(o, LaunchGraphs)
                      for g, _ in o._graphs.values())
    spill, part, page_idx = seen["chunk"]
    buf, fill, n = spill._buf, spill.fill, len(page_idx)
    slots, _ = fill.graph_slots(page_idx)
    words = n * slot_trailer.TRAILER_BYTES // 4
    # device copies of the trailers and checksums, for the shapes that move them by nodes
    trailers = torch.empty_like(buf.host_trailers, device=dev)
    sums = torch.empty_like(buf.host_sums, device=dev)

    def launches(uploads: str):
        on_host = uploads == "host"
        def launch() -> None:
            if uploads == "memcpy":
                buf.slots.copy_(buf.host_slots, non_blocking=True)
                trailers.copy_(buf.host_trailers, non_blocking=True)
            elif uploads in ("kernel", "host"):
                kd.upload(buf.host_slots, buf.slots, n * lay.page_size)
            if uploads == "kernel":
                kd.upload(buf.host_trailers, trailers, words)
            fill.kernel(fill.pool, fill.layout,
                        fill.chunk_slots(page_idx) if slots is None else slots, part)
            partial = kd.page_partial_sums(part, n, spill.page_bytes, spill.slot_bytes,
                                           out=buf.partial)
            kd.seal_pages(part, n, partial, spill.page_bytes, spill.slot_bytes,
                          buf.host_trailers if on_host else trailers,
                          slot_trailer.CHECKSUM_OFFSET, slot_trailer.CRC_OFFSET, buf.crc_table,
                          buf.host_sums if on_host else sums)
            if uploads in ("memcpy", "kernel"):
                buf.host_sums.copy_(sums, non_blocking=True)
        return launch

    def capture(launch):
        launch()
        torch.cuda.synchronize()
        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream(dev)
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            launch()
            graph.capture_end()
        torch.cuda.synchronize()
        return graph

    direct = graph_launcher()
    handle = stream.cuda_stream
    keep = []
    calls = {"replay, the tier's own graph": tier_graph.replay}
    for shape, uploads in (("memcpy uploads", "memcpy"), ("kernel uploads", "kernel"),
                           ("host buffers", "host"), ("kernels only", "none")):
        graph = capture(launches(uploads))
        keep.append(graph)
        calls[f"replay, {shape}"] = graph.replay
        if direct is not None:
            calls[f"cudaGraphLaunch, {shape}"] = \
                lambda e=graph.raw_cuda_graph_exec(): direct(e, handle)
    calls["torch.cuda.current_stream()"] = torch.cuda.current_stream
    calls["stream.synchronize(), idle"] = stream.synchronize
    print(f"{'launch call':40s} {'cold µs':>8s} {'hot µs':>8s} {'+sync, cold':>12s} "
          f"{'+sync, hot':>11s}   ({args.reps} calls each, medians; "
          f"{torch.cuda.get_device_name()})")
    for name, fn in calls.items():
        med = {}
        for mode in ("cold", "hot"):
            times, synced = [], []
            for _ in range(args.reps):
                if mode == "cold":
                    time.sleep(0.0007)
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                stream.synchronize()
                times.append(t1 - t0)
                synced.append(time.perf_counter() - t0)
            med[mode] = 1e6 * statistics.median(times[len(times) // 10:])
            med[mode + "+sync"] = 1e6 * statistics.median(synced[len(synced) // 10:])
        print(f"{name:40s} {med['cold']:8.1f} {med['hot']:8.1f} {med['cold+sync']:12.1f} "
              f"{med['hot+sync']:11.1f}")
    tier.close()


if __name__ == "__main__":
    main()
