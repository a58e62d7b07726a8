"""Page payload checksums: computed when a page is written, verified on every read.

Algorithm 1 (``XXH3``): xxh3_64 of the page payload (``page_bytes``, padding excluded), from the
``xxhash`` package; used for host staging buffers. Algorithm 2 (``GPU_PAGE``): the page hash of
``gdskv.kernels.checksum`` (a position-keyed sum of SplitMix64-mixed 32-bit words), computed by a
Triton kernel where staging is on the GPU (no host copy, ~2.7 TB/s on an H200) and by its torch
reference elsewhere. A tier uses ``GPU_PAGE`` when it stages on CUDA, ``XXH3`` otherwise
(:func:`default_for`).

The algorithm id is journaled with every commit and kept per page in the directory, and a page
is always verified with the algorithm that made its checksum (:func:`checksummer`), whatever
the tier writes with now. A page whose algorithm this process does not have (not registered)
is dropped at recovery: it cannot be verified, so it is a miss, never unchecked bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch
import xxhash

from .layout import PageLayout
from .memory import host_numpy

XXH3 = 1
GPU_PAGE = 2


class PageChecksummer:
    """Checksums of the pages in a staging buffer."""

    algorithm = XXH3

    def __init__(self, layout: PageLayout) -> None:
        self.page_bytes = layout.page_bytes
        self.slot_bytes = layout.slot_bytes
        self._local = threading.local()  # a host copy buffer per thread: calls run concurrently

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
        host = getattr(self._local, "host", None)
        if host is None or host.numel() < n:
            host = self._local.host = torch.empty(staging.numel(), dtype=torch.uint8,
                                                  pin_memory=True)
        host[:n].copy_(staging[:n])
        return host


class GpuPageChecksummer:
    """Algorithm 2: the kernels' page hash, computed where the staging buffer lives."""

    algorithm = GPU_PAGE

    def __init__(self, layout: PageLayout) -> None:
        self.page_bytes = layout.page_bytes
        self.slot_bytes = layout.slot_bytes

    def compute(self, staging: torch.Tensor, num_pages: int) -> np.ndarray:
        # The sums are needed on the host (slot trailers, journal, comparison): read the
        # partial sums back and finish them here, one kernel launch fewer than on the GPU.
        from . import kernels  # lazy: keeps triton out of `import gdskv`
        partial = kernels.page_partial_sums(staging, num_pages, self.page_bytes, self.slot_bytes)
        return kernels.checksum.finalize_partials_host(partial.cpu().numpy(), self.page_bytes)


_FACTORIES: dict[int, Callable[[PageLayout], object]] = {XXH3: PageChecksummer,
                                                       GPU_PAGE: GpuPageChecksummer}


def default_for(device: torch.device, layout: PageLayout):
    """The checksummer a tier staging on ``device`` writes with."""
    return checksummer(GPU_PAGE if device.type == "cuda" else XXH3, layout)


def register(algorithm: int, factory: Callable[[PageLayout], object]) -> None:
    """Make ``algorithm`` verifiable: ``factory(layout)`` returns an object with the
    :class:`PageChecksummer` interface (``algorithm``, ``compute(staging, num_pages)``)."""
    if not 0 < algorithm < 256:
        raise ValueError(f"checksum algorithm id must be in 1..255 (journaled as a byte), "
                         f"got {algorithm}")
    _FACTORIES[algorithm] = factory


def known(algorithm: int) -> bool:
    """Whether pages checksummed with ``algorithm`` can be verified in this process."""
    return algorithm in _FACTORIES


def checksummer(algorithm: int, layout: PageLayout):
    """A checksummer for ``algorithm`` (ValueError if it is not registered)."""
    try:
        factory = _FACTORIES[algorithm]
    except KeyError:
        raise ValueError(f"unknown page checksum algorithm {algorithm}; known: "
                         f"{sorted(_FACTORIES)}") from None
    return factory(layout)
