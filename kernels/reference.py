"""Pure-torch gather/scatter between a layer-first KV pool and page-first staging pages.

This is the oracle the Triton kernels are tested against, and the path used on CPU. Staging is a
1-D uint8 tensor; page ``p`` occupies ``[p * slot_bytes, p * slot_bytes + page_bytes)`` in the
page-first order ``[kv][layer][token][row bytes]`` (see :mod:`gdskv.layout`). Padding bytes
between ``page_bytes`` and ``slot_bytes`` are left untouched.
"""

from __future__ import annotations

import torch

from gdskv.layout import KVLayout


def staging_pages_view(layout: KVLayout, staging: torch.Tensor, num_pages: int) -> torch.Tensor:
    """``[pages, kv, layer, token, row_bytes]`` uint8 view of the first ``num_pages`` pages."""
    need = num_pages * layout.slot_bytes
    if staging.dtype != torch.uint8 or staging.dim() != 1 or staging.numel() < need:
        raise ValueError(f"staging must be a 1-D uint8 tensor of at least {need} bytes, got "
                         f"{staging.dtype} {tuple(staging.shape)}")
    pages = staging[:need].view(num_pages, layout.slot_bytes)[:, :layout.page_bytes]
    return pages.unflatten(1, (layout.kv_count, layout.num_layers, layout.page_size,
                               layout.row_bytes))


def _widest(*tensors: torch.Tensor) -> torch.dtype:
    """The widest integer type all these uint8 row tensors can be viewed as (fewer elements to
    copy: index ops on 8-byte words are ~8x faster than on bytes)."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        n = dtype.itemsize
        if all(t.shape[-1] % n == 0 and t.data_ptr() % n == 0 and
               all(st % n == 0 for st in t.stride()[:-1]) for t in tensors):
            return dtype
    return torch.uint8


def gather_pages_reference(rows: list[list[torch.Tensor]], layout: KVLayout,
                           token_slots: torch.Tensor, staging: torch.Tensor) -> None:
    """Copy pool rows ``rows[kv][layer][token_slots]`` into page-first staging pages."""
    num_pages = token_slots.numel() // layout.page_size
    dst = staging_pages_view(layout, staging, num_pages)
    idx = token_slots.to(torch.int64)
    for kv, layers in enumerate(rows):
        for layer, layer_rows in enumerate(layers):
            out = dst[:, kv, layer]
            wide = _widest(out, layer_rows)
            out.view(wide).copy_(layer_rows.view(wide).index_select(0, idx).view(
                num_pages, layout.page_size, -1))


def scatter_pages_reference(rows: list[list[torch.Tensor]], layout: KVLayout,
                            token_slots: torch.Tensor, staging: torch.Tensor) -> None:
    """Copy page-first staging pages back into pool rows at ``token_slots``."""
    num_pages = token_slots.numel() // layout.page_size
    src = staging_pages_view(layout, staging, num_pages)
    idx = token_slots.to(torch.int64)
    for kv, layers in enumerate(rows):
        for layer, layer_rows in enumerate(layers):
            pages = src[:, kv, layer]
            wide = _widest(pages, layer_rows)
            layer_rows.view(wide).index_copy_(0, idx, pages.view(wide).reshape(
                num_pages * layout.page_size, -1))
