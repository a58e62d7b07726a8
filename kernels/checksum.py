"""Page checksums: a position-dependent 64-bit hash of each page, computed where the page is.

This is part of the on-disk format (format version 1); changing any step below changes stored
checksums. For one page of ``page_bytes`` bytes:

1. Split the page into ``n = ceil(page_bytes / 4)`` 32-bit words ``w_0 .. w_{n-1}``, each read
   little-endian from bytes ``[4i, 4i + 4)``; a last partial word is zero-padded (bytes past
   ``page_bytes`` -- slot padding -- never count).
2. For every word: ``x_i = (i << 32) | w_i`` (a 64-bit value; pages are < 16 GiB so ``i`` fits),
   ``h_i = fmix(x_i)``.
3. ``S = (h_0 + h_1 + ... + h_{n-1}) mod 2**64``.
4. ``checksum = fmix((S + page_bytes * GOLDEN) mod 2**64)``.

``fmix`` is the SplitMix64 finalizer, a bijection of 64-bit words (all arithmetic mod 2**64,
``>>`` logical)::

    z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31

and ``GOLDEN = 0x9E3779B97F4A7C15``. The result is the uint64 bit pattern, returned in an int64
tensor (values >= 2**63 read as negative).

Why this shape: every word is hashed independently, so the GPU computes it at memory speed
with no sequential dependency (a sum is order-free); ``x_i`` is injective in ``(i, w_i)`` and
``fmix`` is a bijection, so any change confined to one word (e.g. one flipped bit) changes ``S``
by ``fmix(x') - fmix(x) != 0`` and is always detected; swapping two different words or moving
data to another position changes ``S`` unless a 64-bit coincidence happens (probability about
2**-64). The final mix folds in the length and spreads ``S`` over all bits.

:func:`page_checksums_reference` is the pure-torch definition (runs on any device, used on CPU
to verify pages a GPU wrote); :mod:`.triton_checksum` is the Triton kernel, and
:func:`gdskv.kernels.page_checksums` picks between them. Both give identical bits.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["page_checksums_reference", "page_word_sums_reference", "finalize_partials_host",
           "Verdicts", "check_checksum_args", "as_int64", "fmix64_torch",
           "GOLDEN", "FMIX_C1", "FMIX_C2"]

GOLDEN = 0x9E3779B97F4A7C15
FMIX_C1 = 0xBF58476D1CE4E5B9
FMIX_C2 = 0x94D049BB133111EB


def as_int64(v: int) -> int:
    """The int64 with the same bits as uint64 ``v`` (torch has no full uint64 arithmetic)."""
    return v - (1 << 64) if v >= 1 << 63 else v


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def fmix64_torch(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finalizer on int64 tensors holding uint64 bit patterns (wrapping multiply)."""
    z = z ^ _shr(z, 30)
    z = z * as_int64(FMIX_C1)
    z = z ^ _shr(z, 27)
    z = z * as_int64(FMIX_C2)
    return z ^ _shr(z, 31)


