"""Admission: which offered pages a put writes (``admit_after``).

With ``admit_after = n`` a page is written only on its n-th offer (Dynamo KVBM's "seen twice"
filter for n = 2): one-off prefixes never cost SSD writes. A page already stored is always
admitted (the put is a no-op success for it). Offers are counted per key in a bounded LRU
table, so a flood of one-off keys cannot grow it without limit.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Sequence

from .yielding_lock import YieldingLock


class AdmissionFilter:
    """``stored(key)``: whether the key is stored already; ``max_tracked``: how many keys' offer
    counts are remembered (the oldest are forgotten first)."""

    def __init__(self, admit_after: int, stored: Callable[[Hashable], bool],
                 max_tracked: int) -> None:
        self.admit_after = admit_after
        self._stored = stored
        self._max_tracked = max_tracked
        self._offers: collections.OrderedDict = collections.OrderedDict()
        self._lock = YieldingLock()  # puts from several threads

    def admit(self, keys: Sequence[Hashable]) -> list[int]:
        """Indices of ``keys`` to write now (all of them when ``admit_after`` is 1)."""
        need = self.admit_after
        if need <= 1:
            return list(range(len(keys)))
        out = []
        with self._lock:
            for i, key in enumerate(keys):
                if self._stored(key):
                    out.append(i)
                    continue
                count = self._offers.pop(key, 0) + 1
                if count >= need:
                    out.append(i)
                else:
                    self._offers[key] = count
                    if len(self._offers) > self._max_tracked:
                        self._offers.popitem(last=False)
        return out
