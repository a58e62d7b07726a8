"""Page payload checksums: computed when a page is written, verified on every read.

Algorithm 1 (``XXH3``): xxh3_64 of the page payload (``page_bytes``, padding excluded), from the
``xxhash`` package; used for host staging buffers. The algorithm id is journaled with every
commit; a store reopened with another algorithm treats those pages as misses.
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash

from .layout import KVLayout
from .memory import host_numpy

XXH3 = 1


class PageChecksummer:
    """Checksums of the pages in a staging buffer."""

    algorithm = XXH3

    def __init__(self, layout: KVLayout) -> None:
        self.page_bytes = layout.page_bytes
        self.slot_bytes = layout.slot_bytes
        self._host: torch.Tensor | None = None

    def compute(self, staging: torch.Tensor, num_pages: int) -> np.ndarray:
        """uint64 checksum of each of the first ``num_pages`` pages of ``staging``."""
        view = host_numpy(self._host_copy(staging, num_pages))
        out = np.empty(num_pages, dtype=np.uint64)
        for p in range(num_pages):
            start = p * self.slot_bytes
            out[p] = xxhash.xxh3_64_intdigest(view[start:start + self.page_bytes])
        return out

    def _host_copy(self, staging: torch.Tensor, num_pages: int) -> torch.Tensor:
        if staging.device.type == "cpu":
            return staging
        n = num_pages * self.slot_bytes
        if self._host is None or self._host.numel() < n:
            self._host = torch.empty(staging.numel(), dtype=torch.uint8, pin_memory=True)
        self._host[:n].copy_(staging[:n])
        return self._host
