"""Host pages in place: ``put_pages`` / ``get_pages`` on a CPU tier without the staging copy.

A page given as host regions is written straight from the caller's memory and read straight
into it. The payload moves between the regions and the slab file; what is not the caller's --
the slot trailer and the padding before it, and with O_DIRECT the payload's last partial 4 KiB
block -- goes through a small aligned scratch row per page, in the same ``pwritev``/``preadv``
(the backend gets extents carrying their own memory, ``Extent.memory``). The checksum is
computed on the caller's bytes before a write and verified on them after a read (CRC-32C over
the regions by the page engine, :mod:`gdskv.native`: the same value the staging path computes
over staging, so pages written either way read back either way). On a read through the posix
backend each page is checksummed in the same page engine call that reads it, by the I/O thread
(``Extent.moved`` hands the sums back); pages no such call checksummed (other backends, a failed
piece) are checksummed after the read, as a write's pages are before it.
Slot reservation, trailers, journal, sync policy, commit or abort, pins and stats are the
tier's own (:mod:`.spill_call`, :mod:`.restore_call`).

When it applies (:meth:`HostPagePath.in_place`): the tier stages in host memory, its backend
moves host memory itself (posix, kvikio; NIXL would have to register every call's regions with
its agent, so it keeps staging), ``config.in_place`` is on, and -- where the slab files are
opened with O_DIRECT -- every region but the last starts on a 4 KiB boundary and is whole 4 KiB
blocks. The last region moves in place too if it starts on a boundary (its partial last block
through the scratch row); if not, all of it goes through the scratch row, so a page whose last
region sits at an unaligned address (SGLang's DSA indexer after its KV page) still reads its
aligned bulk in place with O_DIRECT. A page with no aligned leading region goes through staging
as before, in the same call. ``Tier.stats()`` counts both (``pages_written_in_place``,
``pages_read_in_place``, ``region_pages_staged``) and says why in-place is off where it is
(``in_place``).

A read that fails (an I/O error, a checksum mismatch) is a miss as ever, but the caller's
regions of a missed page then hold undefined bytes (part of the read may have landed there):
never use a missed page's buffer.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from . import native
from .backends.base import Extent, slice_memory
from .layout import ALIGNMENT, PageLayout
from .memory import alloc_host, host_numpy
from .slot_trailer import TRAILER_BYTES
from .yielding_lock import YieldingLock

#: least bytes one hashing task takes: a call below it is hashed on the calling thread, a larger
#: one in tasks of at least this many bytes (a hand-off to a thread costs more than it saves
#: on less)
PARALLEL_HASH_BYTES = 4 << 20


class HostPagePath:
    """A tier's in-place path for host regions: whether it runs, and for which pages.

    Args:
        layout: the tier's page layout.
        enabled: "" when the tier and backend allow it, else why not (shown in stats).
        direct: whether any slab file is opened with O_DIRECT (then regions must be aligned).
        threads: threads hashing a call's pages (at most the host's cores).
        engine: the page engine computing the pages' CRC-32C (default: the native one where it
            loaded).
    """

    def __init__(self, layout: PageLayout, why_not: str, direct: bool, threads: int,
                 engine: native.Engine | None = None) -> None:
        self.layout = layout
        self.engine = engine or native.engine()
        self.why_not = why_not
        self.direct = direct
        self._threads = max(1, min(threads, os.cpu_count() or 1))
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()

    @property
    def enabled(self) -> bool:
        return not self.why_not

    def describe(self) -> dict:
        rule = ("regions 4 KiB aligned and whole 4 KiB blocks but the last, which goes through "
                "a scratch row where it is not aligned (O_DIRECT)" if self.direct
                else "any host regions (buffered I/O)")
        return {"enabled": self.enabled, "reason": self.why_not or rule}

    def in_place(self, regions: Sequence[torch.Tensor]) -> bool:
        """Whether a page of these host regions can move in place."""
        if not self.enabled or not all(r.is_cpu for r in regions):
            return False
        if not self.direct:
            return True
        regions = [r for r in regions if r.numel()]
        *lead, last = regions
        if not all(r.data_ptr() % ALIGNMENT == 0 and r.numel() % ALIGNMENT == 0 for r in lead):
            return False
        return bool(lead) or last.data_ptr() % ALIGNMENT == 0

    def direct_bytes(self, regions: Sequence[torch.Tensor]) -> int:
        """How many leading payload bytes of a page that passed :meth:`in_place` move in place;
        the rest goes through its scratch row."""
        regions = [r for r in regions if r.numel()]
        total = sum(r.numel() for r in regions)
        if not self.direct:
            return total
        last = regions[-1]
        if last.data_ptr() % ALIGNMENT:     # all of it through the scratch row
            return total - last.numel()
        return total - last.numel() % ALIGNMENT

    def scratch(self, nbytes: int) -> np.ndarray:
        """This thread's scratch bytes for one call's rows, kept for its next call: a fresh
        mapping per call would fault in every page of it (SGLang's indexer rows are 66 MB a
        128-page call). A call uses them only until it returns (calls of one thread never
        overlap).

        Pinned where CUDA is usable, as the host pools that hand us the rest of the page are:
        on the GPU machines' virtio disk an O_DIRECT read into pageable memory took 1.1-1.2x as
        long as into pinned memory, so the indexer's bytes read through pageable rows cost
        +15 % for +11.5 % of the bytes, +10 % through pinned ones (bench/RESULTS.md, "Hybrid
        models")."""
        return self.scratch_at(nbytes)[0]

    def scratch_at(self, nbytes: int) -> tuple[np.ndarray, int]:
        """:meth:`scratch`, and the address of its first byte."""
        local = self._local
        buf = getattr(local, "scratch", None)
        if buf is None or len(buf) < nbytes:
            buf = local.scratch = host_numpy(alloc_host(nbytes))
            local.scratch_address = buf.ctypes.data
        return buf[:nbytes], local.scratch_address

    def call(self, pages: Sequence[Sequence[torch.Tensor]]) -> "InPlacePages":
        """The per-call object moving these pages (each one passed :meth:`in_place`)."""
        return InPlacePages(self, pages)

    def page_sums(self, iovs: Sequence[Sequence], out: np.ndarray) -> None:
        """CRC-32C of each page's payload (its I/O vector: ``page_bytes`` in all) into ``out``,
        in one call of the page engine."""
        self.engine.page_sums([b for iov in iovs for b in iov], self.layout.page_bytes,
                              self.layout.page_bytes, out)

    def hash_pages(self, iovs: list[Sequence]) -> np.ndarray:
        """CRC-32C of each page's I/O vector, on several threads when the call is large: one
        task per ``PARALLEL_HASH_BYTES`` or more, at most one per thread, the first on the
        caller (the native engine hashes with the GIL released, so tasks run in parallel)."""
        out = np.empty(len(iovs), dtype=np.uint64)
        tasks = 1 if len(iovs) < 2 else min(  # (one page: no share to count)
            self._threads, len(iovs), sum(len(b) for iov in iovs for b in iov)
            // PARALLEL_HASH_BYTES)
        if tasks < 2:
            self.page_sums(iovs, out)
            return out
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="gdskv-hash")
        step = -(-len(iovs) // tasks)  # small pages batch up
        groups = [range(k, min(k + step, len(iovs))) for k in range(0, len(iovs), step)]

        def run(group: range) -> None:
            self.page_sums(iovs[group.start:group.stop], out[group.start:group.stop])

        others = [self._pool.submit(run, g) for g in groups[1:]]
        run(groups[0])  # the caller would only wait: it takes a share
        for f in others:
            f.result()
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class InPlacePages:
    """One call's pages moved in place. ``page_idx`` lists positions in the call's pages; the
    chunk's page ``j`` is at ``j * slot_bytes`` of the extents' frame (as in staging)."""

    def __init__(self, path: HostPagePath, pages: Sequence[Sequence[torch.Tensor]]) -> None:
        lay = path.layout
        self.path = path
        self.slot_bytes = lay.slot_bytes
        self.pages = [[host_numpy(r) for r in regions if r.numel()] for regions in pages]
        # payload bytes moved in place (the same for every page of the call, so each page's
        # scratch row is one size); the rest of the slot is the page's scratch row (without
        # O_DIRECT: all of every page in place)
        self.direct_bytes = min((path.direct_bytes(r) for r in pages),
                                default=lay.page_bytes) if path.direct else lay.page_bytes
        self.rest = lay.page_bytes - self.direct_bytes   # payload bytes in the scratch row
        self._tail = lay.slot_bytes - self.direct_bytes
        self._rows: np.ndarray | None = None    # the scratch rows, taken when the call runs
        self._direct_iovs: list = [None] * len(self.pages)   # each page's, made once
        # page -> CRC-32C from the engine call that read it, and whether there is one
        self._read_sums = np.zeros(len(self.pages), dtype=np.uint64)
        self._summed = np.zeros(len(self.pages), dtype=bool)
        self._rest_copied: set[int] = set()    # pages whose scratch end is in their regions
        self._lock = YieldingLock()

    @property
    def _scratch(self) -> np.ndarray:
        """One scratch row per page, from the thread running the call (its first use is there:
        an ``_async`` call is made on the caller's thread but runs on a tier worker)."""
        if self._rows is None:
            n = len(self.pages)
            self._rows = self.path.scratch(n * self._tail).reshape(n, self._tail)
        return self._rows

    def _direct(self, i: int) -> tuple:
        iov = self._direct_iovs[i]
        if iov is None:
            regions = self.pages[i]
            iov = tuple(regions) if not self.rest else \
                slice_memory(regions, 0, self.direct_bytes)
            self._direct_iovs[i] = iov
        return iov

    def _rest(self, i: int) -> tuple:
        return slice_memory(self.pages[i], self.direct_bytes, self.rest)

    def _extents(self, extents: list[Extent], page_idx: list[int], moved=None) -> list[Extent]:
        out = []
        for e in extents:
            first = e.buffer_offset // self.slot_bytes
            memory = []
            for pos in range(first, first + e.length // self.slot_bytes):
                i = page_idx[pos]
                memory.extend(self._direct(i))
                memory.append(self._scratch[i])
            out.append(Extent(e.file, e.file_offset, e.length, e.buffer_offset, tuple(memory),
                              moved))
        return out

    # -- spill --------------------------------------------------------------------------------
    def checksums(self, page_idx: list[int]) -> np.ndarray:
        """CRC-32C of each page's payload, on the caller's bytes."""
        return self.path.hash_pages([self.pages[i] for i in page_idx])

    def write_extents(self, extents: list[Extent], page_idx: list[int],
                      trailers: list[bytes]) -> list[Extent]:
        """The store's ``extents`` for these pages, carrying the regions and each page's scratch
        row (the payload's unaligned end, then the trailer in the slot's last bytes)."""
        for i, trailer in zip(page_idx, trailers):
            row = self._scratch[i]
            if self.rest:
                np.concatenate(self._rest(i), out=row[:self.rest])
            row[self.rest:-TRAILER_BYTES] = 0   # (a reused row: no earlier call's bytes)
            row.data[-TRAILER_BYTES:] = trailer  # (a memoryview copy: no array made)
        return self._extents(extents, page_idx)

    # -- restore ------------------------------------------------------------------------------
    def read_extents(self, extents: list[Extent], page_idx: list[int], *,
                     hash_as_read: bool = True) -> list[Extent]:
        """The store's ``extents`` for these pages, reading into the regions and scratch rows.
        With ``hash_as_read``, a backend that calls ``Extent.moved`` (posix) checksums each page
        in the engine call that reads it (no second pass, no hand-off to the hashing threads)."""
        return self._extents(extents, page_idx,
                             _ReadChecks(self, page_idx) if hash_as_read else None)

    def _payload(self, i: int) -> tuple:
        """Page ``i``'s payload as read: its regions, then its end in the scratch row."""
        return self._direct(i) + (self._scratch[i][:self.rest],)

    def _pages_read(self, idx: np.ndarray, sums: np.ndarray) -> None:
        """Pages ``idx`` are read, their CRC-32C ``sums`` (for :meth:`read_checksums`); put
        their scratch ends in their regions here too (the reading thread, not the caller's: for
        a rider read through its row that is the rider's whole page). The regions of a page
        that then fails its checksum hold undefined bytes, as a missed page's always do."""
        if self.rest:
            for i in idx.tolist():
                self._copy_rest(i)
        with self._lock:
            self._read_sums[idx] = sums
            self._summed[idx] = True
            if self.rest:
                self._rest_copied.update(idx.tolist())

    def forget_reads(self, page_idx: list[int]) -> None:
        """These pages are read again (after a failed read): what their first read hashed and
        copied no longer counts; they are hashed and completed after the new read."""
        with self._lock:
            self._summed[page_idx] = False
            self._rest_copied.difference_update(page_idx)

    def read_checksums(self, page_idx: list[int]) -> np.ndarray:
        """CRC-32C of each page's payload as read (by the call that read it, or now)."""
        with self._lock:
            out = self._read_sums[page_idx]
            summed = self._summed[page_idx]
            # (all summed is the usual case: one C-level count, no index list)
            todo = [] if np.count_nonzero(summed) == len(summed) else \
                np.flatnonzero(~summed).tolist()
        if todo:
            out[todo] = self.path.hash_pages([self._payload(page_idx[k]) for k in todo])
        return out

    def as_slot(self, i: int) -> torch.Tensor:
        """Page ``i`` as read, copied into one slot-sized tensor (to verify it with another
        checksum algorithm, which works on staging-format buffers)."""
        slot = np.zeros(self.slot_bytes, dtype=np.uint8)
        np.concatenate(self._payload(i), out=slot[:self.direct_bytes + self.rest])
        return torch.from_numpy(slot)

    def complete(self, page_idx: list[int]) -> None:
        """Copy the verified pages' payload ends from their scratch rows into their regions
        (those the reading thread has not already)."""
        if not self.rest:
            return
        with self._lock:
            todo = [i for i in page_idx if i not in self._rest_copied]
        for i in todo:
            self._copy_rest(i)

    def _copy_rest(self, i: int) -> None:
        done = 0
        for dst in self._rest(i):
            dst[:] = self._scratch[i][done:done + len(dst)]
            done += len(dst)


class _ReadChecks:
    """One chunk's in-place read, as the ``Extent.moved`` hint of its extents: a backend that
    reads a piece (posix) passes the CRC-32C of each page in it from the same engine call,
    ``moved(piece, sums)``, in its I/O thread. ``slot_bytes`` and ``page_bytes`` say what to
    checksum: the pages of a chunk sit at ``j * slot_bytes`` of its extents' frame, and such a
    backend cuts pieces on slots, so each holds whole pages."""

    def __init__(self, pages: InPlacePages, page_idx: list[int]) -> None:
        self._pages = pages
        self._page_idx = np.asarray(page_idx, dtype=np.int64)
        self.slot_bytes = pages.slot_bytes
        self.page_bytes = pages.path.layout.page_bytes

    def __call__(self, piece: Extent, sums: np.ndarray) -> None:
        first = piece.buffer_offset // self.slot_bytes
        self._pages._pages_read(self._page_idx[first:first + len(sums)], sums)
