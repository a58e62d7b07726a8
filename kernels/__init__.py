"""Gather/scatter kernels between an engine's layer-first KV pool and page-first pages.

``gather_pages`` / ``scatter_pages`` (and the one-layer variants) pick the implementation: the
Triton kernels when the tensors are on CUDA, or on CPU under ``TRITON_INTERPRET=1`` (Triton's
interpreter, for tests); the pure-torch reference otherwise, including where Triton is not
installed. ``page_checksums`` dispatches the same way (see :mod:`.checksum`).
"""

from __future__ import annotations

import functools
import os

import torch

from .checksum import page_checksums, page_checksums_reference
from .reference import (gather_pages_layer_reference, gather_pages_reference,
                        scatter_pages_layer_reference, scatter_pages_reference,
                        staging_pages_view)

__all__ = ["gather_pages", "scatter_pages", "gather_pages_layer", "scatter_pages_layer",
           "gather_pages_reference", "scatter_pages_reference", "gather_pages_layer_reference",
           "scatter_pages_layer_reference", "staging_pages_view", "page_checksums",
           "page_checksums_reference", "triton_available", "uses_triton"]


@functools.cache
def triton_available() -> bool:
    """Whether the Triton kernels import (triton installed and working)."""
    try:
        from . import triton_gather  # noqa: F401
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
        gather_pages_reference(rows, layout, token_slots, staging)


def scatter_pages(rows, layout, token_slots, staging) -> None:
    """Unpack page-first ``staging`` pages into ``rows[kv][layer][token_slots]``."""
    if uses_triton(staging.device):
        from .triton_gather import scatter_pages_triton
        scatter_pages_triton(rows, layout, token_slots, staging)
    else:
        scatter_pages_reference(rows, layout, token_slots, staging)


def gather_pages_layer(rows, layout, token_slots, staging, layer: int,
                       kv: int | None = None) -> None:
    """Gather one layer (K and V, or only ``kv``) of every page into its place in ``staging``."""
    if uses_triton(staging.device):
        from .triton_gather import gather_pages_layer_triton
        gather_pages_layer_triton(rows, layout, token_slots, staging, layer, kv)
    else:
        gather_pages_layer_reference(rows, layout, token_slots, staging, layer, kv)


def scatter_pages_layer(rows, layout, token_slots, staging, layer: int,
                        kv: int | None = None) -> None:
    """Scatter one layer (K and V, or only ``kv``) of every page: a layer-wise restore step."""
    if uses_triton(staging.device):
        from .triton_gather import scatter_pages_layer_triton
        scatter_pages_layer_triton(rows, layout, token_slots, staging, layer, kv)
    else:
        scatter_pages_layer_reference(rows, layout, token_slots, staging, layer, kv)
