"""Pure-torch gather/scatter between a layer-first KV pool and page-first staging pages.

This is the oracle the Triton kernels are tested against, and the path used on CPU. Staging is a
1-D uint8 tensor; page ``p`` occupies ``[p * slot_bytes, p * slot_bytes + page_bytes)`` in the
page-first order ``[kv][layer][token][row bytes]`` (see :mod:`gdskv.layout`). Padding bytes
between ``page_bytes`` and ``slot_bytes`` are left untouched.
"""

from __future__ import annotations

import torch

from gdskv.layout import KVLayout

from .checksum import Verdicts


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


def _gather_rows(dst: torch.Tensor, layer_rows: torch.Tensor, idx: torch.Tensor) -> None:
    """dst [pages, tokens, row bytes] <- layer_rows[idx] (idx has pages*tokens entries)."""
    wide = _widest(dst, layer_rows)
    dst.view(wide).copy_(layer_rows.view(wide).index_select(0, idx).view(
        dst.shape[0], dst.shape[1], -1))


def _scatter_rows(layer_rows: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    """layer_rows[idx] <- src [pages, tokens, row bytes]."""
    wide = _widest(src, layer_rows)
    layer_rows.view(wide).index_copy_(0, idx, src.view(wide).reshape(idx.numel(), -1))


def gather_pages_reference(rows: list[list[torch.Tensor]], layout: KVLayout,
                           token_slots: torch.Tensor, staging: torch.Tensor) -> None:
    """Copy pool rows ``rows[kv][layer][token_slots]`` into page-first staging pages."""
    dst = staging_pages_view(layout, staging, token_slots.numel() // layout.page_size)
    idx = token_slots.to(torch.int64)
    for kv, layers in enumerate(rows):
        for layer, layer_rows in enumerate(layers):
            _gather_rows(dst[:, kv, layer], layer_rows, idx)


def scatter_pages_reference(rows: list[list[torch.Tensor]], layout: KVLayout,
                            token_slots: torch.Tensor, staging: torch.Tensor) -> None:
    """Copy page-first staging pages back into pool rows at ``token_slots``."""
    src = staging_pages_view(layout, staging, token_slots.numel() // layout.page_size)
    idx = token_slots.to(torch.int64)
    for kv, layers in enumerate(rows):
        for layer, layer_rows in enumerate(layers):
            _scatter_rows(layer_rows, idx, src[:, kv, layer])


def scatter_pages_verified_reference(rows: list[list[torch.Tensor]], layout: KVLayout,
                                    token_slots: torch.Tensor, staging: torch.Tensor,
                                    verdicts: Verdicts) -> None:
    """Like :func:`scatter_pages_reference`, for only the pages whose checksum (finished from
    ``verdicts.partial``) equals ``verdicts.want``; ``verdicts.ok`` receives 1 per such page,
    0 per other page."""
    n = token_slots.numel() // layout.page_size
    ok = verdicts.reference_ok(n)
    verdicts.ok[verdicts.first:verdicts.first + n].copy_(ok)
    slots = token_slots.view(n, layout.page_size)
    sb = layout.slot_bytes
    for p in ok.nonzero().flatten().tolist():
        scatter_pages_reference(rows, layout, slots[p], staging[p * sb:(p + 1) * sb])


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
    dst = staging_pages_view(layout, staging, token_slots.numel() // layout.page_size)
    idx = token_slots.to(torch.int64)
    for k in _layer_entries(layout, layer, kv):
        _gather_rows(dst[:, k, layer], rows[k][layer], idx)


def scatter_pages_layer_reference(rows: list[list[torch.Tensor]], layout: KVLayout,
                                  token_slots: torch.Tensor, staging: torch.Tensor, layer: int,
                                  kv: int | None = None) -> None:
    """Like :func:`scatter_pages_reference` for one layer (K and V, or only ``kv``): the step
    of a layer-wise restore."""
    src = staging_pages_view(layout, staging, token_slots.numel() // layout.page_size)
    idx = token_slots.to(torch.int64)
    for k in _layer_entries(layout, layer, kv):
        _scatter_rows(rows[k][layer], idx, src[:, k, layer])
