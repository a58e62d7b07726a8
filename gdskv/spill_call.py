"""One spill (``Tier.put`` / ``put_pages``): pages from the engine to the slab store.

Reserve slots in the directory -> per chunk: take a staging part, gather the pages into it,
checksum, encode the slot trailers -> ``backend.start("write")`` -> once the write has ended:
(fdatasync per sync policy) -> journal COMMIT -> directory READY. While a chunk's write is in
flight the next chunk is gathered into another part; a part goes back as soon as its write
ends (the backend's done-callback), before the commit. Pages given as host regions that can
move in place (:mod:`.host_pages`) are written straight from the caller's memory.

A call that finds no free part waits for its own writes that hold parts, oldest first, before
it waits for other calls' parts, and commits them once its next write is under way: calls
never wait for each other in a cycle.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Hashable
from concurrent.futures import Future

import numpy as np
import torch

from .backends.base import Extent, IOOutcome
from .copiers import PageCopier
from .data_call import CallContext, copies_done, count_region_pages
from .directory import PageState
from .gpu_spill import GpuSpill
from .host_pages import InPlacePages
from .journal import Encoded
from .layout import FORMAT_VERSION
from .staging import StagingParts
from .streams import CallStream
from . import slot_trailer

#: page states as plain ints (an enum member lookup costs a put's loop more)
_FREE, _WRITING, _READY = int(PageState.FREE), int(PageState.WRITING), int(PageState.READY)


class _HeldPart:
    """A staging part a spill's write holds until the write ends. It is given back once, by
    whichever comes first: the write's done-callback (a backend thread may run that after it
    has woken the waiters) or the call that waited for the write. (It holds no reference to
    the write's future, whose callback holds it: no reference cycle for the collector.)"""

    __slots__ = ("_part",)

    def __init__(self, part: int) -> None:
        self._part = [part]

    @property
    def out(self) -> bool:
        return bool(self._part)

    def give_back(self, staging: StagingParts) -> None:
        try:
            i = self._part.pop()  # (one call of list.pop: of two racing callers, one gets it)
        except IndexError:
            return
        staging.give_back(i)


@dataclasses.dataclass(slots=True)
class WriteChunk:
    """A chunk whose write was started (at ``t0``) and is yet to be committed: its pages
    ``(position in the call, slot)``. The host work its commit needs that does not wait for the
    write was done when it started: its COMMIT records (``commits``), and whether a store file
    was removed (``lost``)."""

    pages: list
    sums: np.ndarray
    seqs: list[int]
    extents: list[Extent]
    fut: Future
    t0: float
    commits: Encoded
    lost: bool


def reserve_slots(ctx: CallContext, keys: list[Hashable], admitted: list[int],
                  results: list[bool], tally: dict) -> tuple[list, list[int]]:
    """Reserve slots for the ``admitted`` positions of ``keys`` (evicting, and journaling the
    evictions, where the store is full). Returns the pages to write, ``(position, slot)`` in
    slot order (adjacent slots coalesce into one I/O), and the positions of keys another call
    is writing now (its outcome is theirs); keys already stored are hits in ``results``. The
    counts go into ``tally``."""
    res = ctx.directory.reserve(keys if len(admitted) == len(keys)
                                else [keys[i] for i in admitted])
    if res.evicted:
        # Durable before the slots are rewritten. Recovery checks only the oldest pages'
        # trailers against the journal (PersistentDirectory._check_tail), so an EVICT lost to a
        # power cut could leave an LRU victim's COMMIT naming another page's bytes: a put of
        # that key answered True from the directory but unreadable, reused seqs, and wrong
        # bytes if the store is opened with verify=false. (Written unsynced and made durable
        # by the COMMITs' fdatasync, a 1-page spill on the H200 host's disk took 272 us
        # instead of 354; reverted for this.)
        ctx.persist.journal_evictions(res.evicted)
    tally.update(not_admitted=len(keys) - len(admitted), evictions=len(res.evicted))
    todo: list[tuple[int, int]] = []
    waiting: list[int] = []
    no_room = 0
    for i, slot, found in zip(admitted, res.slots, res.found):
        if slot is not None:
            todo.append((i, slot))
        elif found == _READY:
            results[i] = True
        elif found == _WRITING:
            waiting.append(i)
        elif found == _FREE:
            no_room += 1
        # (EVICTING: asked to go while a reader holds it; it is not stored for this put)
    if no_room:
        ctx.log_once("full", "store full and eviction cannot make room: %d pages not stored",
                     no_room)
    if len(todo) > 1:
        todo.sort(key=lambda t: t[1])
    return todo, waiting


def encode_trailers(ctx: CallContext, keys: list[Hashable], chunk, sums
                    ) -> tuple[list[int], list[bytes]]:
    """Each page's slot trailer (written beside its payload, in the same I/O) and sequence
    number, which the journal's COMMITs carry too; ``chunk``: ``(position, slot)`` pairs."""
    seqs = ctx.persist.next_seqs(len(chunk))
    algo, store_id = ctx.checksums.algorithm, ctx.store.store_id
    return seqs, [slot_trailer.encode(FORMAT_VERSION, store_id, slot, keys[i], seq, int(csum),
                                      algo)
                  for (i, slot), seq, csum in zip(chunk, seqs, sums)]


class SpillCall:
    """One spill's state, from reservation to its last commit (:meth:`run`)."""

    def __init__(self, ctx: CallContext, keys: list[Hashable], fill: PageCopier,
                 stream: CallStream | None) -> None:
        self.ctx = ctx
        self.keys = keys
        self.fill = fill
        self.stream = stream
        self.results = [False] * len(keys)
        # the call's counters, added to the stats once at its end (each add costs host time)
        self.tally = {"bytes_written": 0, "write_seconds": 0.0, "write_failed": 0}
        self.pending: collections.deque[WriteChunk] = collections.deque()
        #: (write, _HeldPart) of the writes that may still hold a part, oldest first
        self.parts_out: collections.deque = collections.deque()
        self.finished = 0  # chunks committed (or given back)

    def run(self) -> list[bool]:
        ctx, keys, results, tally = self.ctx, self.keys, self.results, self.tally
        admitted = ctx.admission.admit(keys)
        todo, waiting = reserve_slots(ctx, keys, admitted, results, tally)
        chunks = [todo] if 0 < len(todo) <= ctx.chunk_pages else ctx.chunked(todo)
        fill, pending, parts_out = self.fill, self.pending, self.parts_out
        held = None  # a part taken for the current chunk, not yet handed to the backend
        in_place = isinstance(fill, InPlacePages)
        # one chunk: nothing to overlap its write with, so it may move on this thread
        on_caller = ctx.io_on_caller and len(chunks) == 1
        count_region_pages(fill, len(todo), "written", tally)
        spill = None
        gpu = None  # the call's stream, once entered: its GPU work goes there
        try:
            if self.stream is not None:
                self.stream.enter()
                gpu = self.stream.stream
            if not in_place and todo:
                spill = self._gpu_spill([i for i, _ in todo], gpu)
                if spill is None:
                    fill.prepare([i for i, _ in todo])
            for chunk in chunks:
                if in_place:  # no part: the I/O goes straight from the caller's regions
                    pending.append(self._write_in_place(chunk, on_caller))
                    continue
                if spill is not None:  # trailers sealed on the GPU: encoded before the wait
                    seqs, trailers = self._trailers(chunk, itertools.repeat(0))
                held, waited = self._take_write_part()
                part = ctx.staging[held]
                if spill is not None:  # one sync, then the write
                    spill.gather(part, [i for i, _ in chunk], trailers)
                else:
                    fill(part, [i for i, _ in chunk])
                    sums = ctx.checksums.compute(part, len(chunk)) if ctx.verify \
                        else np.zeros(len(chunk), dtype=np.uint64)
                    seqs, trailers = self._trailers(chunk, sums)
                    slot_trailer.write_into(part, ctx.layout.slot_bytes, trailers,
                                            ctx.trailer_buffer())
                extents = ctx.store.extents([s for _, s in chunk])  # (while the GPU works)
                # (while the GPU works too: a write moved on this thread has no wait to hide it)
                lost = ctx.lost_files()
                copies_done(gpu)
                t0 = time.perf_counter()
                fut = ctx.backend.start("write", part, extents, on_caller)
                # the part is free once its bytes are written: fdatasync and journal need not it
                part_held = _HeldPart(held)
                fut.add_done_callback(lambda _f, p=part_held: p.give_back(ctx.staging))
                parts_out.append((fut, part_held))
                held = None
                if spill is not None:  # the checksums came back with the sync
                    sums = spill.sums(len(chunk))
                pending.append(self._writing(chunk, sums, seqs, extents, fut, t0, lost))
                if waited:  # staging is the limit: commit what ended while this write runs
                    while len(pending) > 1 and pending[0].fut.done():
                        self._finish_oldest()
            if spill is not None:
                spill.done()  # every chunk's copies ended before its write was queued
            while pending:
                self._finish_oldest()
            if waiting:  # (only now: this call writes nothing any more, so no cycle of waits)
                for i, ok in zip(waiting, ctx.directory.wait_written([keys[i] for i in waiting])):
                    results[i] = ok
        except BaseException:
            if held is not None:
                ctx.staging.give_back(held)
            # let in-flight I/O end before giving its slots back, and its parts too (a write
            # whose entry was not made yet among them)
            for fut, part_held in parts_out:
                fut.exception()
                part_held.give_back(ctx.staging)
            for item in pending:
                item.fut.exception()
            ctx.directory.abort([s for c in chunks[self.finished:] for _, s in c])
            ctx.stats.add(**tally)
            raise
        tally.update(put_pages=len(keys), put_stored=sum(results))
        ctx.ledger.record(tally, None)
        return results

    def _gpu_spill(self, order: list[int], gpu: torch.cuda.Stream | None) -> GpuSpill | None:
        """The gather + checksum of this spill as graph replays (:mod:`.gpu_spill`), where it
        can: staging on CUDA, pages from a KV pool through the kernels, verification on.
        ``gpu``: the call's stream (current)."""
        ctx = self.ctx
        if not ctx.gpu_checked(self.fill):
            return None
        return GpuSpill(self.fill, order, ctx.thread_buffers(), ctx.layout.page_bytes,
                        ctx.layout.slot_bytes, gpu)

    def _take_write_part(self) -> tuple[int, bool]:
        """A free staging part for the next chunk, and whether the call had to wait for one.
        With none free, the call waits for its own writes that still hold parts, oldest first,
        giving each part back as its write ends, before it waits for other calls' parts: no
        cycle of waiting calls. Their commits (fdatasync, journal, directory) wait until the
        next chunk's write is under way (:meth:`run`)."""
        staging, parts_out = self.ctx.staging, self.parts_out
        waited = False
        while True:
            i = staging.try_take()
            if i is not None:
                return i, waited
            while parts_out and not parts_out[0][1].out:
                parts_out.popleft()
            if not parts_out:  # all of this call's parts are back: another call holds them
                return staging.take(), True
            fut, held = parts_out.popleft()
            fut.exception()  # its write ends (the outcome is the commit's to read)
            held.give_back(staging)  # unless its done-callback already has
            waited = True

    def _trailers(self, chunk, sums) -> tuple[list[int], list[bytes]]:
        return encode_trailers(self.ctx, self.keys, chunk, sums)

    def _write_in_place(self, chunk, on_caller: bool) -> WriteChunk:
        """Start writing a chunk straight from the caller's regions (checksummed there)."""
        ctx, pages = self.ctx, self.fill
        idx = [i for i, _ in chunk]
        sums = pages.checksums(idx) if ctx.verify else np.zeros(len(chunk), dtype=np.uint64)
        seqs, trailers = self._trailers(chunk, sums)
        extents = pages.write_extents(ctx.store.extents([s for _, s in chunk]), idx, trailers)
        t0 = time.perf_counter()
        return self._writing(chunk, sums, seqs, extents,
                             ctx.backend.start("write", None, extents, on_caller), t0)

    def _writing(self, chunk, sums, seqs, extents: list[Extent], fut: Future, t0: float,
                 lost: bool | None = None) -> WriteChunk:
        """The :class:`WriteChunk` of a write just started; its COMMIT records are encoded
        (and whether a store file was removed found out, unless the caller looked already)
        while the write runs."""
        ctx = self.ctx
        commits = self._commits(chunk, sums, seqs)
        if lost is None:
            lost = ctx.lost_files()
        if not fut.done():  # earlier calls' counters, while the write runs (else: later)
            ctx.ledger.settle(wait=False)
        return WriteChunk(chunk, sums, seqs, extents, fut, t0, commits, lost)

    def _commits(self, chunk, sums: np.ndarray, seqs, positions=None) -> Encoded:
        """The encoded COMMITs of a chunk's pages (those at ``positions``; None: all of them)
        (:meth:`PersistentDirectory.journal_commits`)."""
        ctx, keys = self.ctx, self.keys
        sums = sums.tolist()  # (Python ints pack faster than numpy scalars)
        if positions is not None:
            chunk = [chunk[pos] for pos in positions]
            sums = [sums[pos] for pos in positions]
            seqs = [seqs[pos] for pos in positions]
        return ctx.persist.encode_commits([keys[i] for i, _ in chunk], [s for _, s in chunk],
                                          sums, ctx.checksums.algorithm, seqs)

    def _finish_oldest(self) -> None:
        self._finish_write(self.pending.popleft())
        self.finished += 1

    def _finish_write(self, w: WriteChunk) -> None:
        """Commit a chunk once its write has ended: its pages durable, journaled and READY,
        or given back."""
        ctx, chunk, tally = self.ctx, w.pages, self.tally
        outcome: IOOutcome = w.fut.result()
        # (the usual case, nothing failed, takes no per-position steps: each costs a host
        # that has just woken from the write's wait a few µs)
        failed = ctx.failed_positions(outcome, w.extents, "write") if outcome.errors else set()
        ok = [pos for pos in range(len(chunk)) if pos not in failed] if failed \
            else range(len(chunk))
        if ok and w.lost:
            failed.update(ok)
            ok = []
        if ok:
            try:
                if ctx.sync_data:
                    ctx.store.sync({e.file for e in w.extents})
                ctx.persist.journal_commits(
                    self._commits(chunk, w.sums, w.seqs, ok) if failed else w.commits)
            except OSError as exc:
                ctx.log_once(f"commit:{exc.errno}", "commit of %d pages failed: %s", len(ok),
                             exc)
                failed.update(ok)
                ok = []
        if ok:
            ctx.directory.commit([chunk[pos][1] for pos in ok],
                                 w.sums[ok] if failed else w.sums, ctx.checksums.algorithm)
        if failed:
            ctx.directory.abort([chunk[pos][1] for pos in sorted(failed)])
        for pos in ok:
            self.results[chunk[pos][0]] = True
        tally["bytes_written"] += len(ok) * ctx.layout.page_bytes
        tally["write_seconds"] += time.perf_counter() - w.t0
        tally["write_failed"] += len(failed)
