"""CUDA graphs for the kernel launches a call shape repeats.

A restore into a GPU pool launches two Triton kernels per chunk (partial sums, then the
verifying scatter); a spill launches the gather and the partial sums. Each launch costs 25-90 µs
of host time (Triton's launcher binds and specializes every argument; measured per step in
``bench/results/*/call-overhead/steps.json``), more than the GPU needs for a 1-page call. The
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
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable

import torch

log = logging.getLogger(__name__)

#: graphs (and plainly launched keys) one thread keeps; beyond it, launches run plainly
MAX_GRAPHS = 128


class LaunchGraphs:
    """One thread's captured launch graphs (not thread-safe: keep one per thread)."""

    def __init__(self, device: torch.device, enabled: bool = True,
                 limit: int = MAX_GRAPHS) -> None:
        self.device = device
        self.enabled = enabled and device.type == "cuda"
        self.limit = limit
        self._graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self._seen: set[Hashable] = set()
        self._side = torch.cuda.Stream(device) if self.enabled else None
        self.replays = 0
        self.captures = 0

    def run(self, key: Hashable, launch: Callable[[], None]) -> None:
        """Run ``launch`` (kernel launches on the current stream) or the graph captured from it
        for ``key``; either way the work is queued on the current stream."""
        graph = self._graphs.get(key) if self.enabled else None
        if graph is None:
            if not self.enabled or key not in self._seen or len(self._graphs) >= self.limit:
                if len(self._seen) < 4 * self.limit:
                    self._seen.add(key)
                launch()
                return
            graph = self._capture(launch)
            if graph is None:
                launch()
                return
            self._graphs[key] = graph
        graph.replay()
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
