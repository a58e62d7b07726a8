"""Which offloaded blocks are on disk, as the vLLM scheduler sees it: followed from the stores'
journals, never from a second bookkeeping of its own.

vLLM's scheduler (where the offloading manager lives) and its workers (where the tiers write)
may be different processes. The workers' tiers own the truth: a page is READY once its COMMIT is
in the store's journal, and evictions, failed writes and pages dropped for a bad checksum are in
the same journal (or never reached it). So the manager reads the journals read-only, as a
follower tier does (:class:`~gdskv.journal.JournalFollower`: one ``stat`` when nothing changed),
and a block counts as stored once the store of *every* worker rank holds it: a load needs every
rank's share of the block. A restart needs nothing more: the journals are already there.

In a cluster store (:mod:`gdskv.cluster`) each worker rank's directory holds one namespace per
node; a rank holds a key when any of its namespaces does, and the namespaces are listed again
every ``discovery_s`` (new nodes followed, vanished ones forgotten).
"""

from __future__ import annotations

import os
import time
from collections.abc import Hashable, Sequence

from ...journal import JournalFollower, RecordKind, live_records
from ...store import JOURNAL


class _Journal:
    """One store's journal, followed, and the keys it holds now (key -> slot)."""

    def __init__(self, rank: int, directory: str) -> None:
        self.rank = rank
        self.follower = JournalFollower(os.path.join(directory, JOURNAL))
        self.live: dict[Hashable, int] = {}


class KeyIndex:
    """Keys held by all of ``store_dirs`` (one store per worker rank), from their journals.

    ``cluster``: each of ``store_dirs`` holds one store per node (its sub-directories), and a
    rank holds a key when any of them does.

    :meth:`refresh` reads what the writers appended since the last call and returns the keys
    that became complete (in every rank) and those that stopped being complete.
    """

    def __init__(self, store_dirs: Sequence[str], *, cluster: bool = False,
                 discovery_s: float = 1.0) -> None:
        self._dirs = list(store_dirs)
        self._cluster = cluster
        self._discovery_s = discovery_s
        self._listed = float("-inf")
        #: the journals followed: by store directory
        self._journals: dict[str, _Journal] = {}
        if not cluster:
            for rank, d in enumerate(self._dirs):
                self._journals[d] = _Journal(rank, d)
        #: per rank, how many of its journals hold each key
        self._held: list[dict[Hashable, int]] = [{} for _ in self._dirs]
        #: per key, how many ranks hold it
        self._count: dict[Hashable, int] = {}
        self.num_stores = len(self._dirs)

    def __contains__(self, key: Hashable) -> bool:
        return self._count.get(key, 0) == self.num_stores

    def __len__(self) -> int:
        return sum(c == self.num_stores for c in self._count.values())

    def refresh(self) -> tuple[list, list]:
        """(keys now complete, keys no longer complete) since the last call. A journal that
        cannot be read leaves that store's keys as they were (a later load that finds a page
        gone is a miss the connector turns into a recompute)."""
        was: dict[Hashable, bool] = {}  # completeness of each key touched, before this call
        if self._cluster and time.monotonic() - self._listed >= self._discovery_s:
            self._list_namespaces(was)
        for journal in self._journals.values():
            try:
                reset, records = journal.follower.poll()
            except OSError:
                continue
            live = journal.live
            if reset:
                now = {k: r.slot for k, r in live_records(records).items()}
                for key in live.keys() - now.keys():
                    self._change(journal.rank, key, -1, was)
                for key in now.keys() - live.keys():
                    self._change(journal.rank, key, +1, was)
                journal.live = now
                continue
            for rec in records:
                if rec.kind is RecordKind.COMMIT:
                    if rec.key not in live:
                        self._change(journal.rank, rec.key, +1, was)
                    live[rec.key] = rec.slot
                elif live.get(rec.key) == rec.slot:  # an EVICT of the page we know
                    del live[rec.key]
                    self._change(journal.rank, rec.key, -1, was)
        added = [k for k, before in was.items() if not before and k in self]
        removed = [k for k, before in was.items() if before and k not in self]
        return added, removed

    def _list_namespaces(self, was: dict) -> None:
        """Cluster: follow each node's store under each rank's directory; forget vanished
        ones (their keys stop counting)."""
        self._listed = time.monotonic()
        found: dict[str, int] = {}
        for rank, parent in enumerate(self._dirs):
            try:
                names = [e.name for e in os.scandir(parent)
                         if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")]
            except OSError:  # not made yet, or unreadable now: what we follow stays
                found.update({d: j.rank for d, j in self._journals.items() if j.rank == rank})
                continue
            found.update({os.path.join(parent, n): rank for n in names})
        for d in set(self._journals) - set(found):
            journal = self._journals.pop(d)
            for key in journal.live:
                self._change(journal.rank, key, -1, was)
            journal.follower.close()
        for d, rank in found.items():
            if d not in self._journals:
                self._journals[d] = _Journal(rank, d)

    def _change(self, rank: int, key: Hashable, delta: int, was: dict) -> None:
        """One journal of ``rank`` gained (+1) or lost (-1) ``key``."""
        was.setdefault(key, key in self)
        held = self._held[rank]
        before = held.get(key, 0)
        after = before + delta
        if after > 0:
            held[key] = after
        else:
            held.pop(key, None)
        if (before > 0) != (after > 0):
            count = self._count.get(key, 0) + (1 if after > 0 else -1)
            if count > 0:
                self._count[key] = count
            else:
                self._count.pop(key, None)

    def close(self) -> None:
        for journal in self._journals.values():
            journal.follower.close()
