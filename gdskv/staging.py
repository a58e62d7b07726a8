"""The tier's staging buffer: ``depth`` equal parts that concurrent data calls share, each of
which splits into small parts for calls of a few pages.

A call takes a part for each chunk of pages it moves and gives it back as soon as the part is
free again: a spill when its write has completed (the backend's done-callback), a restore once
the scatter out of the part is *enqueued*, with a CUDA event the next user waits for before
anything writes into the part. So reads of the next chunks never wait for the GPU, and calls
from several threads (``iodepth`` > 1, a spill beside a restore) keep all parts busy.

Small calls. A call of one page needs one slot, not a part of ``staging_size / depth`` (64 MiB
by default): were it to take a whole part, no more than ``depth`` calls could be in flight,
whatever the number of threads calling. So a call of at most :attr:`StagingParts.small_pages`
pages takes a *small part*: a free part is split into ``SPLITS`` small parts when a small call
finds none free, and joins again once all of them are back. A call that needs a whole part
and finds none free stops the splitting of further parts until it has one (no starving it).
"""

from __future__ import annotations

import collections
import threading

import torch

from .config import ConfigError
from .layout import ALIGNMENT
from .memory import alloc_host, available_host_memory


#: how far a staging part may exceed its share of ``staging_size`` to hold whole pages
PART_SLACK = 1 / 16
#: small parts one part splits into (fewer where a part holds fewer slots)
SPLITS = 16


def staging_part_pages(part_budget: int, layout) -> int:
    """Pages one staging part holds, given its share of ``staging_size``.

    A slot is its page plus a trailer (up to 4 KiB after alignment), so a budget that is a
    round number of pages (64 MiB = 32 pages of 2 MiB) would hold one slot fewer (31): a
    128-page call would then need a fifth chunk, read only after the first one drains. A part
    holds as many pages as the budget holds of page payload, as long as that overshoots the
    budget by at most ``PART_SLACK``; otherwise as many whole slots as fit.
    """
    by_slot = part_budget // layout.slot_bytes
    by_payload = part_budget // layout.page_bytes
    if by_payload * layout.slot_bytes <= part_budget * (1 + PART_SLACK):
        return by_payload
    return by_slot


