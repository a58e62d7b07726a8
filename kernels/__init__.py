"""Gather/scatter and page-checksum kernels: this module is the one dispatcher between Triton and
the torch reference.

``gather_pages`` / ``scatter_pages`` (and the one-layer variants) and ``page_checksums`` pick the
implementation: the Triton kernels (:mod:`.triton_gather`, :mod:`.triton_checksum`) when the
tensors are on CUDA, or on CPU under ``TRITON_INTERPRET=1`` (Triton's interpreter, for tests);
the pure-torch reference (:mod:`.reference`, :mod:`.checksum`) otherwise, including where Triton
is not installed.

``upload`` copies the start of a pinned host buffer into device memory as a kernel (a kernel
node, not a memcpy node, in the launch graphs that use it: :mod:`.triton_upload`).

The pool argument (``rows``) is a :class:`gdskv.pool.KVPool` (the tier passes its validated,
cached view) or ``rows[kv][layer]`` uint8 views.
"""

from __future__ import annotations

import functools
import os

import torch

from gdskv.pool import as_pool

from .checksum import Verdicts, page_checksums_reference, page_word_sums_reference
from .reference import (gather_pages_layer_reference, gather_pages_reference,
                        scatter_pages_layer_reference, scatter_pages_reference,
                        scatter_pages_verified_reference, staging_pages_view)

__all__ = ["gather_pages", "scatter_pages", "gather_pages_layer", "scatter_pages_layer",
           "gather_pages_reference", "scatter_pages_reference", "gather_pages_layer_reference",
           "scatter_pages_layer_reference", "staging_pages_view", "page_checksums",
           "page_checksums_reference", "page_partial_sums", "seal_pages", "scatter_pages_verified",
           "scatter_pages_verified_reference", "Verdicts", "triton_available", "uses_triton",
           "upload"]


@functools.cache
def triton_available() -> bool:
    """Whether the Triton kernels import (triton installed and working)."""
    try:
        from . import triton_checksum, triton_gather, triton_upload  # noqa: F401
    except ImportError:
        return False
    return True


def uses_triton(device: torch.device) -> bool:
    """Whether a call on ``device`` tensors runs the Triton kernels."""
    if device.type == "cuda" or (device.type == "cpu"
                                 and os.environ.get("TRITON_INTERPRET") == "1"):
        return triton_available()
    return False


def gather_pages(rows, layout, token_slots, staging) -> None:
    """Pack ``rows[kv][layer][token_slots]`` into page-first ``staging`` pages."""
    if uses_triton(staging.device):
        from .triton_gather import gather_pages_triton
        gather_pages_triton(rows, layout, token_slots, staging)
    else:
        gather_pages_reference(as_pool(layout, rows).rows, layout, token_slots, staging)


def scatter_pages(rows, layout, token_slots, staging) -> None:
    """Unpack page-first ``staging`` pages into ``rows[kv][layer][token_slots]``."""
    if uses_triton(staging.device):
        from .triton_gather import scatter_pages_triton
        scatter_pages_triton(rows, layout, token_slots, staging)
    else:
        scatter_pages_reference(as_pool(layout, rows).rows, layout, token_slots, staging)


def scatter_pages_verified(rows, layout, token_slots, staging, verdicts: Verdicts) -> None:
    """Unpack only the staging pages whose checksum matches (one launch on Triton): the
    restore's verify and scatter in one step, with per-page verdicts left in ``verdicts.ok``."""
    if uses_triton(staging.device):
        from .triton_gather import scatter_pages_triton
        scatter_pages_triton(rows, layout, token_slots, staging, verdicts=verdicts)
    else:
        scatter_pages_verified_reference(as_pool(layout, rows).rows, layout, token_slots,
                                         staging, verdicts)


