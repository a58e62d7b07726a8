"""The page directory and the journal that persists it: the journal <-> directory logic.

A writer tier journals a COMMIT for every page it makes READY and an EVICT for every page it
drops. At open, recovery replays the journal into the directory; when the journal holds far
more records than live pages, compaction rewrites it to one COMMIT per live page (at open and
at close). A read-only follower never writes the journal: it loads the writer's journal the same
way at open, then catches up with what the writer appended since, starting over when the writer
compacted (or cut) it. Recovery and catch-up keep the same records: a slot this store has, in a
slab file not replaced since, checksummed with an algorithm this process can verify, and the
newest COMMIT per slot (an EVICT lost in a crash: the newer commit owns the slot).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Hashable, Iterable, Sequence

import numpy as np

from . import checksum, header_scan
from .config import Eviction, SyncPolicy, TierConfig
from .directory import PageDirectory
from .journal import (Encoded, Journal, JournalFollower, Record, RecordKind, encode_commits,
                      live_records)
from .stats import TierStats
from .store import SlabStore

log = logging.getLogger("gdskv.persistence")

#: compaction runs when the journal holds more than 2 x live pages + this many records
COMPACT_SLACK = 1024


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
            self.journal = Journal(store.journal_path, sync=config.sync == SyncPolicy.DATA)
        self._verify = bool(config.verify)
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
            live, nrec = live_records(records), len(records)
        else:
            live, nrec = self.journal.replay()
        scanned = not self.read_only and (self._force_scan or self._journal_lost or
                                          self.journal.damaged or self.journal.torn)
        if scanned:
            live = self._scan(live)
        recovered = self._servable(live.values(), self.store.replaced_files)
        self._load(self.directory, recovered)
        if scanned:
            # the damage would be met again at every open: one clean journal from now on
            self._rewrite(recovered, "after the header scan")
        elif not self.read_only and nrec > 2 * len(recovered) + COMPACT_SLACK:
            self._rewrite(recovered, "at open")
        self._stats.add(recovered_pages=len(recovered),
                        recovery_seconds=time.perf_counter() - t0)
        if recovered:
            log.info("gdskv: recovered %d pages from %s in %.3f s", len(recovered),
                     self.journal.path, time.perf_counter() - t0)

    def _scan(self, live: dict) -> dict:
        """Live pages after a header scan of every slot (the journal cannot vouch for all)."""
        why = "the journal is missing" if self._journal_lost else \
            "the journal was damaged" if self.journal.damaged or self.journal.torn else \
            "a header scan was asked for"
        if not self._verify:  # trailers' checksums are 0 and reads would not verify anyway
            log.warning("gdskv: %s, but verify=false: pages the journal does not name are not "
                        "rebuilt from slot trailers (their payloads cannot be checked)", why)
            return live
        t0 = time.perf_counter()
        scanned = header_scan.scan(self.store, self._scan_progress)
        # new pages must get seqs above every trailer's, or the next scan would prefer old ones
        self.journal.seq = max(self.journal.seq, max((r.seq for r in scanned), default=0))
        merged = header_scan.merge(live, self.journal.evicted, scanned)
        adopted = sum(1 for k, rec in merged.items() if live.get(k) is not rec)
        seconds = time.perf_counter() - t0
        self._stats.add(header_scan_seconds=seconds, header_scan_pages=adopted)
        log.warning("gdskv: %s: header scan of %d slots in %.2f s took %d pages from slot "
                    "trailers beside the journal's %d", why, self.store.num_slots, seconds,
                    adopted, len(live))
        return merged

    def _servable(self, live: Iterable[Record], replaced: set[int]) -> list[Record]:
        """The live COMMITs this store can serve, the newest one per slot, oldest first (LRU
        order)."""
        by_slot: dict[int, Record] = {}
        unknown = 0
        for rec in live:
            if rec.slot >= self.store.num_slots or \
                    (replaced and self.store.location(rec.slot)[0] in replaced):
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

    @staticmethod
    def encode_commits(keys: Sequence[Hashable], slots: Sequence[int], checksums: Sequence[int],
                       algorithm: int, seqs: Sequence[int]) -> Encoded:
        """The COMMITs of pages given as columns (``keys[i]`` in ``slots[i]`` with checksum
        ``checksums[i]`` made by ``algorithm``, sequence number ``seqs[i]``), encoded ahead of
        :meth:`journal_commits` (a spill encodes them while its write runs)."""
        return encode_commits(keys, slots, checksums, algorithm, seqs)

    def journal_evictions(self, evicted: list[tuple[Hashable, int]]) -> None:
        """Journal pages the directory dropped (a follower only forgets them locally)."""
        if not evicted or self.read_only:
            return
        try:
            self.journal.append(Record(RecordKind.EVICT, self.journal.next_seq(), slot, 0, 0, key)
                                for key, slot in evicted)
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
        entries = self.directory.ready_entries()
        # fresh seqs above every one in use: a header scan must still find the journal's
        # records newer than any trailer they outlived
        seqs = self.next_seqs(len(entries))
        self._rewrite([Record(RecordKind.COMMIT, seq, slot, csum, algo, key) for seq,
                       (key, slot, csum, algo) in zip(seqs, entries)],
                      "on request" if force else "at close")

    def _rewrite(self, records: list[Record], when: str) -> None:
        try:
            self.journal.rewrite(records)
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
            self._load(directory, self._servable(live_records(records).values(), set()))
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
