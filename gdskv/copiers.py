"""Page copiers: how one data call moves its pages between the engine's memory and staging.

The tier makes a copier per call at the public entry point, where the arguments are checked. It
then uses the copier on its own CUDA stream: ``prepare(order)`` once, with the call's pages in
the order the tier will move them, before the first chunk is filled or drained (a restore
submits its first read first and uploads the indices while it runs); then
``copier(staging, page_idx)`` for each chunk. ``page_idx`` lists the chunk's pages as positions
in the call's keys, and the chunk's page ``j`` goes to or from slot ``j`` of ``staging``.
"""

from __future__ import annotations

import abc
import ctypes
from collections.abc import Callable, Sequence

import torch

from . import kernels
from .layout import KVLayout
from .pool import KVPool

#: gather_pages / scatter_pages: (pool, layout, token slots on the pool's device, staging)
KernelCopy = Callable[[object, KVLayout, torch.Tensor, torch.Tensor], None]


class PageCopier(abc.ABC):
    def prepare(self, order: Sequence[int], into=None, defer_upload: bool = False) -> bool:
        """Get ready to move these pages in this order (once per call, before its first
        chunk is filled or drained; a restore's first read may be under way already).
        Returns whether an upload was left to the caller (see :meth:`PoolCopier.prepare`)."""
        return False

    @abc.abstractmethod
    def __call__(self, staging: torch.Tensor, page_idx: list[int]) -> None:
        """Fill (spill) or drain (restore) ``staging`` for these pages."""


