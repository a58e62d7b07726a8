"""One restore (``Tier.get`` / ``get_pages``): pages from the slab store back to the engine.

Pin READY pages (a long restore: those its free staging parts read first, the rest once
their reads are under way) -> per chunk: take a staging part, ``backend.start("read")`` into
it -> once the read has ended: verify checksums -> scatter into the engine's slots, and give
the part back (with an event its next user waits for) -> unpin (the chunks finished by the
time the last read starts, before the call waits for the last ones). While one chunk is
verified and scattered the next is read. Where the GPU decides (:mod:`.gpu_verdicts`), each chunk is
verified and scattered in one launch and the hits are counted after the call's sync. Pages
given as host regions that can move in place (:mod:`.host_pages`) are read straight into the
caller's memory and verified there.

A page that is missing, fails I/O or fails its checksum is a miss (``False``), never an
exception and never wrong bytes. One that could not be read is dropped (journaled as evicted),
so existence checks answer miss and no engine loads it again and again: at once when the
failure lasts (a checksum mismatch, a slab that ends early, a file gone), after
``READ_RETRIES`` more reads in the call for an error that may pass (EIO).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Hashable
from concurrent.futures import Future

import numpy as np
import torch

from . import checksum
from .backends.base import Extent, IOOutcome
from .copiers import DeferredCopier, PageCopier
from .data_call import READ_RETRIES, CallContext, copies_done, count_region_pages
from .gpu_verdicts import GpuVerdicts
from .host_pages import InPlacePages
from .streams import CallStream


@dataclasses.dataclass(slots=True)
class ReadChunk:
    """A chunk whose read was started (at ``t0``): its pages ``(position in the call, slot,
    stored checksum)``, its first position in the call's read order, the staging part it reads
    into (None: in place) and its extents."""

    pages: list
    first: int
    part: int | None
    extents: list[Extent]
    fut: Future
    t0: float


class RestoreCall:
    """One restore's state, from its pins to its last unpin (:meth:`run`)."""

    def __init__(self, ctx: CallContext, keys: list[Hashable],
                 drain: PageCopier | DeferredCopier, stream: CallStream | None, *,
                 reads_done: int = 0) -> None:
        self.ctx = ctx
        #: reads of these pages this call made already (a quick read that failed,
        #: :mod:`.quick_calls`): they count among its tries of a read that may pass
        self.reads_done = reads_done
        self.keys = keys
        self.drain = drain
        self.stream = stream
        self.results = [False] * len(keys)
        #: (key, slot) of pages to drop: checksum mismatch, failed read
        self.unreadable: list = []
        # the call's counters, added to the stats once at its end (each add costs host time)
        self.tally = {"bytes_read": 0, "read_seconds": 0.0, "read_failed": 0,
                      "corrupt_pages": 0, "unreadable_pages": 0}
        self.pending: collections.deque[ReadChunk] = collections.deque()
        self.verdicts: GpuVerdicts | None = None
        #: parts given back after the call's sync, not before
        self.synced_parts: list[int] = []
        self.gpu: torch.cuda.Stream | None = None  # the call's stream, once entered
        self.in_place = isinstance(drain, InPlacePages)
        #: how many of the call's pages, in read order, are unpinned already (see _unpin)
        self.unpinned = 0
        #: the call's position of each page, in read order (made by _prepare)
        self.order: list[int] = []

    def run(self) -> list[bool]:
        ctx, keys, tally, pending = self.ctx, self.keys, self.tally, self.pending
        # A long restore pins the pages its free staging parts read first, starts those
        # reads, then pins the rest: 2,047 pins took 1 ms on the H100's host, with no read
        # under way. (A page pinned later that is gone by then is a miss, as it would be had
        # the call come a moment later.)
        head = len(keys) if self.in_place else len(ctx.staging) * ctx.chunk_pages
        todo = ctx.directory.pin_for_read(keys[:head])
        rest = head < len(keys)
        chunks = ctx.chunked(todo)
        held = None
        settled = False
        pinned = True
        prepared = False  # (see _prepare)
        on_caller = ctx.io_on_caller and len(chunks) == 1 and not rest  # (see SpillCall.run)
        if not rest:
            count_region_pages(self.drain, len(todo), "read", tally)

        def pin_rest() -> None:
            nonlocal rest
            more = ctx.directory.pin_for_read(keys[head:], head)
            todo.extend(more)
            chunks.extend(ctx.chunked(more))
            rest = False
            count_region_pages(self.drain, len(todo), "read", tally)
        try:
            k = done = 0  # chunks started, and their pages (the next one's first position)
            while k < len(chunks) or rest:
                if k == len(chunks):
                    pin_rest()
                    continue
                chunk = chunks[k]
                first = done
                k += 1
                done += len(chunk)
                if self.in_place:  # no part: the I/O goes straight into the caller's regions
                    extents = self.drain.read_extents(
                        ctx.store.extents([s for _, s, _ in chunk]), [i for i, _, _ in chunk],
                        hash_as_read=ctx.verify)
                    t0 = time.perf_counter()
                    pending.append(ReadChunk(chunk, first, None, extents,
                                             ctx.backend.start("read", None, extents,
                                                               on_caller), t0))
                    continue
                held = ctx.staging.try_take()
                if held is None:  # a part frees when a chunk is finished: prepared first
                    if rest:  # (other calls hold parts: the prologue needs every pin)
                        pin_rest()
                    if not prepared:
                        self._prepare(todo, chunks)
                        prepared = True
                    held = ctx.take_part(pending, self._finish_oldest)
                extents = ctx.store.extents([s for _, s, _ in chunk])
                part = ctx.staging[held]
                t0 = time.perf_counter()
                pending.append(ReadChunk(chunk, first, held, extents,
                                         ctx.backend.start("read", part, extents, on_caller),
                                         t0))
                held = None
                if prepared and self.verdicts is not None:  # made while its read runs
                    self.verdicts.plan(self.drain, part, first, [i for i, _, _ in chunk],
                                       last=k == len(chunks))
            if pending and not prepared and not self.in_place:
                self._prepare(todo, chunks)
                prepared = True
            # the chunks finished so far are unpinned while the last reads run (2,047 unpins
            # took 0.4 ms on the H100's host, after the last read)
            self._unpin(todo, pending[0].first if pending else None)
            while pending:
                self._finish_oldest()
            if self.stream is not None:  # (nothing read: the argument checks may use the GPU)
                self._enter_stream()
            if isinstance(self.drain, DeferredCopier):  # nothing read: the arguments count
                self.drain = self.drain.make()
            if self.verdicts is not None:
                self.verdicts.read_back()
            # Every read has ended (the pages are in staging or their regions): the slots may
            # go while the GPU still scatters, so unpin now, not after the sync.
            pinned = False
            self._unpin(todo)
            copies_done(self.gpu)
            while self.synced_parts:  # nothing reads them now: no event for their next user
                ctx.staging.give_back(self.synced_parts.pop())
            if self.verdicts is not None:
                self._settle(todo)
            settled = True
        finally:
            if held is not None:
                ctx.staging.give_back(held)
            for i in self.synced_parts:  # an exception before the sync: the GPU may read it
                ctx.staging.give_back(i, self.gpu)
            for item in pending:  # not drained: its part is free once its read has ended
                item.fut.exception()
                if item.part is not None:
                    ctx.staging.give_back(item.part)
            if pinned:
                self._unpin(todo)
            ctx.drop_unreadable(self.unreadable)  # those the GPU's verdicts found, after sync
            if not settled:  # an exception: what the finished chunks moved still counts
                ctx.stats.add(**tally)
        hits = sum(self.results)
        tally.update(get_pages=len(keys), hits=hits, misses=len(keys) - hits)
        ctx.ledger.record(tally, None)
        return self.results

    def _prepare(self, todo: list, chunks: list) -> None:
        """The host work a restore does while its first reads run: it takes its stream, its
        arguments are checked, its slot indices and stored checksums made ready, and the
        launches of the chunks already reading made. It comes once the reads that found free
        staging parts are under way (or, moved on this thread, have ended), and before any
        chunk is finished: a long restore's slot indices (a 32k-token prompt's 262k) took
        milliseconds while one chunk read and the other parts stood idle."""
        ctx, pending = self.ctx, self.pending
        if self.stream is not None:
            self._enter_stream()
        if isinstance(self.drain, DeferredCopier):
            self.drain = self.drain.make()
        verdicts = self.verdicts = self._gpu_verdicts(todo)
        self.order = [i for i, _, _ in todo]
        if self.drain.prepare(self.order,
                              into=verdicts.slot_buffers if verdicts is not None else None,
                              defer_upload=verdicts is not None):
            # the indices go up inside the chunks' launch graphs (as a spill's)
            verdicts.upload_slots(len(todo) * ctx.layout.page_size)
        if pending and not pending[-1].fut.done():  # earlier calls' counters (SpillCall)
            ctx.ledger.settle(wait=False)
        if verdicts is not None:  # the launches of the chunks reading now
            last = len(todo) - len(chunks[-1])  # (the last chunk's first position)
            for r in pending:
                verdicts.plan(self.drain, ctx.staging[r.part], r.first,
                              [i for i, _, _ in r.pages], last=r.first == last)

    def _enter_stream(self) -> None:
        self.stream.enter()  # (a second time does nothing)
        self.gpu = self.stream.stream

    def _unpin(self, todo: list, upto: int | None = None) -> None:
        """Unpin the call's slots whose reads have ended, positions ``self.unpinned`` ..
        ``upto`` (None: the last) of ``todo``; the pages found unreadable so far are dropped
        first (while pinned: the slots are still theirs); the evictions that waited for the
        unpin are journaled."""
        ctx = self.ctx
        upto = len(todo) if upto is None else upto
        ctx.drop_unreadable(self.unreadable)
        if upto > self.unpinned:
            ctx.persist.journal_evictions(ctx.directory.unpin(
                [s for _, s, _ in todo[self.unpinned:upto]]))
            self.unpinned = upto

    def _gpu_verdicts(self, todo: list) -> GpuVerdicts | None:
        """Verdicts decided on the GPU for this restore, where it can: staging on CUDA, pages
        going to a KV pool through the kernels, verification on, and every page checksummed
        with this tier's GPU algorithm (pages an older configuration wrote are verified the
        plain way)."""
        ctx = self.ctx
        if not todo or not ctx.gpu_checked(self.drain):
            return None
        if not ctx.directory.all_use([s for _, s, _ in todo], checksum.GPU_PAGE):
            return None
        return GpuVerdicts([want for _, _, want in todo], ctx.thread_buffers(),
                           ctx.layout.page_bytes, ctx.layout.slot_bytes, self.gpu)

    def _finish_oldest(self) -> None:
        chunk = self.pending.popleft()
        if self.in_place:
            self._finish_read_in_place(chunk)
        else:
            self._finish_read(chunk)

    # -- failures: one path for every kind of read ----------------------------------------------
    def _read_failures(self, r: ReadChunk, outcome: IOOutcome, buffer: torch.Tensor | None,
                       forget=None) -> tuple[IOOutcome, set[int]]:
        """The chunk's outcome after reading again what may pass, and the positions its I/O
        did not move whole; those that failed for good are dropped (:meth:`_drop`)."""
        ctx = self.ctx
        outcome = ctx.read_again(buffer, r.extents, outcome, forget,
                                 retries=READ_RETRIES - self.reads_done)
        lost: set[int] = set()
        failed = ctx.failed_positions(outcome, r.extents, "read", lost)
        if lost:
            self._drop(r.pages, sorted(lost), corrupt=False)
        return outcome, failed

    @staticmethod
    def _mismatched(chunk: list, sums, failed: set[int]) -> list[int]:
        """Positions of the chunk whose checksum ``sums[pos]`` is not the stored one (the
        positions ``failed`` already are not looked at: their bytes did not all arrive)."""
        return [pos for pos, (_, _, want) in enumerate(chunk)
                if pos not in failed and int(sums[pos]) != want]

    def _drop(self, chunk: list, positions: list[int], *, corrupt: bool) -> None:
        """The chunk's pages at ``positions`` (not empty) are misses and dropped (after the
        reads, by :meth:`CallContext.drop_unreadable`): their checksum did not match
        (``corrupt``), or their read failed for good."""
        ctx, keys = self.ctx, self.keys
        self.unreadable.extend((keys[chunk[pos][0]], chunk[pos][1]) for pos in positions)
        first = keys[chunk[positions[0]][0]]
        if corrupt:
            self.tally["corrupt_pages"] += len(positions)
            ctx.log_once("corrupt", "checksum mismatch: %d pages dropped as misses "
                         "(first key %r)", len(positions), first)
        else:
            self.tally["unreadable_pages"] += len(positions)
            ctx.log_once("unreadable", "read failed: %d pages dropped as misses (first key "
                         "%r)", len(positions), first)

    def _delivered(self, r: ReadChunk, good, failed: int) -> None:
        """The chunk's pages at positions ``good`` reached the engine: hits."""
        for pos in good:
            self.results[r.pages[pos][0]] = True
        tally = self.tally
        tally["bytes_read"] += len(good) * self.ctx.layout.page_bytes
        tally["read_seconds"] += time.perf_counter() - r.t0
        tally["read_failed"] += failed

    # -- finishing a chunk ----------------------------------------------------------------------
    def _finish_read(self, r: ReadChunk) -> None:
        """Verify and drain one chunk (its read ended or ends now). With GPU verdicts, a chunk
        whose I/O moved every page is verified and scattered in one launch, and its hits are
        counted when the call settles (:meth:`_settle`); the call's last such chunk leaves its
        part in ``synced_parts``, for the call to give back after its sync (one event fewer to
        record here and for the part's next user to wait for)."""
        ctx, chunk, verdicts = self.ctx, r.pages, self.verdicts
        part = ctx.staging[r.part]
        good: list[int] = []
        failed: set[int] = set()
        after_sync = False
        try:
            outcome: IOOutcome = r.fut.result()
            if outcome.errors:
                outcome, failed = self._read_failures(r, outcome, part)
            if verdicts is not None and not failed:
                last = r.first + len(chunk) == verdicts.pages
                verdicts.scatter(self.drain, part, r.first, [i for i, _, _ in chunk],
                                 last=last)
                self.tally["read_seconds"] += time.perf_counter() - r.t0
                after_sync = last
                return
            if ctx.verify:
                sums = ctx.verify_sums(part, [s for _, s, _ in chunk])
                bad = self._mismatched(chunk, sums, failed)
                if bad:
                    self._drop(chunk, bad, corrupt=True)
                    failed.update(bad)
            good = [pos for pos in range(len(chunk)) if pos not in failed]
            if good and verdicts is not None:  # a plain scatter reads the uploaded indices
                verdicts.slots_uploaded()
            if good:
                if len(good) == len(chunk):
                    self.drain(part, [i for i, _, _ in chunk])
                else:  # only verified pages reach the engine: pack them to the front first
                    sb = ctx.layout.slot_bytes
                    packed = torch.empty(len(good) * sb, dtype=torch.uint8, device=part.device)
                    for j, pos in enumerate(good):
                        packed[j * sb:(j + 1) * sb].copy_(part[pos * sb:(pos + 1) * sb])
                    self.drain(packed, [chunk[pos][0] for pos in good])
        finally:
            if after_sync:
                self.synced_parts.append(r.part)
            else:  # free as soon as the scatter is queued; its next user waits for this event
                ctx.staging.give_back(r.part, self.gpu)
        self._delivered(r, good, len(failed))

    def _finish_read_in_place(self, r: ReadChunk) -> None:
        """Complete an in-place read: the pages it did not move whole, or whose bytes (in the
        caller's regions) fail their checksum, are misses."""
        ctx, chunk, pages = self.ctx, r.pages, self.drain
        outcome: IOOutcome = r.fut.result()
        failed: set[int] = set()
        if outcome.errors:
            outcome, failed = self._read_failures(r, outcome, None, lambda positions: (
                pages.forget_reads([chunk[pos][0] for pos in positions])))
        if ctx.verify:
            slots = [s for _, s, _ in chunk]
            if ctx.directory.all_use(slots, checksum.CRC32C):  # (the usual case: one pass)
                sums = pages.read_checksums([i for i, _, _ in chunk]).tolist()
            else:
                sums = self._mixed_read_sums(chunk, ctx.directory.algorithms(slots))
            bad = self._mismatched(chunk, sums, failed)
            if bad:
                self._drop(chunk, bad, corrupt=True)
                failed.update(bad)
        good = [pos for pos in range(len(chunk)) if pos not in failed] if failed \
            else range(len(chunk))
        pages.complete([chunk[pos][0] for pos in good])
        self._delivered(r, good, len(failed))

    def _mixed_read_sums(self, chunk, algos: np.ndarray) -> list[int]:
        """The checksums of an in-place chunk whose pages were not all written with CRC-32C
        (by another tier): each page's with the algorithm that made it."""
        pages = self.drain
        own = [pos for pos in range(len(chunk)) if algos[pos] == checksum.CRC32C]
        sums = np.zeros(len(chunk), dtype=np.uint64)
        sums[own] = pages.read_checksums([chunk[pos][0] for pos in own])
        for pos in sorted(set(range(len(chunk))) - set(own)):  # written by another tier
            sums[pos] = self.ctx.verifier(int(algos[pos])).compute(
                pages.as_slot(chunk[pos][0]), 1)[0]
        return sums.tolist()

    def _settle(self, todo: list) -> None:
        """Hits and checksum misses of the chunks verified on the GPU (after the stream sync)."""
        matched, bad = self.verdicts.settle()
        results, order = self.results, self.order
        for k in matched:
            results[order[k]] = True
        if bad:
            self._drop(todo, bad, corrupt=True)
        self.tally["bytes_read"] += len(matched) * self.ctx.layout.page_bytes
        self.tally["read_failed"] += len(bad)
