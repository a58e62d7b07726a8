"""The page directory: which key lives in which slot, in what state. Metadata only, no I/O.

Per-slot state is kept in numpy arrays (state, pin count, last use, checksum and the id of the
checksum algorithm that made it) and a list of
keys by slot, plus one dict key -> slot: about 70-80 bytes per page beside the key itself
(measured in tests/test_directory.py), where an object per page would cost several hundred.

States: ``WRITING`` (slot reserved, data in flight) -> ``READY`` (durable, committed) ->
``EVICTING`` (asked to go while pinned by a reader; freed at the last unpin). LRU eviction
takes unpinned READY pages with the oldest ``last_use``.

Eviction keeps a queue of candidates, the oldest READY pages in ``last_use`` order,
found by one scan of the arrays for a batch of evictions (about 1/256 of the slots). Choosing by
a scan per call cost every put into a full store a pass over all slots: 0.18 ms at 32k slots and
7.4 ms at 1M on the development machine; now a batch of evictions shares one scan
(``tests/test_directory.py`` checks both the count of scans and that the pages evicted are the
ones a scan per call picks). A candidate is taken only if it is still READY, unpinned
and untouched since the scan (its ``last_use`` unchanged); one used since is dropped, as it is
no longer among the oldest, and one pinned now (or being put again by the same call) stays at
the front. Every READY page the scan left out was newer than the queue's newest, and a page
that became READY since was touched then, so the pages taken are the ones a scan per call
takes.
"""

from __future__ import annotations

import collections
import enum
import heapq
import operator
import threading
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from .config import ConfigError
from .memory import available_host_memory
from .yielding_lock import YieldingLock


class PageState(enum.IntEnum):
    FREE = 0
    WRITING = 1
    READY = 2
    EVICTING = 3


# Plain ints for the per-page hot paths: on Python 3.11 every ``PageState.X`` lookup goes
# through the enum metaclass, which cost more than the rest of pin/commit together.
_FREE, _WRITING, _READY, _EVICTING = (int(s) for s in PageState)
#: up to this many slots a batch step takes numpy's scalar steps, beyond it one fancy index
_FEW_SLOTS = 8


@dataclass(frozen=True)
class Reservation:
    """Outcome of :meth:`PageDirectory.reserve` for one batch of keys."""
    #: per key: a fresh slot to write, or None (already present, or no room)
    slots: list[int | None]
    #: per key: the state it was found in (FREE: not in the directory; then it got a slot,
    #: or there was no room). READY: stored already; WRITING: another call is writing it
    #: (:meth:`PageDirectory.wait_written` waits for that write); EVICTING: on its way out
    found: list[int]
    #: (key, slot) pairs evicted to make room; the caller journals them
    evicted: list[tuple[Hashable, int]]

    @property
    def present(self) -> list[bool]:
        """Per key: whether it was in the directory already (nothing was reserved for it)."""
        return [f != _FREE for f in self.found]


#: calls on this many keys or more look their pages up with array operations (a long prompt's
#: restore pins thousands: a Python step a page was milliseconds before its first read; pin +
#: unpin of 2,048 pages took 1.6 ms on the development machine, 0.42 ms with arrays); fewer
#: keys take a loop, cheaper below that (1.9 µs against 16 µs for one page)
ARRAYS_FROM = 32