class PoolCopier(PageCopier):
    """Gather from or scatter to the engine's KV pool at its token slots, through the kernels.

    The kernels need each chunk's slot indices on the pool's device. ``prepare`` uploads the
    whole call's indices once, in call order, on the call's stream, and each chunk then takes
    its rows as a view. The legacy default stream is never used for the upload: a copy on it
    waits for every blocking stream's work, kvikio's compat-mode copies for other calls
    included. On an H100 this was no faster than one
    upload per chunk (256 MiB reads from /dev/shm, bench/RESULTS.md); it is one copy instead
    of one per chunk, and never on the caller's stream.
    """

    def __init__(self, pool: KVPool, layout: KVLayout, slots: torch.Tensor,
                 kernel: KernelCopy) -> None:
        """``slots``: the call's token slot indices, flat (``pages * page_size``, pages one
        after the other), on the device the engine passed them on."""
        self.pool = pool
        self.layout = layout
        self.flat_slots = slots
        # (ints and flags, not tensor queries: each costs host time on every small call)
        self._pages = slots.shape[0] // layout.page_size
        self._host = slots.is_cpu
        self.kernel = kernel
        self._order: list[int] = []
        self._row: dict[int, int] = {}        # page -> its row in _device_slots
        self._device_slots: torch.Tensor | None = None
        self._slots_ptr = 0         # _device_slots' address and its entries' size
        self._slot_size = 0

    def prepare(self, order: Sequence[int], into=None, defer_upload: bool = False) -> bool:
        """``into``: (pinned int64 numpy view, its tensor, a device int64 tensor), each of at
        least ``len(order) * page_size`` entries: the indices go up into these buffers (which
        a thread reuses, so launch graphs can name them) instead of new ones.
        ``defer_upload`` (with ``into``): indices in host memory are only put in the pinned
        buffer; returns True when they were, and the caller must queue the copy
        ``into[2].copy_(into[1], non_blocking=True)`` before the kernels read them (a spill's
        launch graph does: one host step fewer)."""
        if not order or self.pool.device.type != "cuda":
            return False  # a host pool needs no upload: chunks are selected where they are
        order = list(order)
        in_call_order = order == list(range(self._pages))
        if into is not None:
            host_np, host, device_slots = into
            n = len(order) * self.layout.page_size
            if self._host:
                flat = self.flat_slots
                if in_call_order and flat.dtype == torch.int64:
                    # one memmove: the numpy view a slice assignment needs cost a cold host
                    # more time (13 µs, bench/results/h200-2026-11-26/call-overhead-7/call2/)
                    ctypes.memmove(host.data_ptr(), flat.data_ptr(), n * 8)
                else:
                    flat = flat.numpy()
                    host_np[:n] = flat if in_call_order else \
                        flat.reshape(self._pages, -1)[order].reshape(-1)
                self._use(order, device_slots)
                if defer_upload:
                    return True
                # the whole (small) buffer from pinned memory: asynchronous, no slice op
                device_slots.copy_(host, non_blocking=True)
                return False
            rows = self.slots if in_call_order else self.slots.index_select(
                0, torch.as_tensor(order, device=self.slots.device))
            device_slots[:n].copy_(rows.reshape(-1))
            self._use(order, device_slots)
            return False
        if self.flat_slots.device == self.pool.device and in_call_order:
            # The whole call in call order, indices already where the kernels run (the usual
            # small restore): use them as they are, no gather and no upload.
            self._use(order, self.flat_slots)
            return False
        idx = torch.as_tensor(order, dtype=torch.int64)
        if self._host:
            rows = self.slots.index_select(0, idx).pin_memory()
        else:
            rows = self.slots.index_select(0, idx.pin_memory().to(self.slots.device,
                                                                   non_blocking=True))
        # From pinned memory the copy is asynchronous on this (the call's) stream, which the
        # kernels that use the indices run on too.
        self._use(order, rows.to(self.pool.device, non_blocking=True).reshape(-1))
        return False

    @property
    def slots(self) -> torch.Tensor:
        """The call's token slot indices as ``[pages, page_size]`` (a view of the flat ones)."""
        return self.flat_slots.view(self._pages, self.layout.page_size)

    def _use(self, order: list[int], device_slots: torch.Tensor) -> None:
        """``device_slots``: flat, the indices of ``order``'s pages one after the other."""
        self._device_slots = device_slots
        self._slots_ptr, self._slot_size = device_slots.data_ptr(), device_slots.element_size()
        self._order = order
        self._row = {page: row for row, page in enumerate(order)}

    def _prepared_row(self, page_idx: list[int]) -> int | None:
        """The row of the chunk's first page in the prepared indices, when the chunk is a run of
        the prepared order (None: its indices were not prepared that way)."""
        first = self._row.get(page_idx[0]) if self._device_slots is not None else None
        if first is not None and self._order[first:first + len(page_idx)] == page_idx:
            return first
        return None

    def chunk_slots_address(self, page_idx: list[int]) -> int | None:
        """Where :meth:`chunk_slots` would point, without making the view (a launch graph's key
        needs only the address; a replay no tensor), or None when it would upload them anew."""
        first = self._prepared_row(page_idx)
        if first is None:
            return None
        return self._slots_ptr + first * self.layout.page_size * self._slot_size

    def graph_slots(self, page_idx: list[int]) -> tuple[torch.Tensor | None, int]:
        """A chunk's slot indices for a launch graph's key: (None, their address) when they are
        a view of the prepared indices (the view is made only if the launches run plainly),
        else (the freshly uploaded tensor, its address)."""
        address = self.chunk_slots_address(page_idx)
        if address is not None:
            return None, address
        slots = self.chunk_slots(page_idx)
        return slots, slots.data_ptr()

    def chunk_slots(self, page_idx: list[int]) -> torch.Tensor:
        """The chunk's token slot indices on the pool's device, flat."""
        first = self._prepared_row(page_idx)
        if first is not None:
            ps = self.layout.page_size
            return self._device_slots[first * ps:(first + len(page_idx)) * ps]
        # Not a run of the prepared order (a chunk with failed pages taken out): this chunk's
        # indices go up on their own.
        idx = torch.as_tensor(page_idx, dtype=torch.int64, device=self.slots.device)
        chunk = self.slots.index_select(0, idx).reshape(-1)
        return chunk.to(self.pool.device, non_blocking=True)

    def __call__(self, staging: torch.Tensor, page_idx: list[int]) -> None:
        self.kernel(self.pool, self.layout, self.chunk_slots(page_idx), staging)


class DeferredCopier:
    """A restore's :class:`PoolCopier`, made (its arguments checked) on first use: the tier
    makes it once the call's first read is under way, so the checks overlap the I/O. ``make``
    raises what the checks raise."""

    def __init__(self, make: Callable[[], PageCopier]) -> None:
        self.make = make


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
