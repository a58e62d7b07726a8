"""Small restores and spills of host regions in one page-engine call each (issue 47).

``get_pages`` / ``put_pages`` on a CPU tier, where each page is one host region that moves in
place, is how the engines' host pools call gdskv (SGLang's host pool, vLLM's secondary tier,
LMCache's L2 adapter, LightLLM's disk cache), often one page at a time from several threads.
The general path (:class:`gdskv.restore_call.RestoreCall` / :class:`gdskv.spill_call.SpillCall`
over :class:`gdskv.host_pages.InPlacePages`) handles every case -- any regions, staging, the
backend's pool, partial failures, retries -- and a 1-page call pays for it: a restore made
about 240 Python function calls and took 119-122 µs at p50 for a 64 KiB page from /dev/shm on
the H100 host, where a raw ``preadv`` of it takes 8-10 µs. Under the interpreter lock that
cost is what caps many threads' pages/s. A quick restore makes about 100 calls and takes
45-68 µs (``bench/results/h100-2026-11-28/quick-calls/``).

These paths do only what a small call that goes right needs, the slots' I/O in one call of the
page engine on the calling thread (the payload to or from the caller's region, the rest of the
slot -- padding and trailer -- through a scratch row):

- :class:`QuickRestore`: pin the pages, read them with each page's CRC-32C compared to its
  stored one in the same engine call, unpin. On the native engine these three steps are one
  C call (``Backend.native_reader``, the engine's ``QuickReader``: ``docs/native.md``, "Quick
  restores in C"), which halved a 1-page restore's host time again (64 KiB from /dev/shm on
  the H200 host: p50 33-42 -> 13-17 µs, ``bench/results/h200-2026-11-28/quick-reader/``); on
  the Python path they are Python steps around one engine call, as below. Its counters are
  kept compact (:class:`RestoreTally`).
- :class:`QuickSpill`: reserve slots (evicting as ever), CRC-32C of the regions, trailers, the
  write, fdatasync (``sync=data``), the journal's COMMITs, READY.

When anything goes wrong, the call goes the general way, which settles it as ever:

- a restore unpins and hands the whole call on (a page read short, an I/O error, a checksum that
  differs, an exception, pages of another checksum algorithm). Its read counts as the first
  of the call's tries (``RestoreCall(reads_done=1)``), so a read that may pass (EIO) is tried
  as often as before; a lasting failure (a file gone, a truncated slab, a damaged page), which
  the general path drops after one read, is read once more.
- a spill whose write, fdatasync or journal fails, or that finds a store file removed, gives
  its slots back (nothing of it was acknowledged or journaled) and hands the whole call on:
  the general path reserves and writes again, and settles what fails.

Either way the caller gets the same results, counters and journal records, but the quick
paths' own counts (``quick_restores``, ``quick_spills``, ``quick_calls_handed_on``).

Quick restores are not combined with others in flight (:mod:`gdskv.call_combiner`): a read
that releases the GIL (a ``preadv``, a copy of 1 MiB or more: ``docs/native.md``, "The GIL")
overlaps other threads' calls, where a batch would read on one thread (16 threads of 2 MiB
/dev/shm restores on the H100 host: 0.24-0.28x raw ``preadv`` threads alone, 0.13-0.16x
combined; 64 KiB alike either way). A quick spill runs
where a spill would run alone; spills that wait are combined as before, so a batch shares one
fdatasync and journal append (16 threads of 64 KiB quick spills each on its own ran at 0.4-0.5x
the pages/s of the combined path).

A call takes a quick path (:meth:`QuickCall.regions`) when the tier's backend moves slots on
the calling thread (posix), verification and ``io_on_caller`` are on, host regions move in
place, every page is one contiguous uint8 tensor of ``page_bytes`` in host memory (4 KiB
aligned, and the page whole 4 KiB blocks, under O_DIRECT), a restore's regions do not overlap,
and the call fits one on-caller I/O (``Backend.caller_io_bytes``) and one staging chunk's
pages -- but on the native engine, where a restore (by the native reader) takes up to
:data:`NATIVE_MOST_PAGES` pages and a spill up to half the store, and a call of 8 MiB or more
is cut into parts of at least 4 MiB for the posix pool's idle threads and the caller
(``Backend.run_split``; a spill's checksums, then its write), and such a spill is not combined
with others (:meth:`QuickSpill.not_combined`). A spill also needs ``admit_after=1`` (every
page admitted at once). Any other call goes the general way, which also raises the errors a
bad argument gets.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence

import numpy as np
import torch

from . import checksum
from .data_call import CallContext
from .host_pages import HostPagePath
from .layout import ALIGNMENT, FORMAT_VERSION
from .restore_call import RestoreCall
from .spill_call import SpillCall, reserve_slots
from .streams import CallStream


#: the most pages a quick restore by the native reader takes (beyond them, the general path:
#: one call pins all its pages at once, and the directory counts pins in uint16)
NATIVE_MOST_PAGES = 1 << 14


class RestoreTally:
    """Quick restores' counters, kept compact: a restore that went right records ``(tally,
    (hits, misses, seconds))`` in the tier's ledger, added up here as the ledger applies its
    entries, and handed to the stats once per settle (:meth:`take`) as the counters a
    :class:`RestoreCall` that read its hits whole records. (Building and applying a dict of
    ten counters per call cost a 1-page restore about 1.5 µs of host time under the GIL on the
    development machine, a tenth of the call.) Only the ledger's settle, one at a time,
    touches it."""

    def __init__(self, page_bytes: int) -> None:
        self.page_bytes = page_bytes
        self.calls = self.hits = self.misses = 0
        self.seconds = 0.0

    def add(self, hits: int, misses: int, seconds: float) -> None:
        self.calls += 1
        self.hits += hits
        self.misses += misses
        self.seconds += seconds

    def take(self) -> dict:
        """The counters added up since the last take ({} if none), as ``TierStats`` keys."""
        if not self.calls:
            return {}
        hits, misses = self.hits, self.misses
        counts = {"bytes_read": hits * self.page_bytes, "read_seconds": self.seconds,
                  "read_failed": 0, "corrupt_pages": 0, "unreadable_pages": 0,
                  "pages_read_in_place": hits, "get_pages": hits + misses, "hits": hits,
                  "misses": misses, "quick_restores": self.calls}
        self.calls = self.hits = self.misses = 0
        self.seconds = 0.0
        return counts


class SpillTally:
    """Quick spills' counters, kept compact as :class:`RestoreTally` keeps restores': a spill
    that went its quick way records ``(tally, (stored, pages, evictions, written, seconds))``
    (keys stored of the call's ``pages``, pages it evicted, pages it wrote in ``seconds``), and
    :meth:`take` hands them to the stats as the counters a :class:`SpillCall` records."""

    def __init__(self, page_bytes: int) -> None:
        self.page_bytes = page_bytes
        self.calls = self.stored = self.pages = self.evictions = self.written = 0
        self.seconds = 0.0

    def add(self, stored: int, pages: int, evictions: int, written: int, seconds: float
            ) -> None:
        self.calls += 1
        self.stored += stored
        self.pages += pages
        self.evictions += evictions
        self.written += written
        self.seconds += seconds

    def take(self) -> dict:
        """The counters added up since the last take ({} if none), as ``TierStats`` keys."""
        if not self.calls:
            return {}
        counts = {"bytes_written": self.written * self.page_bytes,
                  "write_seconds": self.seconds, "write_failed": 0, "not_admitted": 0,
                  "evictions": self.evictions, "pages_written_in_place": self.written,
                  "put_pages": self.pages, "put_stored": self.stored,
                  "quick_spills": self.calls}
        self.calls = self.stored = self.pages = self.evictions = self.written = 0
        self.seconds = 0.0
        return counts


class QuickCall:
    """What one tier's quick restores and spills share: when a call qualifies."""

    #: the operation, as the tier's metrics name it
    op = ""
    #: whether a call's regions may overlap (a spill only reads them)
    overlap = False
    #: the calls' compact counters (:class:`RestoreTally`, :class:`SpillTally`)
    tally: RestoreTally | SpillTally | None = None

    def __init__(self, ctx: CallContext, host_pages: HostPagePath) -> None:
        self.ctx = ctx
        self.host_pages = host_pages
        lay = ctx.layout
        self.page_bytes = lay.page_bytes
        self.slot_bytes = lay.slot_bytes
        # the most pages a call may have: one on-caller I/O, one staging chunk
        self.max_pages = min(ctx.chunk_pages, ctx.backend.caller_io_bytes // lay.slot_bytes)
        # under O_DIRECT a region must start on a 4 KiB boundary (the page is whole blocks)
        self._align = ALIGNMENT if host_pages.direct else 1

    @classmethod
    def why_not(cls, ctx: CallContext, host_pages: HostPagePath) -> str:
        """Why a tier has no such quick calls ("" when it has)."""
        if not host_pages.enabled:
            return f"host regions do not move in place ({host_pages.why_not})"
        if not ctx.backend.caller_io_bytes:
            return f"backend {ctx.backend.name} moves no slots on the calling thread"
        if not ctx.verify:
            return "verify=false"
        if not ctx.io_on_caller:
            return "io_on_caller=false"
        if host_pages.direct and ctx.layout.page_bytes % ALIGNMENT:
            return "pages are not whole 4 KiB blocks (O_DIRECT)"
        if ctx.backend.caller_io_bytes < ctx.layout.slot_bytes:
            return "a slot is larger than one I/O on the calling thread"
        return ""

    def most_pages(self) -> int:
        """The most pages a call of this path may have now."""
        return self.max_pages

    def not_combined(self, pages: int) -> bool:
        """Whether a call of ``pages`` pages runs on its own, never combined with other calls
        in flight (:mod:`gdskv.call_combiner`). Restores: always (:meth:`Tier._pages_call`)."""
        return True

    def large(self, pages: int) -> bool:
        """Whether a call of ``pages`` pages is two on-caller I/Os or more: on the native
        engine it is cut into parts for the pool's threads (``Backend.run_split``)."""
        return pages * self.slot_bytes >= 2 * self.ctx.backend.caller_io_bytes

    def describe(self) -> dict:
        return {"enabled": True, "reason": f"{self.op}_pages of up to {self.most_pages()} "
                "pages, one host region each: one engine call on the calling thread"}

    def regions(self, pages: Sequence[Sequence[torch.Tensor]]) -> list[int] | None:
        """The addresses of the call's regions, one per page, where the call can take this
        path; else None (the general path then checks the arguments and says what is wrong
        with them). The caller holds ``pages`` until the call returns."""
        n = len(pages)
        if not 0 < n <= self.most_pages():
            return None
        out = []
        pb, align, uint8 = self.page_bytes, self._align, torch.uint8
        for regions in pages:
            if len(regions) != 1:
                return None
            r = regions[0]
            if not (isinstance(r, torch.Tensor) and r.dtype is uint8 and r.dim() == 1
                    and r.is_cpu and r.is_contiguous() and r.numel() == pb):
                return None
            at = r.data_ptr()
            if at % align:
                return None
            out.append(at)
        if n > 1 and not self.overlap:  # one page's bytes would land in another's
            starts = sorted(out)
            if any(b - a < pb for a, b in zip(starts, starts[1:])):
                return None
        return out

    def _frame(self, todo: list, regions: list[int]) -> tuple[list, np.ndarray, np.ndarray]:
        """The slots ``todo`` (``(position, slot, ...)``, in slot order) as the backend moves
        them: their places, and their memory as the page engine's ``(address, length)`` rows
        -- each region, then its scratch row (the rows, returned too).

        Addresses, not numpy views of the regions: torch gives up the GIL to make a view and
        again when the view dies, and under many threads each give-up is a thread switch
        (:mod:`gdskv.yielding_lock`). ``regions``: their addresses (:meth:`regions`)."""
        n, tail, pb = len(todo), self.slot_bytes - self.page_bytes, self.page_bytes
        rows, at = self.host_pages.scratch_at(n * tail)
        location = self.ctx.store.location
        places, flat = [], []
        for j, item in enumerate(todo):
            places.append(location(item[1]))
            flat += (regions[item[0]], pb, at + j * tail, tail)
        return places, np.array(flat, np.int64).reshape(-1, 2), rows.reshape(n, tail)

    def _hand_on(self, **counts) -> None:
        self.ctx.ledger.record({"quick_calls_handed_on": 1, **counts}, None)


class QuickRestore(QuickCall):
    """One tier's quick path for small in-place restores (see the module)."""

    op = "get"

    def __init__(self, ctx: CallContext, host_pages: HostPagePath) -> None:
        super().__init__(ctx, host_pages)
        self.tally = RestoreTally(self.page_bytes)
        # the native engine's pins, read and unpins in one call (Backend.native_reader)
        ctx.backend.make_native_reader(ctx.directory, ctx.store.stripe_slots, self.slot_bytes,
                                       self.page_bytes, checksum.CRC32C,
                                       self._release_evicting)

    def most_pages(self) -> int:
        # the native reader takes calls of any size, cut for the pool's idle threads
        return NATIVE_MOST_PAGES if self.ctx.backend.native_reader is not None else \
            self.max_pages

    def describe(self) -> dict:
        steps = "one native call (pins, read, unpins) per part of at least 4 MiB, the parts " \
            "on the posix pool's idle threads" if self.ctx.backend.native_reader is not None \
            else "Python steps around one engine call"
        return {**super().describe(), "steps": steps}

    def _release_evicting(self, slots: list[int]) -> None:
        """Unpin pages that were asked to go while the native reader held them: they go
        now, journaled, as :meth:`run`'s own unpins do."""
        self.ctx.persist.journal_evictions(self.ctx.directory.unpin(slots))

    def run(self, keys: list[Hashable], regions: list[int],
            pages: Sequence[Sequence[torch.Tensor]], stream: CallStream | None) -> list[bool]:
        """Restore ``keys`` into ``regions`` (from :meth:`regions` of ``pages``): per page a
        hit or a miss, as :class:`RestoreCall` answers."""
        ctx = self.ctx
        reader = ctx.backend.native_reader
        if reader is not None:
            return self._run_native(reader, keys, regions, pages, stream)
        directory = ctx.directory
        todo, same = directory.pin_for_read(keys, algorithm=checksum.CRC32C)
        if not todo:
            return self._done(keys, [False] * len(keys), 0, 0.0)
        slots = [s for _, s, _ in todo]
        status = None
        tried = False
        try:
            if same:
                tried = True
                t0 = time.perf_counter()
                places, memory, _ = self._frame(todo, regions)
                status = ctx.backend.read_checked_on_caller(
                    places, memory, self.slot_bytes, self.page_bytes,
                    np.fromiter((want for _, _, want in todo), np.uint64, len(todo)))
                seconds = time.perf_counter() - t0
        except Exception:  # noqa: BLE001 - the general path reads again and settles it
            status = None
        finally:
            ctx.persist.journal_evictions(directory.unpin(slots))
        if status is None or np.count_nonzero(status):
            # another tier's checksums, or a page that did not read back whole and equal: the
            # general path settles it (reading again; this read was the first try)
            self._hand_on()
            return RestoreCall(ctx, keys, self.host_pages.call(pages), stream,
                               reads_done=int(tried)).run()
        results = [False] * len(keys)
        for pos, _, _ in todo:
            results[pos] = True
        return self._done(keys, results, len(todo), seconds)

    def _run_native(self, reader, keys: list[Hashable], regions: list[int],
                    pages: Sequence[Sequence[torch.Tensor]], stream: CallStream | None
                    ) -> list[bool]:
        """:meth:`run` by the native reader: the same steps, outcomes and hand-on. A call of
        two on-caller I/Os or more is cut into parts, one reader call each, for the backend's
        idle pool threads and this one (``Backend.run_split``): one thread's copies and
        checksums would not keep up with the medium."""
        n = len(keys)
        if n == 1 or not self.large(n):
            try:
                outs = [reader.read(keys, regions)]
            except Exception as exc:  # noqa: BLE001 - the general path reads it again
                outs = [exc]
        else:
            outs = self.ctx.backend.run_split(
                lambda a, b: reader.read(keys[a:b], regions[a:b]), n, n * self.slot_bytes)
        if all(o.__class__ is tuple for o in outs):
            if len(outs) == 1:
                results, hits, seconds = outs[0]
            else:
                results = [hit for o in outs for hit in o[0]]
                hits, seconds = sum(o[1] for o in outs), max(o[2] for o in outs)
            return self._done(keys, results, hits, seconds)
        # another tier's checksums (0: nothing read), a page that did not read back whole and
        # equal (1: this read was the first try), or an exception (its pins are gone; counted
        # as no read): the general path settles the whole call
        reads_done = int(all(o.__class__ is tuple or o == 1 for o in outs))
        self._hand_on()
        return RestoreCall(self.ctx, keys, self.host_pages.call(pages), stream,
                           reads_done=reads_done).run()

    def _done(self, keys: list, results: list[bool], hits: int, seconds: float) -> list[bool]:
        """The call's counters, as a :class:`RestoreCall` that read ``hits`` pages whole
        would record them (:class:`RestoreTally`)."""
        self.ctx.ledger.record((self.tally, (hits, len(keys) - hits, seconds)), None)
        return results


class QuickSpill(QuickCall):
    """One tier's quick path for small in-place spills (see the module)."""

    op = "put"
    overlap = True

    def __init__(self, ctx: CallContext, host_pages: HostPagePath) -> None:
        super().__init__(ctx, host_pages)
        # On the native engine a spill of any size (up to half the store, so that its slots,
        # reserved at once, always find room as the general path's chunk by chunk would) is
        # one call: its checksums and its write cut into parts for the pool's threads
        self._most_native = min(NATIVE_MOST_PAGES, max(1, ctx.store.num_slots // 2))
        self._native = host_pages.engine.path == "native"
        self.tally = SpillTally(self.page_bytes)

    @classmethod
    def why_not(cls, ctx: CallContext, host_pages: HostPagePath) -> str:
        if ctx.config.admit_after > 1:
            return f"admit_after={ctx.config.admit_after}"
        return super().why_not(ctx, host_pages)

    def most_pages(self) -> int:
        return max(self.max_pages, self._most_native) if self._native else self.max_pages

    def not_combined(self, pages: int) -> bool:
        """A spill of two on-caller I/Os or more runs on its own: its fdatasync and journal
        append are a small share of its time, and combined with the spills in flight it
        would write on one thread (vLLM's 16 jobs at once of 16 blocks of 2 MiB). Smaller
        spills that wait are combined (one fdatasync and append for the batch)."""
        return self.large(pages)

    def run(self, keys: list[Hashable], regions: list[int],
            pages: Sequence[Sequence[torch.Tensor]], stream: CallStream | None) -> list[bool]:
        """Store ``keys`` from ``regions`` (from :meth:`regions` of ``pages``): per page
        whether it is stored, as :class:`SpillCall` answers."""
        ctx = self.ctx
        results = [False] * len(keys)
        tally = {}
        todo, waiting = reserve_slots(ctx, keys, list(range(len(keys))), results, tally)
        seconds = 0.0
        if todo:
            slots = [s for _, s in todo]
            try:
                t0 = time.perf_counter()
                written = self._write(keys, todo, regions)
                seconds = time.perf_counter() - t0
            except BaseException:
                ctx.directory.abort(slots)
                raise
            if written is None:  # nothing acknowledged: the general path writes them again
                ctx.directory.abort(slots)
                self._hand_on(evictions=tally["evictions"])  # (they made room: they count)
                return SpillCall(ctx, keys, self.host_pages.call(pages), stream).run()
            ctx.directory.commit(slots, written, checksum.CRC32C)
            for pos, _ in todo:
                results[pos] = True
        if waiting:  # keys another call was writing: its outcome is theirs
            for i, ok in zip(waiting, ctx.directory.wait_written([keys[i] for i in waiting])):
                results[i] = ok
        ctx.ledger.record((self.tally, (sum(results), len(keys), tally["evictions"], len(todo),
                                        seconds)), None)
        return results

    def _write(self, keys: list, todo: list, regions: list[int]) -> np.ndarray | None:
        """Checksum, trailer, write, fdatasync and journal the reserved slots ``todo``
        (``(position, slot)``, in slot order); their checksums, or None where any of it failed
        (nothing journaled: the slots can be given back)."""
        ctx = self.ctx
        places, memory, rows = self._frame(todo, regions)
        n, pb, sb = len(todo), self.page_bytes, self.slot_bytes
        sums = np.empty(n, dtype=np.uint64)
        page_sums = self.host_pages.engine.page_sums
        # a call of two on-caller I/Os or more: its checksums, then its write, in parts for
        # the pool's idle threads and this one (Backend.run_split), as its restore would be
        split = n > 1 and self.large(n)
        if split:
            for out in ctx.backend.run_split(
                    lambda a, b: page_sums(memory[2 * a:2 * b:2].copy(), pb, pb, sums[a:b]),
                    n, n * sb):
                if isinstance(out, Exception):
                    raise out
        else:
            page_sums(memory[::2].copy(), pb, pb, sums)
        # each slot's trailer at the end of its row, the rest of the row zeroed (a reused
        # row: no earlier call's bytes), in one engine call
        page_keys, slots = [keys[i] for i, _ in todo], [s for _, s in todo]
        seqs = ctx.persist.next_seqs(n)
        self.host_pages.engine.seal_slots(rows, FORMAT_VERSION, ctx.checksums.algorithm,
                                          ctx.store.store_id, page_keys, slots, seqs, sums)
        # a page written to a removed file would be acknowledged and then gone
        if ctx.lost_files():
            return None
        write = ctx.backend.write_on_caller
        try:
            if split:
                # (every part ends before run_split returns: none writes after a give-back)
                written = ctx.backend.run_split(
                    lambda a, b: write(places[a:b], memory[2 * a:2 * b], sb, pb), n, n * sb)
                if not all(w is True for w in written):
                    return None
            elif not write(places, memory, sb, pb):
                return None
            if ctx.sync_data:
                ctx.store.sync({f for f, _ in places})
            ctx.persist.journal_commits(ctx.persist.encode_commits(
                page_keys, slots, sums.tolist(), checksum.CRC32C, seqs))
        except OSError:
            return None
        return sums
