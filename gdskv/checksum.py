"""Page payload checksums: computed when a page is written, verified on every read.

Algorithm 3 (``CRC32C``): CRC-32C of the page payload (``page_bytes``, padding excluded), by the
page engine (:mod:`gdskv.native`: hardware CRC-32C with the GIL released, one call for all the
pages of a chunk; or the ``crc32c`` package on the Python path, the same values); what a tier
staging in host memory writes. Algorithm 1 (``XXH3``): xxh3_64 of the payload, from the
``xxhash`` package; what host tiers wrote before CRC-32C, still read. Algorithm 2
(``GPU_PAGE``): the page hash of ``gdskv.kernels.checksum`` (a position-keyed sum of
SplitMix64-mixed 32-bit words), computed by a Triton kernel where staging is on the GPU (no
host copy, ~2.7 TB/s on an H200) and by its torch reference elsewhere. A tier uses
``GPU_PAGE`` when it stages on CUDA, ``CRC32C`` otherwise (:func:`default_for`).

Why CRC-32C for host pages: xxh3 has no implementation a C extension can link (no PyPI
package ships its library) and ``xxhash`` hashes a 64 KiB page holding the GIL; hardware
CRC-32C runs at 28 GB/s a core on the development machine (xxh3: 49;
``bench/results/cpu-2026-11-27/native/``). It is a
32-bit check: a page damaged at random passes it with probability 2**-32 (xxh3_64: 2**-64),
and every burst of up to 32 flipped bits is caught.

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

from . import native
from .layout import PageLayout
from .memory import host_numpy

XXH3 = 1
GPU_PAGE = 2
CRC32C = 3


class PageChecksummer:
    """Checksums of the pages in a staging buffer: xxh3_64 (algorithm 1)."""

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


class Crc32cPageChecksummer(PageChecksummer):
    """Algorithm 3: CRC-32C of each page, all of a chunk's pages in one call of the page
    engine (``engine``: :func:`gdskv.native.engine`'s, by default the native one where it
    loaded)."""

    algorithm = CRC32C

    def __init__(self, layout: PageLayout, engine: native.Engine | None = None) -> None:
        super().__init__(layout)
        self.engine = engine or native.engine()

    def compute(self, staging: torch.Tensor, num_pages: int) -> np.ndarray:
        out = np.empty(num_pages, dtype=np.uint64)
        if num_pages:
            view = host_numpy(self._host_copy(staging, num_pages))
            self.engine.page_sums((view[:num_pages * self.slot_bytes],), self.slot_bytes,
                                  self.page_bytes, out)
        return out


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
                                                       GPU_PAGE: GpuPageChecksummer,
                                                       CRC32C: Crc32cPageChecksummer}


def default_for(device: torch.device, layout: PageLayout,
                engine: native.Engine | None = None):
    """The checksummer a tier staging on ``device`` writes with (host pages: CRC-32C by
    ``engine``)."""
    if device.type == "cuda":
        return checksummer(GPU_PAGE, layout)
    return Crc32cPageChecksummer(layout, engine)


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
