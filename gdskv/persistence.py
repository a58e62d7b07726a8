"""The page directory and the journal that persists it: the journal <-> directory logic.

A writer tier journals a COMMIT for every page it makes READY and an EVICT for every page it
drops. At open, recovery replays the journal into the directory; when the journal holds far
more records than live pages, compaction rewrites it to one COMMIT per live page (at open and
at close), each with a fresh sequence number above all in use. A read-only follower never
writes the journal: it loads the writer's journal the same way at open, then catches up with
what the writer appended since, starting over when the writer compacted (or cut) it. Recovery
and catch-up keep the same records: a slot this store has, checksummed with an algorithm this
process can verify, and the newest COMMIT per slot (an EVICT lost in a crash: the newer commit
owns the slot).

Where the journal cannot vouch for every page, recovery asks the slot trailers
(:mod:`.header_scan`), and a trailer is taken only where the journal knows nothing newer of its
slot or key (:class:`~gdskv.journal.History`): a page the journal saw evicted stays evicted, and
per key the newest sequence number in the whole store wins.

- A journal missing, damaged or torn, or a scan asked for (``gdskv rebuild``): every slot's
  trailer is read.
- Slab files with another inode than the manifest recorded (a copied, moved-by-copy or restored
  store, ``docs/backup.md``): their trailers are read; a journal page there is kept only where
  the trailer in its slot names the same key and checksum.
- A journal cut at a record boundary decodes whole. So a writer's recovery reads the trailers
  of the slots its allocator would have handed out after the journal's last record, the lowest
  free ones (batch after batch while they hold pages newer than the journal), and of the
  oldest live pages (the first that LRU reuses). Pages newer than the journal there are writes
  that were in flight when the writer died or commits the journal lost: up to a staging
  buffer's worth are taken when their payloads verify now; more than that, or any over a page
  the journal calls live, or free slots running out before the pages do, means the journal is
  shorter than the trailers prove, and every trailer is read.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Hashable, Iterable, Sequence

import numpy as np

from . import checksum, header_scan, native
from .config import Eviction, SyncPolicy, TierConfig
from .directory import PageDirectory
from .journal import (Encoded, History, Journal, JournalFollower, Record, RecordKind,
                      history, live_records)
from .stats import TierStats
from .store import SlabStore

log = logging.getLogger("gdskv.persistence")

#: compaction runs when the journal holds more than 2 x live pages + this many records
COMPACT_SLACK = 1024
#: slots whose trailers a writer's recovery reads at a time past the journal's end
TAIL_BATCH = 256


class PersistentDirectory:
    """A tier's :class:`PageDirectory` (``directory``) and its journal (``journal``).

    ``log_once(tag, msg, *args)``: the tier's warn-once logger (one line per kind of failure).
    """

    def __init__(self, store: SlabStore, config: TierConfig, stats: TierStats,
                 log_once: Callable[..., None], *, scan_headers: bool = False,
                 scan_progress: Callable[[int], None] | None = None) -> None:
        self.store = store
        self._force_scan = scan_headers
        self._scan_progress = scan_progress
        self.read_only = bool(config.read_only)
        self._stats = stats
        self._log_once = log_once
        self.directory = PageDirectory(store.num_slots, evict=config.eviction == Eviction.LRU,
                                       follower=self.read_only)
        if self.read_only:
            self.journal: Journal | JournalFollower = JournalFollower(store.journal_path)
            # seq of the COMMIT that put each slot's page there: the newest one wins
            self._slot_seq = np.zeros(store.num_slots, dtype=np.uint64)
        else:
            # no journal beside an existing store: lost, so the slot trailers must tell
            self._journal_lost = not store.created and not os.path.exists(store.journal_path)
            self.journal = Journal(store.journal_path, sync=config.sync == SyncPolicy.DATA,
                                   engine=native.engine(config.native))
        self._verify = bool(config.verify)
        self._encode_records = native.engine(config.native).encode_records
        # pages that can be written but not yet journaled at once (staged writes in flight)
        self._in_flight = max(TAIL_BATCH, config.staging_size // store.slot_bytes)
        try:
            self._recover()
        except BaseException:
            self.journal.close()
            raise

    # -- recovery --------------------------------------------------------------------------------
    def _recover(self) -> None:
        t0 = time.perf_counter()
        if self.read_only:  # never cut, rewrite or compact the writer's journal
            _, records = self.journal.poll()
            live, nrec, known = live_records(records), len(records), history(records)
        else:
            live, nrec = self.journal.replay()
            known = self.journal.history
        replaced = set(self.store.replaced_files)
        files: set[int] | None = None  # slab files whose trailers are read (None: all)
        why, adopted = None, False
        recovered = self._servable(live.values())
        if not self.read_only and (self._force_scan or self._journal_lost or
                                   self.journal.damaged or self.journal.torn):
            why = "the journal is missing" if self._journal_lost else \
                "the journal was damaged" if self.journal.damaged or self.journal.torn else \
                "a header scan was asked for"
        elif not self.read_only and not self.store.created and self._verify and \
                len(replaced) < len(self.store.files):
            live, why, adopted = self._check_tail(live, recovered, known)
        if why is None and replaced:
            why = (f"slab files {sorted(replaced)} were replaced since the store was last open "
                   "(a copy or restore)")
            files = replaced
        if why is not None:
            live = self._scan(live, known, why, files, replaced)
        if why is not None or adopted:
            recovered = self._servable(live.values())
        self._load(self.directory, recovered)
        if not self.read_only and (why is not None or adopted):
            # what was found would be looked for again at every open: one journal that has it
            self._rewrite(recovered, "after reading slot trailers")
        elif not self.read_only and nrec > 2 * len(recovered) + COMPACT_SLACK:
            self._rewrite(recovered, "at open")
        self._stats.add(recovered_pages=len(recovered),
                        recovery_seconds=time.perf_counter() - t0)
        if recovered:
            log.info("gdskv: recovered %d pages from %s in %.3f s", len(recovered),
                     self.journal.path, time.perf_counter() - t0)

    def _scan(self, live: dict, known: History, why: str, files: set[int] | None,
              replaced: set[int]) -> dict:
        """Live pages after reading the slot trailers of slab ``files`` (None: all of them);
        a journal page in a ``replaced`` file is kept only where its slot's trailer agrees."""
        if not self._verify:  # trailers' checksums are 0 and reads would not verify anyway
            log.warning("gdskv: %s, but verify=false: pages the journal does not name are not "
                        "taken from slot trailers (their payloads cannot be checked)%s", why,
                        "; the journal's pages in the replaced files are dropped"
                        if replaced else "")
            return {k: r for k, r in live.items() if not self._in(r, replaced)}
        t0 = time.perf_counter()
        scanned = header_scan.scan(self.store, self._scan_progress, files)
        if replaced:
            found = {r.slot: r for r in scanned}
            live = {k: r for k, r in live.items()
                    if not self._in(r, replaced) or _agrees(found.get(r.slot), r)}
        # new pages must get seqs above every trailer's, or the next scan would prefer old ones
        self._raise_seq(scanned)
        merged = header_scan.merge(live, known, scanned)
        adopted = sum(1 for k, rec in merged.items() if live.get(k) is not rec)
        seconds = time.perf_counter() - t0
        self._stats.add(header_scan_seconds=seconds, header_scan_pages=adopted)
        nslots = header_scan.slots_in_file(self.store) * \
            (len(self.store.files) if files is None else len(files))
        log.warning("gdskv: %s: header scan of %d slots in %.2f s took %d pages from slot "
                    "trailers beside the journal's %d", why, nslots, seconds, adopted, len(live))
        return merged

    def _in(self, rec: Record, files: set[int]) -> bool:
        """Whether ``rec``'s slot lies in one of slab ``files``."""
        return bool(files) and rec.slot < self.store.num_slots and \
            self.store.location(rec.slot)[0] in files

    def _raise_seq(self, records: Iterable[Record]) -> None:
        if not self.read_only:
            self.journal.seq = max(self.journal.seq, max((r.seq for r in records), default=0))

    def _check_tail(self, live: dict, recovered: list[Record],
                    known: History) -> tuple[dict, str | None, bool]:
        """(live, why every trailer must be read or None, whether pages were taken): the
        journal's end checked against the trailers of the slots a writer uses first after it
        (the module docstring says how). ``recovered``: the journal's servable pages, oldest
        first."""
        num = self.store.num_slots
        by_slot = {r.slot: r for r in recovered[:TAIL_BATCH]}
        over = [t for t in header_scan.read_trailers(self.store, by_slot)
                if t.seq > by_slot[t.slot].seq and known.may_adopt(t)]
        if over:
            return live, (f"the journal is shorter than the slot trailers show ({len(over)} of "
                          "its live pages were overwritten after its last record)"), False
        taken = np.zeros(num, dtype=bool)
        taken[np.fromiter((r.slot for r in recovered), dtype=np.int64, count=len(recovered))] = \
            True
        free = np.flatnonzero(~taken)  # in the order the allocator hands them out
        found: list[Record] = []
        for pos in range(0, len(free), TAIL_BATCH):
            news = [t for t in header_scan.read_trailers(self.store, free[pos:pos + TAIL_BATCH])
                    if known.may_adopt(t) and (t.key not in live or t.seq > live[t.key].seq)]
            if not news:
                break
            found += news
            if len(found) > self._in_flight:
                return live, (f"the journal is shorter than the slot trailers show (more than "
                              f"{self._in_flight} pages written after its last record)"), False
        if not found:
            return live, None, False
        whole = header_scan.payload_matches(self.store, found)
        self._raise_seq(found)
        self._stats.add(journal_tail_pages=len(whole))
        log.warning("gdskv: %d pages written after the journal's last record (writes in flight "
                    "when the writer stopped, or records the journal lost) found in their slot "
                    "trailers: %d taken (payload verified), %d not whole", len(found),
                    len(whole), len(found) - len(whole))
        return header_scan.merge(live, known, whole), None, True

    def _servable(self, live: Iterable[Record]) -> list[Record]:
        """The live COMMITs this store can serve, the newest one per slot, oldest first (LRU
        order)."""
        by_slot: dict[int, Record] = {}
        unknown = 0
        for rec in live:
            if rec.slot >= self.store.num_slots:
                continue
            if not checksum.known(rec.algorithm):  # cannot be verified: a miss, not a risk
                unknown += 1
                continue
            cur = by_slot.get(rec.slot)
            if cur is None or rec.seq > cur.seq:
                by_slot[rec.slot] = rec
        if unknown:
            self._log_once("unknown-algo", "gdskv: dropped %d pages checksummed with an "
                           "algorithm this process cannot verify", unknown)
        return sorted(by_slot.values(), key=lambda r: r.seq)

    def _load(self, directory: PageDirectory, recovered: list[Record]) -> None:
        directory.load([r.key for r in recovered], [r.slot for r in recovered],
                       [r.checksum for r in recovered], [r.algorithm for r in recovered])
        if self.read_only:
            self._slot_seq[:] = 0
            self._slot_seq[[r.slot for r in recovered]] = [r.seq for r in recovered]

    # -- the writer's records --------------------------------------------------------------------
    def next_seqs(self, n: int) -> Sequence[int]:
        """Sequence numbers for ``n`` pages about to be written (their trailers and COMMITs)."""
        return self.journal.next_seqs(n)

    def journal_commits(self, commits: Encoded) -> None:
        """Journal pages as READY (durable when the call returns, per the sync policy): the
        COMMITs :meth:`encode_commits` made. Raises OSError: the pages must then not become
        READY."""
        self.journal.append(commits)

    def encode_commits(self, keys: Sequence[Hashable], slots: Sequence[int],
                       checksums: Sequence[int], algorithm: int, seqs: Sequence[int]) -> Encoded:
        """The COMMITs of pages given as columns (``keys[i]`` in ``slots[i]`` with checksum
        ``checksums[i]`` made by ``algorithm``, sequence number ``seqs[i]``), encoded ahead of
        :meth:`journal_commits` (a spill encodes them while its write runs), by the page
        engine (gdskv/native/records.c, or its Python twin)."""
        return Encoded(self._encode_records(RecordKind.COMMIT, keys, slots, checksums,
                                            algorithm, seqs), len(keys))

    def journal_evictions(self, evicted: list[tuple[Hashable, int]]) -> None:
        """Journal pages the directory dropped (a follower only forgets them locally)."""
        if not evicted or self.read_only:
            return
        try:
            self.journal.append(Encoded(self._encode_records(
                RecordKind.EVICT, [k for k, _ in evicted], [s for _, s in evicted], None, 0,
                self.journal.next_seqs(len(evicted))), len(evicted)))
        except OSError as exc:
            # The slot may be rewritten later; its old COMMIT then fails its checksum on replay.
            self._log_once("evict-journal", "journaling %d evictions failed: %s", len(evicted),
                           exc)

    def compact(self, force: bool = False) -> None:
        """Rewrite the journal to one COMMIT per live page if it has grown long, or ``force``
        (the writer, with no data call in flight)."""
        if self.read_only or not force and self.journal.records_written <= \
                2 * len(self.directory) + COMPACT_SLACK:
            return
        self._rewrite([Record(RecordKind.COMMIT, 0, slot, csum, algo, key)
                       for key, slot, csum, algo in self.directory.ready_entries()],
                      "on request" if force else "at close")

    def _rewrite(self, records: list[Record], when: str) -> None:
        """Replace the journal with ``records`` (live COMMITs, oldest first), each given a
        fresh seq above every one in use: a header scan must still find them newer than any
        trailer they outlived, and any trailer below the first of them is a page that was not
        live now (:class:`~gdskv.journal.History`'s ``base``)."""
        seqs = self.next_seqs(len(records))
        try:
            self.journal.rewrite([r._replace(seq=seq) for r, seq in zip(records, seqs)])
        except OSError as exc:  # e.g. ENOSPC: the long journal is still valid
            log.warning("gdskv: journal compaction %s failed: %s", when, exc)

    # -- read-only follower ----------------------------------------------------------------------
    def catch_up(self) -> int:
        """Apply the writer's journal records appended since the last catch-up; returns how many
        changed the directory (all of them after the writer compacted). Call it alone: no data
        call in flight, so no page is pinned."""
        try:
            reset, records = self.journal.poll()
        except OSError as exc:  # the pages we know stay readable (and verified)
            self._log_once("follow", "read-only tier: cannot read the writer's journal %s: %s",
                           self.journal.path, exc)
            return 0
        if reset:  # the writer compacted (or restarted and cut) its journal: start over
            directory = PageDirectory(self.store.num_slots, evict=False, follower=True)
            self._load(directory, self._servable(live_records(records).values()))
            self.directory = directory
            self._stats.add(follower_resets=1, follower_records=len(records))
            return len(records)
        commit, num_slots, seqs = RecordKind.COMMIT, self.store.num_slots, self._slot_seq
        applied = 0
        for rec in records:
            if rec.kind is commit:
                if rec.slot >= num_slots or rec.seq < int(seqs[rec.slot]) or \
                        not checksum.known(rec.algorithm):
                    continue
                if self.directory.place(rec.key, rec.slot, rec.checksum, rec.algorithm):
                    seqs[rec.slot] = rec.seq
                    applied += 1
            elif self.directory.drop(rec.key, rec.slot):
                applied += 1
        if records:
            self._stats.add(follower_records=len(records))
        return applied

    def removed_files(self) -> list[str]:
        """The writer's journal, if it was unlinked while open (a follower checks nothing)."""
        return [] if self.read_only or not self.journal.removed() else [self.journal.path]

    def close(self) -> None:
        self.journal.close()


def _agrees(trailer: Record | None, rec: Record) -> bool:
    """Whether a slot's trailer names the page a journal record puts there (seqs may differ:
    a rewrite renumbers the journal's)."""
    return trailer is not None and (trailer.key, trailer.checksum, trailer.algorithm) == \
        (rec.key, rec.checksum, rec.algorithm)
