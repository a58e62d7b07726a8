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


def gather_pages_reference(rows: list[list[torch.Tensor]], layout: KVLayout,
                           token_slots: torch.Tensor, staging: torch.Tensor) -> None:
    """Copy pool rows ``rows[kv][layer][token_slots]`` into page-first staging pages."""
    num_pages = token_slots.numel() // layout.page_size
    dst = staging_pages_view(layout, staging, num_pages)
    idx = token_slots.to(torch.int64)
    for kv, layers in enumerate(rows):
        for layer, layer_rows in enumerate(layers):
            dst[:, kv, layer] = layer_rows.index_select(0, idx).view(
                num_pages, layout.page_size, layout.row_bytes)


def scatter_pages_reference(rows: list[list[torch.Tensor]], layout: KVLayout,
                            token_slots: torch.Tensor, staging: torch.Tensor) -> None:
    """Copy page-first staging pages back into pool rows at ``token_slots``."""
    num_pages = token_slots.numel() // layout.page_size
    src = staging_pages_view(layout, staging, num_pages)
    idx = token_slots.to(torch.int64)
    for kv, layers in enumerate(rows):
        for layer, layer_rows in enumerate(layers):
            layer_rows.index_copy_(0, idx, src[:, kv, layer].reshape(-1, layout.row_bytes))


def _layer_entries(layout: KVLayout, layer: int, kv: int | None) -> list[int]:
    if not isinstance(layer, int) or not 0 <= layer < layout.num_layers:
        raise ValueError(f"layer must be in [0, {layout.num_layers}), got {layer!r}")
    if kv is None:
        return list(range(layout.kv_count))
    if not isinstance(kv, int) or not 0 <= kv < layout.kv_count:
        raise ValueError(f"kv must be None or in [0, {layout.kv_count}), got {kv!r}")
    return [kv]


def gather_pages_layer_reference(rows: list[list[torch.Tensor]], layout: KVLayout,
                                 token_slots: torch.Tensor, staging: torch.Tensor, layer: int,
                                 kv: int | None = None) -> None:
    """Like :func:`gather_pages_reference` for one layer (K and V, or only ``kv``)."""
    num_pages = token_slots.numel() // layout.page_size
    dst = staging_pages_view(layout, staging, num_pages)
    idx = token_slots.to(torch.int64)
    for k in _layer_entries(layout, layer, kv):
        dst[:, k, layer] = rows[k][layer].index_select(0, idx).view(
            num_pages, layout.page_size, layout.row_bytes)


def scatter_pages_layer_reference(rows: list[list[torch.Tensor]], layout: KVLayout,
                                  token_slots: torch.Tensor, staging: torch.Tensor, layer: int,
                                  kv: int | None = None) -> None:
    """Like :func:`scatter_pages_reference` for one layer (K and V, or only ``kv``): the step
    of a layer-wise restore."""
    num_pages = token_slots.numel() // layout.page_size
    src = staging_pages_view(layout, staging, num_pages)
    idx = token_slots.to(torch.int64)
    for k in _layer_entries(layout, layer, kv):
        rows[k][layer].index_copy_(0, idx, src[:, k, layer].reshape(-1, layout.row_bytes))