class StagingParts:
    """Parts ``0 .. depth-1`` (whole parts) and ``depth ..`` (small parts, ``SPLITS`` per
    whole part, each ``small_pages`` slots): a part is named by its index.

    Args:
        part_bytes: bytes of one whole part.
        depth: whole parts.
        device: where the buffer lives (CUDA, or pinned host memory).
        slot_bytes: one page slot (a small part is whole slots); None: parts never split.
    """

    @staticmethod
    def check_fits(nbytes: int, device: torch.device, option: str = "staging_size") -> None:
        """Refuse (ConfigError naming ``option``, the setting that sized it) a staging buffer
        larger than the memory free on ``device`` now."""
        if device.type == "cuda":
            free, where = torch.cuda.mem_get_info(device)[0], f"free on {device}"
        else:
            free, where = available_host_memory(), "of host memory available"
        if nbytes > free:
            raise ConfigError(f"{option}: a staging buffer of {nbytes} B does not fit "
                              f"({free} B {where}); lower {option} "
                              f"(GDSKV_{option.upper()}) below {free} B")

    def __init__(self, part_bytes: int, depth: int, device: torch.device,
                 slot_bytes: int | None = None) -> None:
        try:
            if device.type == "cpu":
                raw = alloc_host(depth * part_bytes)
                self.parts = [raw[i * part_bytes:(i + 1) * part_bytes] for i in range(depth)]
            else:
                # zeroed once: the gather writes payloads and trailers only, so a slot's
                # padding is written as found here (never an earlier allocation's bytes)
                raw = torch.zeros(depth * part_bytes + ALIGNMENT, dtype=torch.uint8,
                                  device=device)
                skew = (-raw.data_ptr()) % ALIGNMENT
                self.parts = [raw[skew + i * part_bytes:skew + (i + 1) * part_bytes]
                              for i in range(depth)]
        except (MemoryError, OSError, RuntimeError) as exc:  # RuntimeError: torch's OOM
            raise ConfigError(f"staging_size: cannot allocate a staging buffer of "
                              f"{depth * part_bytes} B on {device} ({exc}); lower staging_size "
                              "(GDSKV_STAGING_SIZE)") from exc
        slots = part_bytes // slot_bytes if slot_bytes else 1
        #: small parts per whole part (1: parts never split)
        self.splits = max(1, min(SPLITS, slots))
        #: pages a small part holds (a call of at most this many takes one); 0: none
        self.small_pages = slots // self.splits if self.splits > 1 else 0
        small_bytes = self.small_pages * (slot_bytes or 0)
        self._views = list(self.parts) + [
            part[j * small_bytes:(j + 1) * small_bytes]
            for part in self.parts for j in range(self.splits if self.splits > 1 else 0)]
        self._depth = depth
        self._cond = threading.Condition()
        self._whole_free = collections.deque(range(depth))
        self._small_free: list[int] = []  # of split parts (last given back, first taken)
        self._small_out = [0] * depth  # small parts of each split part in use
        self._split = [False] * depth
        self._whole_waiting = 0  # takers of whole parts waiting: no new splits meanwhile
        # One event per part, recorded when a part is given back with GPU work still reading
        # it and waited for by the next user of that memory: reused, not made per chunk (each
        # new event costs host time to create, record and destroy). Only the part's holder
        # records its event.
        self._events: list = [None] * len(self._views)
        self._pending = [False] * len(self._views)

    def __len__(self) -> int:
        """Whole parts."""
        return self._depth

    def __getitem__(self, i: int) -> torch.Tensor:
        return self._views[i]

    def all_free(self) -> bool:
        """Whether no part is taken (every call has given its parts back)."""
        with self._cond:
            return len(self._whole_free) == self._depth

    def fits_small(self, pages: int) -> bool:
        return pages <= self.small_pages

    def try_take(self, pages: int | None = None) -> int | None:
        """A free part's index, or None when none is free. ``pages``: what the caller moves
        in it; a call of at most :attr:`small_pages` pages gets a small part."""
        with self._cond:
            i = self._take_locked(pages is not None and pages <= self.small_pages)
        return None if i is None else self._ready(i)

    def take(self, pages: int | None = None) -> int:
        """A free part's index (see :meth:`try_take`), waiting for one."""
        small = pages is not None and pages <= self.small_pages
        with self._cond:
            i = self._take_locked(small)
            if i is None:
                if not small:
                    self._whole_waiting += 1
                try:
                    while i is None:
                        self._cond.wait()
                        i = self._take_locked(small)
                finally:
                    if not small:
                        self._whole_waiting -= 1
        return self._ready(i)

    def _take_locked(self, small: bool) -> int | None:
        if not small:
            return self._whole_free.popleft() if self._whole_free else None
        if self._small_free and not self._whole_waiting:
            i = self._small_free.pop()
        elif self._whole_free and not self._whole_waiting:  # split a free part
            whole = self._whole_free.popleft()
            self._split[whole] = True
            first = self._depth + whole * self.splits
            self._small_free.extend(range(first + self.splits - 1, first - 1, -1))
            i = self._small_free.pop()
        else:
            return None
        self._small_out[(i - self._depth) // self.splits] += 1
        return i

    def give_back(self, i: int, reading: torch.cuda.Stream | None = None) -> None:
        """Free part ``i``; ``reading``: a stream whose work queued so far still reads it (the
        next user of its memory waits for that work)."""
        if reading is not None:
            ev = self._events[i]
            if ev is None:
                ev = self._events[i] = torch.cuda.Event()
            ev.record(reading)
        with self._cond:
            self._pending[i] = reading is not None
            if i < self._depth:
                self._whole_free.append(i)
            else:
                whole = (i - self._depth) // self.splits
                self._small_free.append(i)
                self._small_out[whole] -= 1
                if not self._small_out[whole]:  # all back: the part joins again
                    first = self._depth + whole * self.splits
                    self._small_free = [s for s in self._small_free
                                        if not first <= s < first + self.splits]
                    self._split[whole] = False
                    self._whole_free.append(whole)
            self._cond.notify_all()

    def _ready(self, i: int) -> int:
        """Wait for the GPU work that still reads the memory of part ``i`` (its own event, and
        that of the whole part it is in or of the small parts in it)."""
        if i < self._depth:
            first = self._depth + i * self.splits
            overlapping = [i, *range(first, first + self.splits)] if self.splits > 1 else [i]
        else:
            overlapping = [i, (i - self._depth) // self.splits]
        with self._cond:
            waits = [p for p in overlapping if self._pending[p]]
            # a flag is cleared only by the part's own taker, and a whole part's taker holds
            # its small parts too: a small part's taker leaves the whole part's flag set, for
            # its siblings' takers (waiting again on an event that has completed is cheap)
            for p in (overlapping if i < self._depth else (i,)):
                self._pending[p] = False
        for p in waits:  # the scatter out of it: host threads may write the part next
            self._events[p].synchronize()
        return i
