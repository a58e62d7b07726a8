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
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import kernels as kd
from .copiers import PoolCopier


class VerdictBuffers:
    """Pinned and device buffers one thread's restores reuse: the stored checksums going up
    and the flags coming back. Allocating them per call (pinned memory especially) cost more
    than the launches they serve. Reuse is safe because a thread runs one call at a time and a
    call's copies are finished when it settles; a call that ended early (an exception) leaves
    ``clean`` false, and the next call waits for the stream before touching them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.capacity = 0
        self.clean = True

    def take(self, n: int, stream) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                           torch.Tensor]:
        """(host want, device want, device ok, host flags), each with room for ``n`` pages."""
        if not self.clean:
            stream.synchronize()
        if n > self.capacity:
            self.capacity = max(n, 2 * self.capacity, 64)
            self.host_want = torch.empty(self.capacity, dtype=torch.int64, pin_memory=True)
            self.want = torch.empty(self.capacity, dtype=torch.int64, device=self.device)
            self.ok = torch.empty(self.capacity, dtype=torch.int8, device=self.device)
            self.host_flags = torch.empty(self.capacity, dtype=torch.int8, pin_memory=True)
        self.clean = False
        return self.host_want, self.want, self.ok, self.host_flags


class GpuVerdicts:
    """Verdicts for the pages of one restore call, in the call's read order (``wants[k]`` is
    the stored checksum of the call's ``k``-th page read)."""

    def __init__(self, wants: Sequence[int], buffers: VerdictBuffers, stream,
                 page_bytes: int, slot_bytes: int) -> None:
        self.page_bytes, self.slot_bytes = page_bytes, slot_bytes
        n = len(wants)
        self._buffers = buffers
        host_want, want, self._ok, self._host_flags = buffers.take(n, stream)
        host_want.numpy()[:n] = np.asarray(wants, dtype=np.uint64).view(np.int64)
        # From pinned memory the upload is asynchronous on the tier's stream, which every
        # kernel of the call runs on.
        self._want = want[:n]
        self._want.copy_(host_want[:n], non_blocking=True)
        self._n = n
        self._queued: list[tuple[int, int]] = []   # (first position, pages) per chunk
        self._read_back = False

    def scatter(self, drain: PoolCopier, part: torch.Tensor, first: int,
                page_idx: list[int]) -> None:
        """Queue the verify + scatter of ``part``'s pages, the call's pages ``first`` .. on."""
        n = len(page_idx)
        partial = kd.page_partial_sums(part, n, self.page_bytes, self.slot_bytes)
        drain.scatter_verified(part, page_idx, kd.Verdicts(
            partial, self._want[first:first + n], self._ok[first:first + n], self.page_bytes))
        self._queued.append((first, n))

    def read_back(self) -> None:
        """Queue the flags' copy to the host (after every scatter queued so far)."""
        if self._queued:
            self._host_flags[:self._n].copy_(self._ok[:self._n], non_blocking=True)
            self._read_back = True

    def settle(self) -> list[tuple[int, bool]]:
        """After the stream has synchronized: (position, matched) for every queued page."""
        self._buffers.clean = True
        if not self._read_back:
            return []
        flags = self._host_flags.numpy()
        return [(k, bool(flags[k])) for first, n in self._queued for k in range(first, first + n)]
