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


class GpuVerdicts:
    """Verdicts for the pages of one restore call, in the call's read order (``wants[k]`` is
    the stored checksum of the call's ``k``-th page read)."""

    def __init__(self, wants: Sequence[int], device: torch.device, page_bytes: int,
                 slot_bytes: int) -> None:
        self.page_bytes, self.slot_bytes = page_bytes, slot_bytes
        host = torch.from_numpy(np.asarray(wants, dtype=np.uint64).view(np.int64))
        # From pinned memory the upload is asynchronous on the tier's stream, which every
        # kernel of the call runs on (torch keeps the pinned block until the copy has run).
        self._want = host.pin_memory().to(device, non_blocking=True)
        self._ok = torch.empty(len(wants), dtype=torch.int8, device=device)
        self._queued: list[tuple[int, int]] = []   # (first position, pages) per chunk
        self._flags: torch.Tensor | None = None

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
            self._flags = torch.empty(self._ok.shape, dtype=torch.int8, pin_memory=True)
            self._flags.copy_(self._ok, non_blocking=True)

    def settle(self) -> list[tuple[int, bool]]:
        """After the stream has synchronized: (position, matched) for every queued page."""
        if self._flags is None:
            return []
        flags = self._flags.numpy()
        return [(k, bool(flags[k])) for first, n in self._queued for k in range(first, first + n)]
