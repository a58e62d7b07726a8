"""Triton gather/scatter between an engine's layer-first KV pool and page-first staging pages.

One launch moves every (K/V, layer) row of a page batch. The pool's per-layer tensors may be
separate allocations, so the kernel reads a small device table, one entry per (kv, layer) it
copies: ``[row base address, token stride in words, position of that (kv, layer) in the page]``.
A stacked pool is the same table with evenly spaced addresses.

Bytes are copied as the widest word (4, 2 or 1 bytes) that every row, stride and buffer address
allows; when they are all 16-byte aligned the kernel says so (``tl.multiple_of``) and the
compiler emits 16-byte vector loads and stores. Row length and page size are compile-time
constants, so the per-token index math is a few shifts/multiplies and none of it is per byte.

The page format is that of :mod:`gdskv.layout` (page ``p`` at ``p * slot_bytes``, order
``[kv][layer][token][row bytes]``); results are bit-identical to :mod:`.reference`.

CUDA tensors run the compiled kernel; CPU tensors run the same kernel source under Triton's
interpreter (slow, for tests), independent of ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from gdskv.layout import KVLayout

__all__ = ["gather_pages_triton", "scatter_pages_triton", "gather_pages_layer_triton",
           "scatter_pages_layer_triton", "LaunchConfig"]


def copy_rows_kernel(table_ptr, slots_ptr, staging_ptr, n_tokens, slot_words,
                     ROW_WORDS: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                     ALIGN: tl.constexpr, STRIDE_ALIGN: tl.constexpr, GATHER: tl.constexpr):
    """Copy ``BLOCK_T`` tokens x ``BLOCK_C`` words of one (kv, layer) between pool and staging.

    Grid: (token blocks, column tiles of a row, table entries).
    ``ALIGN``: bytes every row start, stride and staging page offset is a multiple of
    (``STRIDE_ALIGN`` = the same in words); these hints are what enable 16-byte vector access.
    """
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    entry = tl.program_id(2)

    # The table entry: where this (kv, layer) lives and where it goes in a page.
    row_base = tl.load(table_ptr + entry * 3).to(staging_ptr.dtype)
    row_base = tl.multiple_of(row_base, ALIGN)
    stride = tl.load(table_ptr + entry * 3 + 1)
    stride = tl.multiple_of(stride, STRIDE_ALIGN)
    pos = tl.load(table_ptr + entry * 3 + 2)

    t = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < n_tokens
    slot = tl.load(slots_ptr + t, mask=t_mask, other=0).to(tl.int64)
    page = t // PAGE_SIZE
    tok = t - page * PAGE_SIZE

    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    src = row_base + (slot * stride)[:, None] + c[None, :]
    dst = staging_ptr + (page * slot_words + (pos * PAGE_SIZE + tok) * ROW_WORDS)[:, None] \
        + c[None, :]
    if ROW_WORDS % BLOCK_C == 0:
        mask = t_mask[:, None]
    else:
        mask = t_mask[:, None] & (c < ROW_WORDS)[None, :]
    if GATHER:
        tl.store(dst, tl.load(src, mask=mask), mask=mask)
    else:
        tl.store(src, tl.load(dst, mask=mask), mask=mask)


# Compiled for CUDA tensors; interpreted for CPU tensors. Built explicitly (not with
# @triton.jit) so both exist in one process whatever TRITON_INTERPRET says at import time.
_copy_rows_cuda = JITFunction(copy_rows_kernel)
_copy_rows_interp = InterpretedFunction(copy_rows_kernel)

_WORD_DTYPES = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


class LaunchConfig:
    """Tile shape of one launch: ``block_c`` words of a row by ``block_t`` tokens per program."""

    __slots__ = ("block_t", "block_c", "num_warps")

    def __init__(self, block_t: int, block_c: int, num_warps: int = 4) -> None:
        for name, v in (("block_t", block_t), ("block_c", block_c)):
            if v < 1 or v & (v - 1):
                raise ValueError(f"LaunchConfig.{name} must be a power of two, got {v}")
        self.block_t, self.block_c, self.num_warps = block_t, block_c, num_warps

    def __repr__(self) -> str:
        return f"LaunchConfig(block_t={self.block_t}, block_c={self.block_c}, " \
               f"num_warps={self.num_warps})"


#: Bytes one program moves (tile), and the largest row tile; tuned on H100/H200 (bench/).
TILE_BYTES = 16384
MAX_COL_BYTES = 4096


def default_config(row_words: int, word: int) -> LaunchConfig:
    """Pick a tile: a row tile that wastes few masked lanes, then enough tokens to fill it."""
    top = min(triton.next_power_of_2(row_words), max(1, MAX_COL_BYTES // word))
    block_c = top
    c = top
    while c >= 1:
        tiles = -(-row_words // c)
        if (tiles * c - row_words) * 8 <= tiles * c:  # <= 12.5% masked lanes
            block_c = c
            break
        c //= 2
    block_t = max(1, min(256, triton.next_power_of_2(max(1, TILE_BYTES // (block_c * word)))))
    return LaunchConfig(block_t, block_c, 4)


# Device tables are tiny but building one is a host->device copy; engines reuse the same pool
# tensors every call, so keep the recent ones.
_TABLE_CACHE: OrderedDict = OrderedDict()
_TABLE_CACHE_SIZE = 64


def _entry_table(entries: tuple, device: torch.device) -> torch.Tensor:
    key = (device, entries)
    hit = _TABLE_CACHE.get(key)
    if hit is not None:
        _TABLE_CACHE.move_to_end(key)
        return hit
    table = torch.tensor(entries, dtype=torch.int64).reshape(-1, 3)
    if device.type != "cpu":
        table = table.to(device)
    if device.type != "cpu":  # CPU addresses may be reused after free: never cache those
        _TABLE_CACHE[key] = table
        if len(_TABLE_CACHE) > _TABLE_CACHE_SIZE:
            _TABLE_CACHE.popitem(last=False)
    return table


def _check_rows(rows, layout: KVLayout) -> torch.device:
    if not isinstance(rows, (list, tuple)) or len(rows) != layout.kv_count:
        raise ValueError(f"rows must be a list of {layout.kv_count} per-layer lists "
                         f"(rows[kv][layer]), got {type(rows).__name__} of length "
                         f"{len(rows) if isinstance(rows, (list, tuple)) else '?'}")
    device = None
    for kv, layers in enumerate(rows):
        if len(layers) != layout.num_layers:
            raise ValueError(f"rows[{kv}] has {len(layers)} layers, layout expects "
                             f"{layout.num_layers}")
        for layer, r in enumerate(layers):
            if not isinstance(r, torch.Tensor) or r.dtype != torch.uint8 or r.dim() != 2 \
                    or r.shape[1] != layout.row_bytes or (r.shape[1] > 1 and r.stride(1) != 1):
                raise ValueError(
                    f"rows[{kv}][{layer}] must be a [num_slots, {layout.row_bytes}] uint8 view "
                    f"with contiguous rows, got "
                    f"{getattr(r, 'dtype', type(r))} {tuple(getattr(r, 'shape', ()))}")
            device = r.device if device is None else device
            if r.device != device:
                raise ValueError(f"rows[{kv}][{layer}] is on {r.device}, rows[0][0] on {device}")
    return device


def _check_batch(layout: KVLayout, token_slots: torch.Tensor, staging: torch.Tensor,
                 device: torch.device) -> tuple[torch.Tensor, int]:
    if not isinstance(token_slots, torch.Tensor) or token_slots.dtype not in (torch.int32,
                                                                             torch.int64):
        raise TypeError(f"token_slots must be an int32 or int64 tensor, got "
                        f"{getattr(token_slots, 'dtype', type(token_slots).__name__)}")
    if token_slots.device != device:
        raise ValueError(f"token_slots is on {token_slots.device}, the KV pool on {device}")
    token_slots = token_slots.reshape(-1).contiguous()
    if token_slots.numel() % layout.page_size:
        raise ValueError(f"token_slots has {token_slots.numel()} entries, not a multiple of "
                         f"page_size {layout.page_size}")
    num_pages = token_slots.numel() // layout.page_size
    need = num_pages * layout.slot_bytes
    if not isinstance(staging, torch.Tensor) or staging.dtype != torch.uint8 \
            or staging.dim() != 1 or staging.numel() < need or not staging.is_contiguous():
        raise ValueError(f"staging must be a contiguous 1-D uint8 tensor of at least {need} "
                         f"bytes, got {getattr(staging, 'dtype', type(staging).__name__)} "
                         f"{tuple(getattr(staging, 'shape', ()))}")
    if staging.device != device:
        raise ValueError(f"staging is on {staging.device}, the KV pool on {device}")
    return token_slots, num_pages


def _launch(rows, layout: KVLayout, token_slots: torch.Tensor, staging: torch.Tensor,
            selected: list[tuple[int, int]], gather: bool,
            config: LaunchConfig | None = None) -> None:
    device = _check_rows(rows, layout)
    token_slots, num_pages = _check_batch(layout, token_slots, staging, device)
    if num_pages == 0 or not selected:
        return
    staging = staging[:num_pages * layout.slot_bytes]

    # The widest word and alignment that every address, stride and row length allows.
    picked = [rows[kv][layer] for kv, layer in selected]
    align = math.gcd(layout.row_bytes, layout.slot_bytes, staging.data_ptr(), 16)
    for r in picked:
        align = math.gcd(align, r.data_ptr(), r.stride(0) if r.shape[0] > 1 else 16)
    word = min(align, 4)
    row_words = layout.row_bytes // word
    entries = []
    for (kv, layer), r in zip(selected, picked):
        stride = r.stride(0) if r.shape[0] > 1 else layout.row_bytes
        entries += [r.data_ptr(), stride // word, kv * layout.num_layers + layer]
    table = _entry_table(tuple(entries), device)
    cfg = config or default_config(row_words, word)
    n_tokens = token_slots.numel()
    grid = (triton.cdiv(n_tokens, cfg.block_t), triton.cdiv(row_words, cfg.block_c), len(selected))
    if grid[1] > 65535 or grid[2] > 65535:
        raise ValueError(f"launch grid {grid} too large: row of {row_words} words or "
                         f"{len(selected)} (kv, layer) entries")
    kernel = _copy_rows_interp if device.type == "cpu" else _copy_rows_cuda
    kwargs = {} if device.type == "cpu" else {"num_warps": cfg.num_warps}
    kernel[grid](table, token_slots, staging.view(_WORD_DTYPES[word]), n_tokens,
                 layout.slot_bytes // word, ROW_WORDS=row_words, PAGE_SIZE=layout.page_size,
                 BLOCK_T=cfg.block_t, BLOCK_C=cfg.block_c, ALIGN=align, STRIDE_ALIGN=align // word,
                 GATHER=gather, **kwargs)


def _all(layout: KVLayout) -> list[tuple[int, int]]:
    return [(kv, layer) for kv in range(layout.kv_count) for layer in range(layout.num_layers)]


def _one_layer(layout: KVLayout, layer: int, kv: int | None) -> list[tuple[int, int]]:
    if not isinstance(layer, int) or not 0 <= layer < layout.num_layers:
        raise ValueError(f"layer must be in [0, {layout.num_layers}), got {layer!r}")
    if kv is None:
        return [(k, layer) for k in range(layout.kv_count)]
    if not isinstance(kv, int) or not 0 <= kv < layout.kv_count:
        raise ValueError(f"kv must be None or in [0, {layout.kv_count}), got {kv!r}")
    return [(kv, layer)]


def gather_pages_triton(rows, layout: KVLayout, token_slots: torch.Tensor,
                        staging: torch.Tensor, config: LaunchConfig | None = None) -> None:
    """Pack ``rows[kv][layer][token_slots]`` into page-first ``staging`` pages (one launch).

    ``rows[kv][layer]``: ``[num_slots, row_bytes]`` uint8 views (see :class:`gdskv.pool.KVPool`);
    ``token_slots``: int32/int64, pages x page_size entries, all within the pool (not checked
    here: that needs a device sync; :meth:`KVPool.check_token_slots` does it).
    """
    _launch(rows, layout, token_slots, staging, _all(layout), True, config)


def scatter_pages_triton(rows, layout: KVLayout, token_slots: torch.Tensor,
                         staging: torch.Tensor, config: LaunchConfig | None = None) -> None:
    """Unpack page-first ``staging`` pages into ``rows[kv][layer][token_slots]`` (one launch)."""
    _launch(rows, layout, token_slots, staging, _all(layout), False, config)


def gather_pages_layer_triton(rows, layout: KVLayout, token_slots: torch.Tensor,
                              staging: torch.Tensor, layer: int, kv: int | None = None,
                              config: LaunchConfig | None = None) -> None:
    """Gather only ``layer`` (both K and V, or only ``kv``) of every page into its place."""
    _launch(rows, layout, token_slots, staging, _one_layer(layout, layer, kv), True, config)


def scatter_pages_layer_triton(rows, layout: KVLayout, token_slots: torch.Tensor,
                               staging: torch.Tensor, layer: int, kv: int | None = None,
                               config: LaunchConfig | None = None) -> None:
    """Scatter only ``layer`` (both K and V, or only ``kv``) of every page: layer-wise restore."""
    _launch(rows, layout, token_slots, staging, _one_layer(layout, layer, kv), False, config)
