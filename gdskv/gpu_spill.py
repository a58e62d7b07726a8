"""A spill's gather, checksums and slot trailers on the GPU, replayed from a CUDA graph per chunk
shape.

A chunk of a spill from a GPU pool is gathered into its staging part (one Triton launch) and
hashed into partial sums (another); a third launch finishes each page's checksum and *seals*
its slot trailer in the part: the host encoded the trailers with checksum 0 before the gather
(everything in them but the checksum is known then), and the kernel puts the checksum in and
corrects the trailer's crc32c for it (:func:`gdskv.slot_trailer.checksum_crc_table`). The
checksums come back for the journal. So the part is ready to write after one sync, with no
host step between the GPU work and the write (before, the host finished the checksums, encoded
the trailers and uploaded them, and synchronized a second time: 0.19 ms of a 1-page spill on
the H100's host, ``bench/results/h100-2026-11-24/call-path/call2-shm-abab/timeline_new_2M.txt``).
:class:`GpuSpill` queues the slot indices' upload from host memory and the three launches (the
seal reading the trailers from, and writing the checksums to, pinned host memory) as one
launch of a graph captured per chunk shape
(:mod:`gdskv.launch_graphs`), into the calling thread's reused buffers
(:class:`gdskv.gpu_verdicts.VerdictBuffers`), whose addresses the graph keys name.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import kernels as kd
from . import slot_trailer
from .copiers import PoolCopier
from .gpu_verdicts import VerdictBuffers


class GpuSpill:
    """One spill call's chunks, gathered, summed and sealed on the call's stream (the current
    one)."""

    def __init__(self, fill: PoolCopier, order: Sequence[int], buffers: VerdictBuffers,
                 page_bytes: int, slot_bytes: int,
                 stream: torch.cuda.Stream | None = None) -> None:
        self.fill, self._buf = fill, buffers
        self._stream = stream  # the current one, where the tier holds it (a direct launch)
        self.page_bytes, self.slot_bytes = page_bytes, slot_bytes
        buffers.take(len(order))
        # indices from host memory go up inside each chunk's graph, not as a step of their own:
        # the call's (its first ``_upload`` entries of the pinned buffer; 0: none to upload)
        self._upload = len(order) * fill.layout.page_size \
            if fill.prepare(order, into=buffers.slot_buffers, defer_upload=True) else 0

    def gather(self, part: torch.Tensor, page_idx: list[int], trailers: list[bytes]) -> None:
        """Queue the chunk's gather into ``part``, its checksums and its slot trailers
        (``trailers``, encoded with checksum 0, sealed on the GPU, which writes the checksums
        into pinned host memory); :meth:`sums` reads them once the stream has synchronized."""
        n, buf, fill = len(page_idx), self._buf, self.fill
        # (the previous chunk's seal has read them: the tier synchronized before writing it)
        buf.host_trailers_bytes[:n * slot_trailer.TRAILER_BYTES] = \
            trailers[0] if n == 1 else b"".join(trailers)
        slots, address = fill.graph_slots(page_idx)
        table = fill.pool.row_table

        upload = self._upload

        def launch() -> None:
            # a kernel reading the pinned buffer (a kernel node: a memcpy node costs a graph
            # launch more host time, gdskv.kernels.triton_upload)
            if upload:  # the call's slot indices, which every gather program reads
                kd.upload(buf.host_slots, buf.slots, upload)
            fill.kernel(fill.pool, fill.layout,
                        fill.chunk_slots(page_idx) if slots is None else slots, part)
            partial = kd.page_partial_sums(part, n, self.page_bytes, self.slot_bytes,
                                           out=buf.partial)
            # The seal reads each trailer from pinned memory once and writes the checksums
            # there: no upload or copy-back nodes of their own, two nodes fewer to launch
            # and run (bench/results/h200-2026-11-26/call-overhead-8/)
            kd.seal_pages(part, n, partial, self.page_bytes, self.slot_bytes,
                          buf.host_trailers, slot_trailer.CHECKSUM_OFFSET,
                          slot_trailer.CRC_OFFSET, buf.crc_table, buf.host_sums)

        # Every address and scalar the launches use (see gdskv.launch_graphs).
        buf.graphs.run(("spill", part.data_ptr(), n, address, upload, table.table.data_ptr(),
                        table.align, buf.spill_addresses, buf.slot_addresses), launch,
                       self._stream)

    def sums(self, n: int) -> np.ndarray:
        """The chunk's page checksums, uint64 (after the stream has synchronized)."""
        return self._buf.host_sums_np[:n].copy()

    def done(self) -> None:
        """The call's copies have finished: the buffers are free for the thread's next call."""
        self._buf.clean = True
