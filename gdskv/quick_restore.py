"""A small restore of host regions in one page-engine call (issue 47).

``get_pages`` on a CPU tier, where each page is one host region that moves in place, is how
the engines' host pools call gdskv (SGLang's host pool, vLLM's secondary tier, LMCache's L2
adapter, LightLLM's disk cache), often one page at a time from several threads. The general
path (:class:`gdskv.restore_call.RestoreCall` over :class:`gdskv.host_pages.InPlacePages`)
handles every case -- any regions, staging, the backend's pool, partial failures, retries --
and a 1-page call pays for it: about 240 Python function calls, 119-122 µs at p50 for a 64 KiB
page from /dev/shm on the H100 host, where a raw ``preadv`` of it takes 8-10 µs. Under the
interpreter lock that cost is what caps many threads' pages/s. This path makes about 100 calls
and takes 45-68 µs (``bench/results/h100-2026-11-28/quick-restore/``).

This path does only what a small call that goes right needs: pin the pages, read each whole
slot in one call of the page engine on the calling thread (the payload into the caller's
region, the rest of the slot into a scratch row) with each page's CRC-32C compared to its
stored one in the same call, unpin. When anything goes wrong -- a page read short, an I/O
error, a checksum that differs -- it unpins and hands the whole call to the general path, which
reads again and settles misses, drops and retries as ever. This call's read counts as the
first of its tries (``RestoreCall(reads_done=1)``), so a read that may pass (EIO) is tried as
often as before; a lasting failure (a file gone, a truncated slab, a damaged page), which the
general path drops after one read, is read once more. Either way the caller gets the same
results, and the same counters and journal records but the quick path's own counts
(``quick_restores``, ``quick_restores_handed_on``).

Quick restores are not combined with others in flight (:mod:`gdskv.call_combiner`): each
releases the GIL for its read, so calls from several threads overlap their I/O, where a batch
would read on one thread (16 threads of 2 MiB /dev/shm restores on the H100 host: 0.24-0.28x
raw ``preadv`` threads alone, 0.13-0.16x combined; 64 KiB alike either way).

A call takes this path (:meth:`QuickRestore.regions`) when the tier's backend reads checked
slots on the calling thread (posix), verification and ``io_on_caller`` are on, host regions
move in place, every page is one contiguous uint8 tensor of ``page_bytes`` in host memory
(4 KiB aligned, and the page whole 4 KiB blocks, under O_DIRECT), the regions do not overlap,
the call fits one on-caller read (``Backend.checked_read_bytes``) and one staging chunk's
pages, and every page found was checksummed with CRC-32C. Any other call goes the general
way, which also raises the errors a bad argument gets.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence

import numpy as np
import torch

from . import checksum
from .data_call import CallContext
from .host_pages import HostPagePath
from .layout import ALIGNMENT
from .memory import host_numpy
from .restore_call import RestoreCall
from .streams import CallStream


class QuickRestore:
    """One tier's quick path for small in-place restores (see the module)."""

    def __init__(self, ctx: CallContext, host_pages: HostPagePath) -> None:
        self.ctx = ctx
        self.host_pages = host_pages
        lay = ctx.layout
        self.page_bytes = lay.page_bytes
        self.slot_bytes = lay.slot_bytes
        # the most pages a call may have: one on-caller read, one staging chunk
        self.max_pages = min(ctx.chunk_pages, ctx.backend.checked_read_bytes // lay.slot_bytes)
        # under O_DIRECT a region must start on a 4 KiB boundary (the page is whole blocks)
        self._align = ALIGNMENT if host_pages.direct else 1

    @staticmethod
    def why_not(ctx: CallContext, host_pages: HostPagePath) -> str:
        """Why a tier has no quick restores ("" when it has)."""
        if not host_pages.enabled:
            return f"host regions do not move in place ({host_pages.why_not})"
        if not ctx.backend.checked_read_bytes:
            return f"backend {ctx.backend.name} has no checked read on the calling thread"
        if not ctx.verify:
            return "verify=false"
        if not ctx.io_on_caller:
            return "io_on_caller=false"
        if host_pages.direct and ctx.layout.page_bytes % ALIGNMENT:
            return "pages are not whole 4 KiB blocks (O_DIRECT)"
        if ctx.backend.checked_read_bytes < ctx.layout.slot_bytes:
            return "a slot is larger than one read on the calling thread"
        return ""

    def describe(self) -> dict:
        return {"enabled": True, "reason": f"get_pages of up to {self.max_pages} pages, one "
                "host region each: one checked read on the calling thread"}

    def regions(self, pages: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor] | None:
        """The call's regions, one per page, where the call can take this path; else None
        (the general path then checks the arguments and says what is wrong with them)."""
        n = len(pages)
        if not 0 < n <= self.max_pages:
            return None
        out = []
        pb, align, uint8 = self.page_bytes, self._align, torch.uint8
        for regions in pages:
            if len(regions) != 1:
                return None
            r = regions[0]
            if not (isinstance(r, torch.Tensor) and r.dtype is uint8 and r.dim() == 1
                    and r.is_cpu and r.is_contiguous() and r.numel() == pb
                    and r.data_ptr() % align == 0):
                return None
            out.append(r)
        if n > 1:  # a restore's regions must not overlap (one page's bytes in another's)
            starts = sorted(r.data_ptr() for r in out)
            if any(b - a < pb for a, b in zip(starts, starts[1:])):
                return None
        return out

    def run(self, keys: list[Hashable], regions: list[torch.Tensor],
            pages: Sequence[Sequence[torch.Tensor]], stream: CallStream | None) -> list[bool]:
        """Restore ``keys`` into ``regions`` (from :meth:`regions` of ``pages``): per page a
        hit or a miss, as :class:`RestoreCall` answers."""
        ctx = self.ctx
        directory = ctx.directory
        todo = directory.pin_for_read(keys)
        if not todo:
            return self._done(keys, [False] * len(keys), 0, 0.0)
        slots = [s for _, s, _ in todo]
        status = None
        tried = False
        try:
            if directory.all_use(slots, checksum.CRC32C):
                tried = True
                t0 = time.perf_counter()
                status = self._read(todo, regions)
                seconds = time.perf_counter() - t0
        except Exception:  # noqa: BLE001 - the general path reads again and settles it
            status = None
        finally:
            ctx.persist.journal_evictions(directory.unpin(slots))
        if status is None or np.count_nonzero(status):
            # another tier's checksums, or a page that did not read back whole and equal: the
            # general path settles it (reading again; this read was the first try)
            ctx.ledger.record({"quick_restores_handed_on": 1}, None)
            return RestoreCall(ctx, keys, self.host_pages.call(pages), stream,
                               reads_done=int(tried)).run()
        results = [False] * len(keys)
        for pos, _, _ in todo:
            results[pos] = True
        return self._done(keys, results, len(todo), seconds)

    def _read(self, todo: list, regions: list[torch.Tensor]) -> np.ndarray:
        """Read the pinned pages ``todo`` ((position, slot, checksum), in slot order) into
        their regions, checking each; the backend's status per page (0: read whole, equal)."""
        n, tail = len(todo), self.slot_bytes - self.page_bytes
        rows = self.host_pages.scratch(n * tail).reshape(n, tail)
        location = self.ctx.store.location
        places, memory = [], []
        want = np.empty(n, dtype=np.uint64)
        for j, (pos, slot, stored) in enumerate(todo):
            places.append(location(slot))
            memory.append(host_numpy(regions[pos]))
            memory.append(rows[j])
            want[j] = stored
        return self.ctx.backend.read_checked_on_caller(places, memory, self.slot_bytes,
                                                       self.page_bytes, want)

    def _done(self, keys: list, results: list[bool], hits: int, seconds: float) -> list[bool]:
        """The call's counters, as a :class:`RestoreCall` that read ``hits`` pages whole
        would record them."""
        self.ctx.ledger.record({"bytes_read": hits * self.page_bytes, "read_seconds": seconds,
                                "read_failed": 0, "corrupt_pages": 0, "unreadable_pages": 0,
                                "pages_read_in_place": hits, "get_pages": len(keys),
                                "hits": hits, "misses": len(keys) - hits,
                                "quick_restores": 1}, None)
        return results
