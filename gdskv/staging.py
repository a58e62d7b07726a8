"""The tier's staging buffer: ``depth`` equal parts that concurrent data calls share.

A call takes a part for each chunk of pages it moves and gives it back as soon as the part is
free again: a spill when its write has completed (the backend's done-callback), a restore once
the scatter out of the part is *enqueued*, with a CUDA event the next user waits for before
anything writes into the part. So reads of the next chunks never wait for the GPU, and calls
from several threads (``iodepth`` > 1, a spill beside a restore) keep all parts busy.
"""

from __future__ import annotations

import queue

import torch

from .config import ConfigError
from .layout import ALIGNMENT
from .memory import alloc_host, available_host_memory
from .yielding_lock import YieldingLock


#: how far a staging part may exceed its share of ``staging_size`` to hold whole pages
PART_SLACK = 1 / 16


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

    def __init__(self, part_bytes: int, depth: int, device: torch.device) -> None:
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
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        # One event per part, recorded when a part is given back with GPU work still reading
        # it and waited for by its next user: reused, not made per chunk (each new event costs
        # host time to create, record and destroy). Only the part's holder records its event.
        self._events: list = [None] * depth
        self._pending = [False] * depth
        self._lock = YieldingLock()
        for i in range(depth):
            self._free.put(i)

    def __len__(self) -> int:
        return len(self.parts)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.parts[i]

    def try_take(self) -> int | None:
        """A free part's index, or None when all are in use."""
        try:
            i = self._free.get_nowait()
        except queue.Empty:
            return None
        return self._ready(i)

    def take(self) -> int:
        """A free part's index, waiting for one."""
        return self._ready(self._free.get())

    def give_back(self, i: int, reading: torch.cuda.Stream | None = None) -> None:
        """Free part ``i``; ``reading``: a stream whose work queued so far still reads it (its
        next user waits for that work)."""
        if reading is not None:
            ev = self._events[i]
            if ev is None:
                ev = self._events[i] = torch.cuda.Event()
            ev.record(reading)
        with self._lock:
            self._pending[i] = reading is not None
        self._free.put(i)

    def _ready(self, i: int) -> int:
        with self._lock:
            pending, self._pending[i] = self._pending[i], False
        if pending:  # the scatter out of it: host threads may write the part next
            self._events[i].synchronize()
        return i
