"""A restore call's checksum verdicts, decided on the GPU.

Where a tier stages on CUDA and restores into a KV pool, verifying a chunk the plain way costs
a device-to-host sync per chunk: hash the pages, read the sums back, compare on the host, then
launch the scatter. :class:`GpuVerdicts` replaces that with two launches per chunk and one
small read-back per call: the checksum kernel leaves each page's partial sums on the GPU, and
the verifying scatter (:func:`gdskv.kernels.scatter_pages_verified`) finishes them, compares
them with the stored checksums uploaded once per call, stores only the pages that match and
writes a flag per page. The host reads the flags once, after the call's last scatter, to say
which pages were hits. A page that does not match never reaches the pool (the kernel masks its
stores), so the guarantee is the same as the host comparison's: a miss, never wrong bytes.
A chunk shape the thread has restored before replays the two launches from a CUDA graph
(:mod:`gdskv.launch_graphs`): one launch call instead of two Triton launches.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import kernels as kd
from . import slot_trailer
from .copiers import PoolCopier
from .launch_graphs import LaunchGraphs


class VerdictBuffers:
    """Pinned and device buffers one thread's restores (and GPU spills, :mod:`gdskv.gpu_spill`)
    reuse: the call's slot indices and
    stored checksums going up, the partial sums of a chunk, and the flags coming back (a
    spill's trailers and checksums, which its seal kernel reads and writes in pinned memory),
    plus the thread's launch graphs (:mod:`gdskv.launch_graphs`), whose keys name these buffers.
    Allocating them per call (pinned memory especially) and slicing them per chunk cost more
    host time than the launches they serve; the kernels take whole buffers and an offset.
    Reuse is safe because a thread runs one call at a time and a call's copies are finished
    when it settles; a call that ended early (an exception) leaves ``clean`` false, and the
    next call waits for the stream before touching them."""

    def __init__(self, device: torch.device, chunk_pages: int, page_bytes: int,
                 page_size: int, graphs: bool = True) -> None:
        from gdskv.kernels.triton_checksum import chunks_per_page
        self.device = device
        self.page_size = page_size
        self.capacity = 0
        self.clean = True
        self.partial = torch.empty(chunk_pages, chunks_per_page(page_bytes), dtype=torch.int64,
                                   device=device)
        self.host_partial = torch.empty_like(self.partial, device="cpu", pin_memory=True)
        self.host_partial_np = self.host_partial.numpy()
        # A spill's slot trailers (encoded with checksum 0), which its seal kernel reads from
        # here, and its finished checksums, which the kernel writes here (gdskv.gpu_spill)
        words = slot_trailer.TRAILER_BYTES // 4
        self.host_trailers = torch.empty(chunk_pages, words, dtype=torch.int32, pin_memory=True)
        # its bytes, written through a memoryview (a slice assignment of bytes: no numpy call)
        self.host_trailers_bytes = memoryview(
            self.host_trailers.numpy().view(np.uint8).reshape(-1))
        self.host_sums = torch.empty(chunk_pages, dtype=torch.int64, pin_memory=True)
        self.host_sums_np = self.host_sums.numpy().view(np.uint64)
        self.crc_table = torch.from_numpy(
            slot_trailer.checksum_crc_table().view(np.int32)).to(device)
        self.graphs = LaunchGraphs(device, enabled=graphs)
        # the addresses a spill's graph key names, read once (each read is a torch call)
        self.spill_addresses = tuple(t.data_ptr() for t in (
            self.partial, self.host_trailers, self.host_sums, self.crc_table))

    def take(self, n: int) -> None:
        """Make room for a call of ``n`` pages (``host_want``, ``want``, ``ok``, ``host_flags``,
        ``host_slots``, ``slots``)."""
        if not self.clean:  # (the call that left them may have run on another stream)
            torch.cuda.synchronize(self.device)
        if n > self.capacity:
            self.capacity = max(n, 2 * self.capacity, 64)
            self.host_want = torch.empty(self.capacity, dtype=torch.int64, pin_memory=True)
            self.host_want_np = self.host_want.numpy().view(np.uint64)
            self.want = torch.empty(self.capacity, dtype=torch.int64, device=self.device)
            self.ok = torch.empty(self.capacity, dtype=torch.int8, device=self.device)
            self.host_flags = torch.empty(self.capacity, dtype=torch.int8, pin_memory=True)
            self.host_flags_np = self.host_flags.numpy()
            tokens = self.capacity * self.page_size
            self.host_slots = torch.empty(tokens, dtype=torch.int64, pin_memory=True)
            self.host_slots_np = self.host_slots.numpy()
            self.slots = torch.empty(tokens, dtype=torch.int64, device=self.device)
            # the addresses a restore's graph key names, read once (each read is a torch call)
            self.slot_addresses = (self.host_slots.data_ptr(), self.slots.data_ptr())
            self.restore_addresses = (self.partial.data_ptr(), self.host_want.data_ptr(),
                                      self.want.data_ptr(),
                                      self.ok.data_ptr(), self.host_flags.data_ptr())
            self.graphs.clear()  # their keys name the buffers just replaced
        self.clean = False

    @property
    def slot_buffers(self) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """Where a call's slot indices go up (:meth:`PoolCopier.prepare`'s ``into``): the
        same buffers every call of this thread, so the launch graphs can name them."""
        return self.host_slots_np, self.host_slots, self.slots


class GpuVerdicts:
    """Verdicts for the pages of one restore call, in the call's read order (``wants[k]`` is
    the stored checksum of the call's ``k``-th page read)."""

    def __init__(self, wants: Sequence[int], buffers: VerdictBuffers,
                 page_bytes: int, slot_bytes: int,
                 stream: torch.cuda.Stream | None = None) -> None:
        self.page_bytes, self.slot_bytes = page_bytes, slot_bytes
        self._stream = stream  # the current one, where the tier holds it (a direct launch)
        buffers.take(len(wants))
        self._buf = buffers
        # They go up inside each chunk's launch graph (a kernel node, :func:`kd.upload`), not
        # by a copy call of their own, which cost a cold host 33 µs of a 1-page restore once
        # its read no longer hid it (the read on the calling thread,
        # bench/results/h200-2026-11-26/call-overhead-12/call4/lines_xget.txt).
        buffers.host_want_np[:len(wants)] = wants
        self.pages = len(wants)
        # the call's slot indices in the pinned buffer, not yet uploaded: the entries each
        # chunk's launches copy up first (0: none; see upload_slots)
        self._upload = 0
        self._uploaded = False
        self._queued: list[tuple[int, int]] = []   # (first position, pages) per chunk
        self._plans: dict[int, tuple] = {}         # first position -> (part, pages, last, launches)
        self._read_back = False

    @property
    def slot_buffers(self) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """See :attr:`VerdictBuffers.slot_buffers`."""
        return self._buf.slot_buffers

    def upload_slots(self, n: int) -> None:
        """The call's slot indices are in the pinned buffer's first ``n`` entries
        (:meth:`PoolCopier.prepare` with ``defer_upload``): each chunk's launches copy them
        up first, one kernel node in its graph instead of a copy call of its own (10 µs of a
        cold host's time for a 1-page restore)."""
        self._upload = n

    def slots_uploaded(self) -> None:
        """Make sure the indices are on the device before a plain (not verified) scatter reads
        them: queued here if no chunk's launches have copied them up yet."""
        if self._upload and not self._uploaded:
            kd.upload(self._buf.host_slots, self._buf.slots, self._upload)
            self._uploaded = True

    def plan(self, drain: PoolCopier, part: torch.Tensor, first: int, page_idx: list[int],
             last: bool = False) -> None:
        """Make a chunk's launches and their graph key ahead of :meth:`scatter` (the call's
        slot indices must be prepared): done while the chunk's read is under way, this host
        work (tens of µs on a busy host) is off the path from the read's end to the return."""
        self._plans[first] = (part, len(page_idx), last,
                              self._launches(drain, part, first, page_idx, last))

    def scatter(self, drain: PoolCopier, part: torch.Tensor, first: int,
                page_idx: list[int], last: bool = False) -> None:
        """Queue the verify + scatter of ``part``'s pages, the call's pages ``first`` .. on;
        ``last``: the call's last chunk, whose launches also copy the flags to the host (one
        step fewer for the call to queue: :meth:`read_back` then has nothing to do)."""
        n = len(page_idx)
        plan = self._plans.pop(first, None)
        if plan is not None and plan[0] is part and plan[1] == n and plan[2] == last:
            key, launch = plan[3]
        else:
            key, launch = self._launches(drain, part, first, page_idx, last)
        self._buf.graphs.run(key, launch, self._stream)
        self._uploaded = True  # (by these launches, if the call had any to upload)
        self._queued.append((first, n))
        self._read_back = last

    def _launches(self, drain: PoolCopier, part: torch.Tensor, first: int,
                  page_idx: list[int], last: bool) -> tuple[tuple, object]:
        """(graph key, the launches) of a chunk's verify + scatter."""
        n, buf = len(page_idx), self._buf
        slots, address = drain.graph_slots(page_idx)
        table = drain.pool.row_table
        upload, pages = self._upload, self.pages

        def launch() -> None:
            # the call's stored checksums and (if still in host memory) its slot indices, which
            # the verifying scatter reads (each chunk's graph copies them: the same few KiB)
            kd.upload(buf.host_want, buf.want, pages)
            if upload:
                kd.upload(buf.host_slots, buf.slots, upload)
            partial = kd.page_partial_sums(part, n, self.page_bytes, self.slot_bytes,
                                           out=buf.partial)
            kd.scatter_pages_verified(drain.pool, drain.layout,
                                      drain.chunk_slots(page_idx) if slots is None else slots,
                                      part,
                                      kd.Verdicts(partial, buf.want, buf.ok, self.page_bytes,
                                                  first))
            if last:
                buf.host_flags.copy_(buf.ok, non_blocking=True)

        # Every address and scalar the launches use (see gdskv.launch_graphs).
        return ("restore", part.data_ptr(), n, first, last, address, upload, pages,
                table.table.data_ptr(), table.align, buf.restore_addresses,
                buf.slot_addresses), launch

    def read_back(self) -> None:
        """Queue the flags' copy to the host (after every scatter queued so far)."""
        if self._queued and not self._read_back:
            self._buf.host_flags.copy_(self._buf.ok, non_blocking=True)
            self._read_back = True

    def settle(self) -> tuple[Sequence[int], list[int]]:
        """After the stream has synchronized: the positions of the queued pages that matched
        their checksums, and of those that did not. The usual long restore -- chunks queued one
        after the other, every page matched -- gets a ``range``: no step per page (a loop over
        a 32k-token prompt's 2,047 pages took 0.4 ms on the H100's host)."""
        self._buf.clean = True
        if not self._read_back:
            return [], []
        queued = self._queued
        first = queued[0][0]
        end = queued[-1][0] + queued[-1][1]
        if sum(n for _, n in queued) == end - first:  # (queued in order: no gap between)
            if self._buf.host_flags_np[first:end].all():
                return range(first, end), []
            positions = np.arange(first, end)
        else:
            positions = np.concatenate([np.arange(f, f + n) for f, n in queued])
        ok = self._buf.host_flags_np[positions] != 0
        return positions[ok].tolist(), positions[~ok].tolist()