def gather_pages_layer(rows, layout, token_slots, staging, layer: int,
                       kv: int | None = None) -> None:
    """Gather one layer (K and V, or only ``kv``) of every page into its place in ``staging``."""
    if uses_triton(staging.device):
        from .triton_gather import gather_pages_layer_triton
        gather_pages_layer_triton(rows, layout, token_slots, staging, layer, kv)
    else:
        gather_pages_layer_reference(as_pool(layout, rows).rows, layout, token_slots, staging,
                                     layer, kv)


def scatter_pages_layer(rows, layout, token_slots, staging, layer: int,
                        kv: int | None = None) -> None:
    """Scatter one layer (K and V, or only ``kv``) of every page: a layer-wise restore step."""
    if uses_triton(staging.device):
        from .triton_gather import scatter_pages_layer_triton
        scatter_pages_layer_triton(rows, layout, token_slots, staging, layer, kv)
    else:
        scatter_pages_layer_reference(as_pool(layout, rows).rows, layout, token_slots, staging,
                                      layer, kv)


def _triton_hashes(staging, num_pages: int, slot_bytes: int) -> bool:
    """The Triton checksum kernel needs 4-byte aligned words; other buffers take the reference."""
    return isinstance(staging, torch.Tensor) and uses_triton(staging.device) \
        and staging.data_ptr() % 4 == 0 and (num_pages <= 1 or slot_bytes % 4 == 0)


def page_partial_sums(staging: torch.Tensor, num_pages: int, page_bytes: int,
                      slot_bytes: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each page's word-hash sum in parts, int64 ``[num_pages, parts]`` (their wrapping sum is
    the algorithm's ``S``): what :class:`Verdicts` and
    :func:`gdskv.kernels.checksum.finalize_partials_host` finish. One launch on Triton, into
    ``out`` when given (see :func:`.triton_checksum.page_partial_sums_triton`; the reference
    ignores it)."""
    if _triton_hashes(staging, num_pages, slot_bytes):
        from .triton_checksum import page_partial_sums_triton
        return page_partial_sums_triton(staging, num_pages, page_bytes, slot_bytes, out=out)
    return page_word_sums_reference(staging, num_pages, page_bytes, slot_bytes).unsqueeze(1)


def page_checksums(staging: torch.Tensor, num_pages: int, page_bytes: int,
                   slot_bytes: int) -> torch.Tensor:
    """Checksums of ``num_pages`` pages of ``staging`` (the algorithm: :mod:`.checksum`), int64."""
    if _triton_hashes(staging, num_pages, slot_bytes):
        from .triton_checksum import page_checksums_triton
        return page_checksums_triton(staging, num_pages, page_bytes, slot_bytes)
    return page_checksums_reference(staging, num_pages, page_bytes, slot_bytes)


def seal_pages(staging: torch.Tensor, num_pages: int, partial: torch.Tensor, page_bytes: int,
               slot_bytes: int, trailers: torch.Tensor, checksum_offset: int, crc_offset: int,
               crc_table: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Finish ``num_pages`` checksums from their partial sums into ``out`` and write each
    page's slot trailer, checksum and crc32c completed, at the end of its slot in ``staging``:
    one Triton launch (:func:`.triton_checksum.seal_pages_triton`; there is no torch
    reference: a spill seals on the GPU only where it checksums there, :mod:`gdskv.gpu_spill`)."""
    from .triton_checksum import seal_pages_triton
    return seal_pages_triton(staging, num_pages, partial, page_bytes, slot_bytes, trailers,
                             checksum_offset, crc_offset, crc_table, out)


def upload(host: torch.Tensor, device: torch.Tensor, n: int) -> None:
    """Queue ``device[:n] = host[:n]`` from pinned host memory on the current stream: as a
    kernel that reads the mapped host memory where Triton runs (one kernel node in a launch
    graph instead of a memcpy node, :mod:`.triton_upload`), else as an asynchronous copy."""
    if uses_triton(device.device):
        from .triton_upload import upload_triton
        upload_triton(host, device, n)
    else:
        device.view(-1)[:n].copy_(host.view(-1)[:n], non_blocking=True)
