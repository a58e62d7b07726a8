"""Which offloaded blocks are on disk, as the vLLM scheduler sees it: followed from the stores'
journals, never from a second bookkeeping of its own.

vLLM's scheduler (where the offloading manager lives) and its workers (where the tiers write)
may be different processes. The workers' tiers own the truth: a page is READY once its COMMIT is
in the store's journal, and evictions, failed writes and pages dropped for a bad checksum are in
the same journal (or never reached it). So the manager reads the journals read-only, as a
follower tier does (:class:`~gdskv.journal.JournalFollower`: one ``stat`` when nothing changed),
and a block counts as stored once the store of *every* worker rank holds it: a load needs every
rank's share of the block. A restart needs nothing more: the journals are already there.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Sequence

from ...journal import JournalFollower, RecordKind, live_records
from ...store import JOURNAL


class KeyIndex:
    """Keys held by all of ``store_dirs`` (one store per worker rank), from their journals.

    :meth:`refresh` reads what the writers appended since the last call and returns the keys
    that became complete (in every store) and those that stopped being complete.
    """

    def __init__(self, store_dirs: Sequence[str]) -> None:
        self._followers = [JournalFollower(os.path.join(d, JOURNAL)) for d in store_dirs]
        self._live: list[dict[Hashable, int]] = [{} for _ in store_dirs]  # key -> slot
        self._count: dict[Hashable, int] = {}
        self.num_stores = len(store_dirs)

    def __contains__(self, key: Hashable) -> bool:
        return self._count.get(key, 0) == self.num_stores

    def __len__(self) -> int:
        return sum(c == self.num_stores for c in self._count.values())

    def refresh(self) -> tuple[list, list]:
        """(keys now complete, keys no longer complete) since the last call. A journal that
        cannot be read leaves that store's keys as they were (a later load that finds a page
        gone is a miss the connector turns into a recompute)."""
        was: dict[Hashable, bool] = {}  # completeness of each key touched, before this call
        for i, follower in enumerate(self._followers):
            try:
                reset, records = follower.poll()
            except OSError:
                continue
            live = self._live[i]
            if reset:
                now = {k: r.slot for k, r in live_records(records).items()}
                for key in live.keys() - now.keys():
                    self._count_change(key, -1, was)
                for key in now.keys() - live.keys():
                    self._count_change(key, +1, was)
                self._live[i] = now
                continue
            for rec in records:
                if rec.kind is RecordKind.COMMIT:
                    if rec.key not in live:
                        self._count_change(rec.key, +1, was)
                    live[rec.key] = rec.slot
                elif live.get(rec.key) == rec.slot:  # an EVICT of the page we know
                    del live[rec.key]
                    self._count_change(rec.key, -1, was)
        added = [k for k, before in was.items() if not before and k in self]
        removed = [k for k, before in was.items() if before and k not in self]
        return added, removed

    def _count_change(self, key: Hashable, delta: int, was: dict) -> None:
        was.setdefault(key, key in self)
        count = self._count.get(key, 0) + delta
        if count > 0:
            self._count[key] = count
        else:
            self._count.pop(key, None)

    def close(self) -> None:
        for follower in self._followers:
            follower.close()
