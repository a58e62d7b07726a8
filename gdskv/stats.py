"""Counters the tier keeps (thread-safe) and the derived rates it reports."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from .yielding_lock import YieldingLock


class TierStats:
    def __init__(self) -> None:
        self._lock = YieldingLock()
        self._counts: Counter = Counter()
        #: also told every ``add`` (the tier's Prometheus counters, :mod:`.metrics`)
        self.listener: Callable[[dict], None] | None = None

    def add(self, **amounts: float) -> None:
        counts = self._counts
        with self._lock:
            for key, value in amounts.items():  # (Counter.update's generic path is slower)
                counts[key] = counts.get(key, 0) + value
        if self.listener is not None:
            self.listener(amounts)

    def snapshot(self) -> dict:
        with self._lock:
            c = dict(self._counts)
        for direction in ("write", "read"):
            secs = c.get(f"{direction}_seconds", 0.0)
            nbytes = c.get(f"bytes_{'written' if direction == 'write' else 'read'}", 0)
            c[f"{direction}_gbps"] = nbytes / secs / 1e9 if secs else 0.0
        return c