class PageDirectory:
    """Thread-safe map of page keys to slots with LRU eviction and pinning."""

    #: host memory per slot when the store is full (arrays, key list, free list, index entry;
    #: keys themselves not counted): the upper end of what tests/test_directory.py measures
    BYTES_PER_SLOT = 80

    @classmethod
    def check_memory(cls, num_slots: int, capacity: int, slot_bytes: int) -> None:
        """Refuse (ConfigError naming the capacity) a directory of ``num_slots`` that would not
        fit in the host memory available now."""
        need = num_slots * cls.BYTES_PER_SLOT
        free = available_host_memory()
        if need > free:
            raise ConfigError(f"capacity {capacity} B is {num_slots} slots of {slot_bytes} B; "
                              f"their page directory needs about {need} B of host memory "
                              f"({cls.BYTES_PER_SLOT} B per slot) and {free} B is available: "
                              "lower capacity (GDSKV_CAPACITY) or use larger pages")

    def __init__(self, num_slots: int, *, evict: bool = True, follower: bool = False) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.evict_enabled = evict and not follower
        #: a read-only follower's directory: filled by place()/drop() from another process's
        #: journal, never reserves, so it keeps no free list (place() stays O(1))
        self.follower = follower
        self._lock = YieldingLock()
        #: notified when WRITING slots are committed or given back, while a put waits for
        #: another call's write of the same key (:meth:`wait_written`)
        self._written = threading.Condition(self._lock)
        self._waiting = 0
        self._index: dict[Hashable, int] = {}
        self._keys: list[Hashable | None] = [None] * num_slots
        self._state = np.zeros(num_slots, dtype=np.uint8)
        self._pins = np.zeros(num_slots, dtype=np.uint16)
        self._last_use = np.zeros(num_slots, dtype=np.uint64)
        self._checksum = np.zeros(num_slots, dtype=np.uint64)
        self._algorithm = np.zeros(num_slots, dtype=np.uint8)
        self._clock = 0
        # a heap: lowest slot first keeps batches contiguous (a follower keeps none)
        self._free = [] if follower else list(range(num_slots))
        self._ready = 0
        # eviction candidates, oldest first: (slot, its last_use when the scan found it)
        self._candidates: collections.deque[tuple[int, int]] = collections.deque()
        self._scan_batch = max(64, num_slots >> 8)

    # -- queries ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._ready

    def state(self, key: Hashable) -> PageState:
        with self._lock:
            slot = self._index.get(key)
            return PageState.FREE if slot is None else PageState(int(self._state[slot]))

    def contains(self, key: Hashable) -> bool:
        return self.state(key) == _READY

    def match_prefix(self, keys: Iterable[Hashable]) -> int:
        """How many leading keys are READY."""
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        if len(keys) < ARRAYS_FROM:
            n = 0
            with self._lock:
                for key in keys:
                    slot = self._index.get(key)
                    if slot is None or self._state[slot] != _READY:
                        break
                    n += 1
            return n
        with self._lock:
            slots = list(map(self._index.get, keys))
            n = slots.index(None) if None in slots else len(slots)
            if n:
                waiting = np.flatnonzero(self._state[np.array(slots[:n], dtype=np.int64)]
                                         != _READY)
                n = int(waiting[0]) if len(waiting) else n
        return n

    def ready_items(self) -> list[tuple[Hashable, int, int]]:
        """(key, slot, checksum) of every READY page (for snapshots)."""
        with self._lock:
            return [(k, s, int(self._checksum[s])) for k, s in self._index.items()
                    if self._state[s] == _READY]

    def ready_entries(self) -> list[tuple[Hashable, int, int, int]]:
        """(key, slot, checksum, checksum algorithm) of every READY page (for compaction)."""
        with self._lock:
            return [(k, s, int(self._checksum[s]), int(self._algorithm[s]))
                    for k, s in self._index.items() if self._state[s] == _READY]

    def algorithms(self, slots: Sequence[int]) -> np.ndarray:
        """Checksum algorithm id of each (pinned or READY) slot."""
        with self._lock:
            return self._algorithm[np.asarray(slots, dtype=np.int64)]

    def all_use(self, slots: Sequence[int], algorithm: int) -> bool:
        """Whether every one of these (pinned or READY) slots' checksums was made with
        ``algorithm`` (a few slots are looked at one by one: numpy's gather and reduction
        cost a cold host 28 µs of a 1-page restore)."""
        with self._lock:
            return self._all_use_locked(slots, algorithm)

    def _all_use_locked(self, slots: Sequence[int], algorithm: int) -> bool:
        if len(slots) <= _FEW_SLOTS:
            algos = self._algorithm
            return all(algos[s] == algorithm for s in slots)
        return bool((self._algorithm[np.asarray(slots, dtype=np.int64)] == algorithm).all())

    def slot_arrays(self) -> tuple:
        """The lock and the per-slot arrays (state, pins, last use, checksum, algorithm), for
        the native quick reader (``gdskv/native/quick_read.c``), which pins and unpins under
        this lock as :meth:`pin_for_read` and :meth:`unpin` do, and reads ``_index`` and
        ``_clock`` at each call. The arrays are never replaced (:meth:`load` fills them)."""
        return (self._lock, self._state, self._pins, self._last_use, self._checksum,
                self._algorithm)

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    # -- writes -------------------------------------------------------------------------------
    def reserve(self, keys: Sequence[Hashable]) -> Reservation:
        """Reserve a slot (state WRITING) for each key not already present.

        Evicts LRU unpinned READY pages when free slots run out (if eviction is on). Keys that
        find no room get ``None``; nothing is reserved for present keys.
        """
        if self.follower:
            raise RuntimeError("a follower's directory reserves no slots (read-only)")
        with self._lock:
            index, state = self._index, self._state
            found = [_FREE if (s := index.get(k)) is None else int(state[s]) for k in keys]
            need = found.count(_FREE)
            evicted = []
            if need > len(self._free) and self.evict_enabled:
                evicted = self._evict_lru_locked(need - len(self._free), protect=set(keys))
            slots: list[int | None] = []
            for key, was in zip(keys, found):
                if was != _FREE or not self._free:
                    slots.append(None)
                    continue
                slot = heapq.heappop(self._free)
                self._index[key] = slot
                self._keys[slot] = key
                self._state[slot] = _WRITING
                self._pins[slot] = 0
                slots.append(slot)
            return Reservation(slots, found, evicted)

    def wait_written(self, keys: Sequence[Hashable]) -> list[bool]:
        """Wait until none of ``keys`` is WRITING (the calls writing them have committed or
        given back their slots); per key, whether it is READY then. For a put that found its
        key being written by another call: its answer is that write's outcome."""
        with self._written:
            self._waiting += 1
            try:
                while any(self._state_locked(k) == _WRITING for k in keys):
                    self._written.wait()
            finally:
                self._waiting -= 1
            return [self._state_locked(k) == _READY for k in keys]

    def _state_locked(self, key: Hashable) -> int:
        slot = self._index.get(key)
        return _FREE if slot is None else int(self._state[slot])

    def commit(self, slots: Sequence[int], checksums: Sequence[int], algorithm: int = 1) -> None:
        """WRITING -> READY once the data is durable and journaled (checksums made with
        ``algorithm``, see gdskv.checksum)."""
        n = len(slots)
        with self._lock:
            if n <= _FEW_SLOTS:  # a few: numpy's scalar steps cost less than its fancy indexing
                for slot, csum in zip(slots, checksums):
                    assert self._state[slot] == _WRITING, f"commit of slot {slot} not WRITING"
                    self._state[slot] = _READY
                    self._checksum[slot] = csum
                    self._algorithm[slot] = algorithm
                    self._touch_locked(slot)
                    self._ready += 1
                if self._waiting:
                    self._written.notify_all()
                return
            idx = np.asarray(slots, dtype=np.int64)
            assert (self._state[idx] == _WRITING).all(), \
                f"commit of slots not WRITING: {idx[self._state[idx] != _WRITING].tolist()}"
            self._state[idx] = _READY
            self._checksum[idx] = checksums
            self._algorithm[idx] = algorithm
            # the order a loop of touches would give them (LRU: the last is the newest)
            self._last_use[idx] = np.arange(self._clock + 1, self._clock + 1 + n, dtype=np.uint64)
            self._clock += n
            self._ready += n
            if self._waiting:
                self._written.notify_all()

    def abort(self, slots: Iterable[int]) -> None:
        """Give back WRITING slots whose write failed."""
        with self._lock:
            for slot in slots:
                assert self._state[slot] == _WRITING, f"abort of slot {slot} not WRITING"
                self._free_locked(slot)
            if self._waiting:
                self._written.notify_all()

    def load(self, keys: Sequence[Hashable], slots: Sequence[int], checksums: Sequence[int],
             algorithms: Sequence[int] | None = None) -> None:
        """Install READY pages recovered from the journal into an empty directory, given as
        columns (key, slot, checksum, checksum algorithm id) in LRU order, oldest first."""
        # Vectorised: a restart loads 100k+ pages and is budgeted in seconds.
        n = len(keys)
        slots = np.asarray(slots, dtype=np.int64).reshape(n)
        sums = np.asarray(checksums, dtype=np.uint64).reshape(n)
        algos = np.ones(n, dtype=np.uint8) if algorithms is None else \
            np.asarray(algorithms, dtype=np.uint8).reshape(n)
        with self._lock:
            if self._index:
                raise RuntimeError("load() needs an empty directory")
            if n and (slots.min() < 0 or slots.max() >= self.num_slots):
                bad = int(np.flatnonzero((slots < 0) | (slots >= self.num_slots))[0])
                raise ValueError(f"bad recovered entry: key {keys[bad]!r} slot {slots[bad]}")
            taken = np.zeros(self.num_slots, dtype=bool)
            taken[slots] = True
            index = dict(zip(keys, slots.tolist()))
            if len(index) != n or int(np.count_nonzero(taken)) != n:
                raise ValueError("bad recovered entries: a key or slot appears twice")
            self._index = index
            for key, slot in index.items():
                self._keys[slot] = key
            self._state[slots] = _READY
            self._checksum[slots] = sums
            self._algorithm[slots] = algos
            self._last_use[slots] = np.arange(self._clock + 1, self._clock + 1 + n, dtype=np.uint64)
            self._clock += n
            self._ready = n
            self._free = [] if self.follower else np.flatnonzero(~taken).tolist()  # a heap
            self._candidates.clear()

    def place(self, key: Hashable, slot: int, checksum: int, algorithm: int) -> bool:
        """Make ``key`` READY in ``slot`` as another process's journal says (read-only
        followers), replacing whatever this directory had for the key or in the slot. False
        (nothing changed) when the slot's current page is pinned by a reader."""
        if not 0 <= slot < self.num_slots:
            return False
        with self._lock:
            old = self._index.get(key)
            if self._pins[slot] or (old is not None and old != slot and self._pins[old]):
                return False
            if old is not None and old != slot:
                self._free_locked(old)
            if self._state[slot] != _FREE:
                self._free_locked(slot)
            if not self.follower:
                self._free.remove(slot)
                heapq.heapify(self._free)
            self._index[key] = slot
            self._keys[slot] = key
            self._state[slot] = _READY
            self._checksum[slot] = checksum
            self._algorithm[slot] = algorithm
            self._touch_locked(slot)
            self._ready += 1
            return True

    def drop(self, key: Hashable, slot: int) -> bool:
        """Forget ``key`` if it is READY in ``slot`` and unpinned (a follower applying the
        writer's EVICT record); True if it went."""
        with self._lock:
            if self._index.get(key) != slot or self._state[slot] != _READY or self._pins[slot]:
                return False
            self._free_locked(slot)
            return True

    # -- reads --------------------------------------------------------------------------------
    def pin(self, keys: Sequence[Hashable]) -> list[tuple[int, int] | None]:
        """Pin READY pages for reading: per key (slot, checksum), or None for a miss."""
        if len(keys) < ARRAYS_FROM:
            return self._pin_each(keys)
        return self._pin_arrays(keys)

    def _pin_each(self, keys: Sequence[Hashable]) -> list[tuple[int, int] | None]:
        with self._lock:
            return self._pin_each_locked(keys)

    def _pin_each_locked(self, keys: Sequence[Hashable]) -> list[tuple[int, int] | None]:
        out: list[tuple[int, int] | None] = []
        for key in keys:
            slot = self._index.get(key)
            if slot is None or self._state[slot] != _READY:
                out.append(None)
                continue
            self._pins[slot] += 1
            self._touch_locked(slot)
            out.append((slot, int(self._checksum[slot])))
        return out

    def _pin_arrays(self, keys: Sequence[Hashable]) -> list[tuple[int, int] | None]:
        with self._lock:
            where, found = self._find_ready_locked(keys)
            self._add_pins_locked(found, distinct=False)
            pinned = list(zip(found.tolist(), self._checksum[found].tolist()))
        if where is None:
            return pinned
        out: list[tuple[int, int] | None] = [None] * len(keys)
        for i, p in zip(where, pinned):
            out[i] = p
        return out

    def pin_for_read(self, keys: Sequence[Hashable], first: int = 0, *,
                     algorithm: int | None = None):
        """Pin READY pages for reading, as a read wants them: ``(position, slot, checksum)`` of
        each hit, in slot order (adjacent slots coalesce into one I/O). Positions count from
        ``first``: ``keys`` may be a part of a longer call's keys. With ``algorithm``: that
        list and whether every hit's checksum was made with it (:meth:`all_use`, under the
        same hold of the lock: a 1-page restore's host time)."""
        if len(keys) < ARRAYS_FROM:
            with self._lock:
                todo = [(first + i, p[0], p[1]) for i, p in
                        enumerate(self._pin_each_locked(keys)) if p is not None]
                same = None if algorithm is None else \
                    self._all_use_locked([t[1] for t in todo], algorithm)
            if len(todo) > 1:
                todo.sort(key=operator.itemgetter(1))
            return todo if algorithm is None else (todo, same)
        if algorithm is not None:
            todo = self.pin_for_read(keys, first)
            return todo, self.all_use([t[1] for t in todo], algorithm)
        with self._lock:
            where, found = self._find_ready_locked(keys)
            order = np.argsort(found, kind="stable")  # (a prefix spilled in order: sorted)
            by_slot = found[order]
            self._add_pins_locked(found, distinct=not (by_slot[1:] == by_slot[:-1]).any())
            sums = self._checksum[by_slot]
        positions = (np.arange(first, first + len(keys)) if where is None
                     else np.asarray(where, dtype=np.int64) + first)[order]
        return list(zip(positions.tolist(), by_slot.tolist(), sums.tolist()))

    def _find_ready_locked(self, keys: Sequence[Hashable]) -> tuple[list | None, np.ndarray]:
        """The READY pages among ``keys``: the positions of those found (None: all are) and
        their slots."""
        slots = list(map(self._index.get, keys))
        where = None if None not in slots else [i for i, s in enumerate(slots)
                                                if s is not None]
        found = np.array(slots if where is None else [slots[i] for i in where],
                         dtype=np.int64)
        ready = self._state[found] == _READY
        if not ready.all():
            where = [i for i, ok in zip(range(len(slots)) if where is None else where,
                                        ready.tolist()) if ok]
            found = found[ready]
        return where, found

    def _add_pins_locked(self, found: np.ndarray, *, distinct: bool) -> None:
        """One more pin on each of ``found``'s slots, used now (in that order). ``distinct``:
        no slot is there twice, so a plain add (``np.add.at``, which counts repeats, costs
        several times more)."""
        if distinct:
            self._pins[found] += 1
        else:
            np.add.at(self._pins, found, 1)
        n = len(found)
        self._last_use[found] = np.arange(self._clock + 1, self._clock + 1 + n, dtype=np.uint64)
        self._clock += n

    def unpin(self, slots: Iterable[int]) -> list[tuple[Hashable, int]]:
        """Drop one pin per slot; returns pages freed because they were EVICTING."""
        slots = slots if isinstance(slots, (list, tuple)) else list(slots)
        if len(slots) < ARRAYS_FROM:
            return self._unpin_each(slots)
        return self._unpin_arrays(slots)

    def _unpin_each(self, slots: Sequence[int]) -> list[tuple[Hashable, int]]:
        freed = []
        with self._lock:
            for slot in slots:
                if self._pins[slot] == 0:
                    raise AssertionError(f"unpin of unpinned slot {slot}")
                self._pins[slot] -= 1
                if self._pins[slot] == 0 and self._state[slot] == _EVICTING:
                    freed.append((self._keys[slot], slot))
                    self._free_locked(slot)
        return freed

    def _unpin_arrays(self, slots: Sequence[int]) -> list[tuple[Hashable, int]]:
        freed = []
        held, counts = np.unique(np.fromiter(slots, dtype=np.int64), return_counts=True)
        with self._lock:
            short = self._pins[held] < counts
            if short.any():
                raise AssertionError(f"unpin of unpinned slot {held[short][0]}")
            self._pins[held] -= counts.astype(self._pins.dtype)
            gone = held[(self._pins[held] == 0) & (self._state[held] == _EVICTING)]
            for slot in gone.tolist():
                freed.append((self._keys[slot], slot))
                self._free_locked(slot)
        return freed

    # -- eviction -----------------------------------------------------------------------------
    def remove(self, keys: Iterable[Hashable],
               slots: Iterable[int] | None = None) -> list[tuple[Hashable, int]]:
        """Evict the given READY keys now; pinned ones become EVICTING and go at last unpin.
        ``slots``: only where each key is still in that slot (a page found unreadable there,
        not a newer copy of it put since).

        Returns the (key, slot) pairs freed now. Unknown or WRITING keys are ignored.
        """
        freed = []
        with self._lock:
            for key, where in zip(keys, slots) if slots is not None else \
                    ((k, None) for k in keys):
                slot = self._index.get(key)
                if slot is None or self._state[slot] != _READY or where not in (None, slot):
                    continue
                self._ready -= 1
                if self._pins[slot]:
                    self._state[slot] = _EVICTING
                else:
                    freed.append((key, slot))
                    self._free_locked(slot, was_ready=False)
        return freed

    def _evict_lru_locked(self, count: int, protect: set) -> list[tuple[Hashable, int]]:
        """Free the ``count`` least recently used unpinned READY pages whose keys are not in
        ``protect`` (fewer if there are not as many)."""
        evicted: list[tuple[Hashable, int]] = []
        if count <= 0:
            return evicted
        queue, state, pins, last_use, keys = (self._candidates, self._state, self._pins,
                                              self._last_use, self._keys)
        kept = []  # pinned or protected: still among the oldest, back to the front after
        scans, covered = 0, False
        while len(evicted) < count:
            if not queue:
                if covered:  # the last scan saw every READY page
                    break
                # (a second scan in one call looks further: the first one's were held)
                covered = self._scan_candidates_locked(
                    (count - len(evicted) + len(kept)) << scans)
                scans += 1
                if kept:  # the scan finds them again: they go back once, after
                    held = set(kept)
                    fresh = [c for c in queue if c not in held]
                    queue.clear()
                    queue.extend(fresh)
                continue
            slot, stamp = queue.popleft()
            if state[slot] != _READY or last_use[slot] != stamp:
                continue  # freed, or used since the scan: not among the oldest now
            key = keys[slot]
            if pins[slot] or key in protect:
                kept.append((slot, stamp))
                continue
            evicted.append((key, slot))
            self._free_locked(slot)
        queue.extendleft(reversed(kept))
        return evicted

    def _scan_candidates_locked(self, need: int) -> bool:
        """Fill the candidate queue with the oldest READY pages, pinned ones included (a page
        pinned now may be the oldest once unpinned): ``need`` of them, or a batch (about 1/256
        of the slots) when that is more, so one pass over the arrays serves many evictions.
        True when that is every READY page."""
        slots = np.flatnonzero(self._state == _READY)
        take = min(slots.size, max(need, self._scan_batch))
        covered = take == slots.size
        if not covered:
            slots = slots[np.argpartition(self._last_use[slots], take - 1)[:take]]
        stamps = self._last_use[slots]
        order = np.argsort(stamps, kind="stable")
        self._candidates.clear()
        self._candidates.extend(zip(slots[order].tolist(), stamps[order].tolist()))
        return covered

    # -- internals ----------------------------------------------------------------------------
    def _touch_locked(self, slot: int) -> None:
        self._clock += 1
        self._last_use[slot] = self._clock

    def _free_locked(self, slot: int, was_ready: bool | None = None) -> None:
        if was_ready is None:
            was_ready = self._state[slot] == _READY
        if was_ready:
            self._ready -= 1
        key = self._keys[slot]
        del self._index[key]
        self._keys[slot] = None
        self._state[slot] = _FREE
        self._pins[slot] = 0
        self._checksum[slot] = 0
        self._algorithm[slot] = 0
        if not self.follower:
            heapq.heappush(self._free, slot)
