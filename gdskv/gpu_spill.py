"""A spill's gather and checksums on the GPU, replayed from a CUDA graph per chunk shape.

A chunk of a spill from a GPU pool is gathered into its staging part (one Triton launch),
hashed into partial sums (another), and the sums are read back for the host to finish: the
slot trailers and the journal need them there (:class:`gdskv.checksum.GpuPageChecksummer`).
:class:`GpuSpill` queues those three steps as one replay of a graph captured per chunk shape
(:mod:`gdskv.launch_graphs`), into the calling thread's reused buffers
(:class:`gdskv.gpu_verdicts.VerdictBuffers`), whose addresses the graph keys name.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import kernels as kd
from .copiers import PoolCopier
from .gpu_verdicts import VerdictBuffers


class GpuSpill:
    """One spill call's chunks, gathered and summed on the tier's stream."""

    def __init__(self, fill: PoolCopier, order: Sequence[int], buffers: VerdictBuffers,
                 stream, page_bytes: int, slot_bytes: int) -> None:
        self.fill, self._buf = fill, buffers
        self.page_bytes, self.slot_bytes = page_bytes, slot_bytes
        buffers.take(len(order), stream)
        fill.prepare(order, into=buffers.slot_buffers)

    def gather(self, part: torch.Tensor, page_idx: list[int]) -> None:
        """Queue the chunk's gather into ``part``, its partial sums and their copy to the host;
        :meth:`sums` reads them once the stream has synchronized."""
        n, buf, fill = len(page_idx), self._buf, self.fill
        slots, address = fill.graph_slots(page_idx)
        table = fill.pool.row_table

        def launch() -> None:
            fill.kernel(fill.pool, fill.layout,
                        fill.chunk_slots(page_idx) if slots is None else slots, part)
            kd.page_partial_sums(part, n, self.page_bytes, self.slot_bytes, out=buf.partial)
            buf.host_partial.copy_(buf.partial, non_blocking=True)

        # Every address and scalar the launches use (see gdskv.launch_graphs).
        buf.graphs.run(("spill", part.data_ptr(), n, address, table.table.data_ptr(),
                        table.align, buf.partial.data_ptr(), buf.host_partial.data_ptr()),
                       launch)

    def sums(self, n: int) -> np.ndarray:
        """The chunk's page checksums (after the stream has synchronized)."""
        return kd.checksum.finalize_partials_host(self._buf.host_partial_np[:n],
                                                  self.page_bytes)

    def done(self) -> None:
        """The call's copies have finished: the buffers are free for the thread's next call."""
        self._buf.clean = True