def check_checksum_args(staging: torch.Tensor, num_pages: int, page_bytes: int,
                        slot_bytes: int) -> None:
    """Raise ValueError unless ``num_pages`` pages of ``page_bytes`` at a ``slot_bytes`` pitch
    fit in ``staging`` (a 1-D uint8 tensor)."""
    if not isinstance(staging, torch.Tensor) or staging.dtype != torch.uint8 or staging.dim() != 1:
        raise ValueError(f"staging must be a 1-D uint8 tensor, got "
                         f"{getattr(staging, 'dtype', type(staging).__name__)} "
                         f"{tuple(getattr(staging, 'shape', ()))}")
    for name, v in (("num_pages", num_pages), ("page_bytes", page_bytes),
                    ("slot_bytes", slot_bytes)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    if page_bytes == 0 or page_bytes >= 1 << 34:
        raise ValueError(f"page_bytes must be in [1, 2**34), got {page_bytes}")
    if slot_bytes < page_bytes or (num_pages > 1 and slot_bytes % 4):
        raise ValueError(f"slot_bytes must be >= page_bytes ({page_bytes}) and a multiple of 4, "
                         f"got {slot_bytes}")
    need = (num_pages - 1) * slot_bytes + page_bytes if num_pages else 0
    if staging.numel() < need:
        raise ValueError(f"staging holds {staging.numel()} bytes, {num_pages} pages of "
                         f"{page_bytes} at a {slot_bytes}-byte pitch need {need}")


class Verdicts:
    """What the verifying scatter needs and gives, for a chunk of ``pages`` pages: their
    ``partial`` checksum sums (int64 ``[>= pages, n_chunks]``), and, at ``first ..
    first + pages - 1``, their stored checksums in ``want`` (int64) and their verdicts in ``ok``
    (int8: 1 per page that matched and was scattered, 0 otherwise). All on the pool's device.
    (Whole buffers and an offset rather than slices: a slice is a host-side tensor op per chunk.)"""

    __slots__ = ("partial", "want", "ok", "page_bytes", "first")

    def __init__(self, partial: torch.Tensor, want: torch.Tensor, ok: torch.Tensor,
                 page_bytes: int, first: int = 0) -> None:
        self.partial, self.want, self.ok = partial, want, ok
        self.page_bytes, self.first = page_bytes, first

    def reference_ok(self, num_pages: int) -> torch.Tensor:
        """The verdicts by the pure-torch definition: bool ``[num_pages]``."""
        sums = self.partial[:num_pages].sum(1)  # int64 sums wrap mod 2**64, as the kernel's
        return finalize(sums, self.page_bytes) == self.want[self.first:self.first + num_pages]


def finalize(sums: torch.Tensor, page_bytes: int) -> torch.Tensor:
    """Step 4 of the algorithm on per-page word-hash sums (int64 bit patterns)."""
    return fmix64_torch(sums + as_int64((page_bytes * GOLDEN) % (1 << 64)))


def finalize_partials_host(partial: np.ndarray, page_bytes: int) -> np.ndarray:
    """Step 4 on the host: per page (row), the wrapping sum of its partial word-hash sums, plus
    the length term, through ``fmix`` -> uint64 ``[pages]``. ``partial`` holds int64 or uint64
    bit patterns (e.g. :func:`~.triton_checksum.page_partial_sums_triton` read back)."""
    z = np.asarray(partial).view(np.uint64).sum(axis=1, dtype=np.uint64)  # wraps mod 2**64
    z += np.uint64(page_bytes * GOLDEN % (1 << 64))
    z ^= z >> np.uint64(30)
    z *= np.uint64(FMIX_C1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(FMIX_C2)
    z ^= z >> np.uint64(31)
    return z


def page_checksums_reference(staging: torch.Tensor, num_pages: int, page_bytes: int,
                             slot_bytes: int) -> torch.Tensor:
    """Checksums of pages ``staging[p * slot_bytes : p * slot_bytes + page_bytes]`` -> int64
    ``[num_pages]`` (uint64 bit patterns). Pure torch, on staging's device."""
    return finalize(page_word_sums_reference(staging, num_pages, page_bytes, slot_bytes),
                    page_bytes)


def page_word_sums_reference(staging: torch.Tensor, num_pages: int, page_bytes: int,
                             slot_bytes: int) -> torch.Tensor:
    """Steps 1-3 of the algorithm: each page's word-hash sum ``S`` -> int64 ``[num_pages]``."""
    check_checksum_args(staging, num_pages, page_bytes, slot_bytes)
    n_words = -(-page_bytes // 4)
    idx = torch.arange(n_words, dtype=torch.int64, device=staging.device) << 32
    out = torch.empty(num_pages, dtype=torch.int64, device=staging.device)
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int64, device=staging.device)
    for p in range(num_pages):  # one page at a time bounds the int64 temporaries
        page = staging[p * slot_bytes:p * slot_bytes + page_bytes]
        if page_bytes % 4:
            page = torch.cat([page, page.new_zeros(4 - page_bytes % 4)])
        # Assemble little-endian words from bytes: independent of the host's byte order.
        words = (page.view(n_words, 4).to(torch.int64) << shifts).sum(1)
        out[p] = fmix64_torch(idx | words).sum()
    return out

