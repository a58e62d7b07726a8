"""CUDA graphs for the kernel launches a call shape repeats.

A restore into a GPU pool launches two Triton kernels per chunk (partial sums, then the
verifying scatter); a spill launches the gather and the partial sums. Each launch costs 25-90 µs
of host time (Triton's launcher binds and specializes every argument; measured per step in
``bench/results/h100-2026-11-23/call-overhead/steps.json``), more than the GPU needs for a 1-page call. The
launches of one chunk read and write only buffers whose addresses a thread reuses call after
call (its staging part, its per-thread slot-index and verdict buffers, the pool's row table),
so :class:`LaunchGraphs` captures them once per *key* into a CUDA graph and replays it: one
``cudaGraphLaunch`` instead of two launches.

The rule that keeps this exact: a key names every address and scalar the launches use, so a
graph is replayed only where the same launches, with the same arguments, would run (what
those addresses hold at replay time is what the kernels read, as a launch would). The first
time a key is seen the launches run plainly, which compiles their kernel variants (a capture
must not compile); the second time they are captured and replayed. Captures are thread-local
(``capture_error_mode="thread_local"``), so other threads' CUDA work (other calls, kvikio's
compat-mode copies) goes on meanwhile. If a capture fails the object falls back to plain
launches for good and logs once why.

A caller that names the stream (``run(..., stream=)``) has the graph launched by a direct
``cudaGraphLaunch`` (cupy's runtime binding, :func:`graph_launcher`) instead of
``CUDAGraph.replay``: the same driver call without torch's wrapper around it (a device guard,
the generator bookkeeping our graphs have none of, a driver version query): 3-18 µs less of
a cold host's time per launch on an H200, by graph (``call1/`` and ``call3/`` of
``bench/results/h200-2026-11-26/call-overhead-7/``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable

import torch

log = logging.getLogger(__name__)

#: graphs (and plainly launched keys) one thread keeps; beyond it, launches run plainly
MAX_GRAPHS = 128


@functools.cache
def graph_launcher() -> Callable[[int, int], None] | None:
    """``cudaGraphLaunch(graph_exec, stream)`` as a Python call (cupy's runtime binding), or
    None where cupy is not installed (graphs are then replayed through torch)."""
    try:
        from cupy_backends.cuda.api import runtime
    except ImportError:
        return None
    return runtime.graphLaunch


class LaunchGraphs:
    """One thread's captured launch graphs (not thread-safe: keep one per thread)."""

    def __init__(self, device: torch.device, enabled: bool = True,
                 limit: int = MAX_GRAPHS) -> None:
        self.device = device
        self.enabled = enabled and device.type == "cuda"
        self.limit = limit
        # key -> (graph, its executable's handle for a direct launch; 0: replay it)
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, int]] = {}
        self._seen: set[Hashable] = set()
        self._side = torch.cuda.Stream(device) if self.enabled else None
        self._direct = True  # graphs launched through graph_launcher (until that fails)
        self.replays = 0
        self.captures = 0
        self.direct_launches = 0  # the replays launched through graph_launcher

    def run(self, key: Hashable, launch: Callable[[], None],
            stream: torch.cuda.Stream | None = None) -> None:
        """Run ``launch`` (kernel launches on the current stream) or the graph captured from it
        for ``key``; either way the work is queued on the current stream. ``stream``: the
        current stream, where the caller holds it (the graph is then launched directly)."""
        entry = self._graphs.get(key) if self.enabled else None
        if entry is None:
            if not self.enabled or key not in self._seen or len(self._graphs) >= self.limit:
                if len(self._seen) < 4 * self.limit:
                    self._seen.add(key)
                launch()
                return
            graph = self._capture(launch)
            if graph is None:
                launch()
                return
            entry = self._graphs[key] = (graph, graph.raw_cuda_graph_exec()
                                         if graph_launcher() is not None else 0)
        if stream is not None and entry[1] and self._direct:
            try:
                graph_launcher()(entry[1], stream.cuda_stream)
                self.direct_launches += 1
            except Exception as exc:  # noqa: BLE001 - cupy's runtime unusable here: replay
                self._direct = False
                log.warning("gdskv: launching a CUDA graph through cupy failed (%s); "
                            "replaying graphs through torch from now on", exc)
                entry[0].replay()
        else:
            entry[0].replay()
        self.replays += 1

    def _capture(self, launch: Callable[[], None]) -> torch.cuda.CUDAGraph | None:
        graph = torch.cuda.CUDAGraph()
        try:
            # Captured on a side stream (a capture does not run the work); replayed on the
            # caller's current stream, in order with the call's other work there.
            with torch.cuda.stream(self._side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    launch()
                finally:
                    graph.capture_end()
        except RuntimeError as exc:
            self.enabled = False
            self._graphs.clear()
            log.warning("gdskv: capturing kernel launches into a CUDA graph failed (%s); "
                        "launching them plainly from now on", exc)
            return None
        self.captures += 1
        return graph

    def clear(self) -> None:
        """Forget every graph (the buffers their keys name are being replaced)."""
        self._graphs.clear()
        self._seen.clear()
