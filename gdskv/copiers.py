"""Page copiers: how one data call moves its pages between the engine's memory and staging.

The tier makes a copier per call at the public entry point, where the arguments are checked. It
then uses the copier on its own CUDA stream: ``prepare(order)`` once, with the call's pages in
the order the tier will move them and before any of the call's I/O is queued; then
``copier(staging, page_idx)`` for each chunk. ``page_idx`` lists the chunk's pages as positions
in the call's keys, and the chunk's page ``j`` goes to or from slot ``j`` of ``staging``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence

import torch

from . import kernels
from .layout import KVLayout
from .pool import KVPool

#: gather_pages / scatter_pages: (pool, layout, token slots on the pool's device, staging)
KernelCopy = Callable[[object, KVLayout, torch.Tensor, torch.Tensor], None]


class PageCopier(abc.ABC):
    def prepare(self, order: Sequence[int]) -> None:
        """Get ready to move these pages in this order (once per call, before its I/O)."""

    @abc.abstractmethod
    def __call__(self, staging: torch.Tensor, page_idx: list[int]) -> None:
        """Fill (spill) or drain (restore) ``staging`` for these pages."""


class PoolCopier(PageCopier):
    """Gather from or scatter to the engine's KV pool at its token slots, through the kernels.

    The kernels need each chunk's slot indices on the pool's device. ``prepare`` uploads the
    whole call's indices once, in call order, on the tier's stream, and each chunk then takes
    its rows as a view. The caller's stream is never used for the upload: when that is the
    legacy default stream, a copy on it waits for every blocking stream's work, kvikio's
    compat-mode copies for other calls included. On an H100 this was no faster than one
    upload per chunk (256 MiB reads from /dev/shm, bench/RESULTS.md); it is one copy instead
    of one per chunk, and never on the caller's stream.
    """

    def __init__(self, pool: KVPool, layout: KVLayout, slots: torch.Tensor,
                 kernel: KernelCopy) -> None:
        self.pool = pool
        self.layout = layout
        self.slots = slots            # [pages, page_size], on the device the engine passed
        self.kernel = kernel
        self._order: list[int] = []
        self._row: dict[int, int] = {}        # page -> its row in _device_slots
        self._device_slots: torch.Tensor | None = None

    def prepare(self, order: Sequence[int]) -> None:
        if not order or self.pool.device.type != "cuda":
            return  # a host pool needs no upload: chunks are selected where they are
        order = list(order)
        if self.slots.device == self.pool.device and order == list(range(len(self.slots))):
            # The whole call in call order, indices already where the kernels run (the usual
            # small restore): use them as they are, no gather and no upload.
            self._device_slots = self.slots
            self._order = order
            self._row = {page: page for page in order}
            return
        idx = torch.as_tensor(order, dtype=torch.int64)
        if self.slots.device.type == "cpu":
            rows = self.slots.index_select(0, idx).pin_memory()
        else:
            rows = self.slots.index_select(0, idx.pin_memory().to(self.slots.device,
                                                                   non_blocking=True))
        # From pinned memory the copy is asynchronous on this (the tier's) stream, which the
        # kernels that use the indices run on too.
        self._device_slots = rows.to(self.pool.device, non_blocking=True)
        self._order = order
        self._row = {page: row for row, page in enumerate(order)}

    def _chunk_slots(self, page_idx: list[int]) -> torch.Tensor:
        first = self._row.get(page_idx[0]) if self._device_slots is not None else None
        if first is not None and self._order[first:first + len(page_idx)] == page_idx:
            return self._device_slots[first:first + len(page_idx)].reshape(-1)
        # Not a run of the prepared order (a chunk with failed pages taken out): this chunk's
        # indices go up on their own.
        idx = torch.as_tensor(page_idx, dtype=torch.int64, device=self.slots.device)
        chunk = self.slots.index_select(0, idx).reshape(-1)
        return chunk.to(self.pool.device, non_blocking=True)

    def __call__(self, staging: torch.Tensor, page_idx: list[int]) -> None:
        self.kernel(self.pool, self.layout, self._chunk_slots(page_idx), staging)

    def scatter_verified(self, staging: torch.Tensor, page_idx: list[int], verdicts) -> None:
        """Restore only the pages whose checksum matches (:class:`gdskv.gpu_verdicts.GpuVerdicts`
        says which): one launch that verifies and scatters."""
        kernels.scatter_pages_verified(self.pool, self.layout, self._chunk_slots(page_idx),
                                       staging, verdicts)


class RegionCopier(PageCopier):
    """Copy pages given as page-format byte regions (host pools that are already page-first):
    ``pages[i]`` is a list of 1-D uint8 tensors whose concatenation is page i."""

    def __init__(self, pages: Sequence[Sequence[torch.Tensor]], slot_bytes: int, *,
                 to_staging: bool) -> None:
        self.pages = pages
        self.slot_bytes = slot_bytes
        self.to_staging = to_staging

    def __call__(self, staging: torch.Tensor, page_idx: list[int]) -> None:
        for pos, i in enumerate(page_idx):
            off = pos * self.slot_bytes
            for r in self.pages[i]:
                dst = staging[off:off + r.numel()]
                if self.to_staging:
                    dst.copy_(r, non_blocking=True)
                else:
                    r.copy_(dst, non_blocking=True)
                off += r.numel()
