"""Triton gather/scatter between an engine's layer-first KV pool and page-first staging pages.

One launch moves every (K/V, layer) row of a page batch. The pool's per-layer tensors may be
separate allocations, so the kernel reads a small device table, one ``[row base address, token
stride in bytes]`` entry per (kv, layer) (a :class:`RowTable`, built and validated once per
pool and cached). A stacked pool is the same table with evenly spaced addresses.

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
import threading
import weakref
from collections import OrderedDict

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from gdskv.layout import KVLayout

__all__ = ["gather_pages_triton", "scatter_pages_triton", "gather_pages_layer_triton",
           "scatter_pages_layer_triton", "RowTable", "row_table", "LaunchConfig",
           "default_config"]


def copy_rows_kernel(table_ptr, slots_ptr, staging_ptr, n_tokens, slot_words, entry_start,
                     entry_step, ROW_WORDS: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     WORD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                     ALIGN: tl.constexpr, GATHER: tl.constexpr):
    """Copy ``BLOCK_T`` tokens x ``BLOCK_C`` words of one (kv, layer) between pool and staging.

    Grid: (token blocks, column tiles of a row, (kv, layer) entries). Entry ``e`` of the table
    (``[address, token stride in bytes]``, entry = kv * layers + layer, which is also its place
    in a page) handled by program ``pid(2)`` is ``entry_start + pid(2) * entry_step``.
    ``ALIGN``: bytes every row address, stride and staging page offset is a multiple of; the
    hints below are what let the compiler use 16-byte vector loads and stores.
    """
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    entry = entry_start + tl.program_id(2) * entry_step

    row_base = tl.load(table_ptr + entry * 2).to(staging_ptr.dtype)
    row_base = tl.multiple_of(row_base, ALIGN)
    stride = tl.load(table_ptr + entry * 2 + 1) // WORD
    stride = tl.multiple_of(stride, ALIGN // WORD)

    t = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < n_tokens
    slot = tl.load(slots_ptr + t, mask=t_mask, other=0).to(tl.int64)
    page = t // PAGE_SIZE
    tok = t - page * PAGE_SIZE

    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    src = row_base + (slot * stride)[:, None] + c[None, :]
    dst = staging_ptr + (page * slot_words + (entry * PAGE_SIZE + tok) * ROW_WORDS)[:, None] \
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

    def __init__(self, block_t: int, block_c: int, num_warps: int = 8) -> None:
        for name, v in (("block_t", block_t), ("block_c", block_c)):
            if v < 1 or v & (v - 1):
                raise ValueError(f"LaunchConfig.{name} must be a power of two, got {v}")
        self.block_t, self.block_c, self.num_warps = block_t, block_c, num_warps

    def __repr__(self) -> str:
        return f"LaunchConfig(block_t={self.block_t}, block_c={self.block_c}, " \
               f"num_warps={self.num_warps})"


#: Bytes of rows one program moves (at least), and the widest row tile. Measured on an H200
#: (bench/results/kernels_nvidia-h200.json): whole-row tiles of >= 16 KiB with 8 warps were the
#: best or within noise of it for 2048-byte rows; for 1152-byte rows a whole (masked, 2048-byte)
#: row tile x 16 tokens beat splitting rows into exact 128/256-byte column tiles by ~4%.
TILE_BYTES = 16384
MAX_COL_BYTES = 4096


def default_config(row_words: int, word: int) -> LaunchConfig:
    """Whole rows per program (masked up to a power of two; rows over ``MAX_COL_BYTES`` are
    split into column tiles), and enough tokens to move ``TILE_BYTES``."""
    block_c = min(triton.next_power_of_2(row_words), max(1, MAX_COL_BYTES // word))
    moved = min(row_words, block_c) * word  # real bytes of one token's tile
    block_t = min(256, triton.next_power_of_2(-(-TILE_BYTES // moved)))
    return LaunchConfig(block_t, block_c, 8)


class RowTable:
    """A pool's ``rows[kv][layer]``, validated, with the device table the kernel reads.

    Build once per pool (:func:`row_table` caches them): checking 2 x layers tensors and copying
    the table to the device costs far more host time than launching the kernel. It refers to
    the tensors weakly (a cached table never keeps an engine's pool alive); using it after the
    pool is freed raises.
    """

    def __init__(self, rows, layout: KVLayout) -> None:
        self.layout = layout
        self.device = _check_rows(rows, layout)
        entries, align = [], math.gcd(layout.row_bytes, 16)
        for layers in rows:
            for r in layers:
                stride = r.stride(0) if r.shape[0] > 1 else layout.row_bytes
                align = math.gcd(align, r.data_ptr(), stride)
                entries += [r.data_ptr(), stride]
        #: largest power of two (<= 16) dividing every row address, stride and the row length
        self.align = align
        self.num_slots = rows[0][0].shape[0]
        self.table = torch.tensor(entries, dtype=torch.int64).reshape(-1, 2).to(self.device)
        self._refs = [weakref.ref(r) for layers in rows for r in layers]
        self._ids = tuple(id(r) for layers in rows for r in layers)
        self._first_ptr = rows[0][0].data_ptr()

    def alive(self) -> bool:
        return all(ref() is not None for ref in self._refs)

    def matches(self, rows) -> bool:
        """Whether ``rows`` are the very tensors this table was built from, all still alive.

        (Engines never move a live KV tensor's storage; the first address is re-checked as a
        cheap guard against in-place ``set_``.)
        """
        return tuple(id(r) for layers in rows for r in layers) == self._ids and self.alive() \
            and rows[0][0].data_ptr() == self._first_ptr


_TABLES: OrderedDict = OrderedDict()
_TABLES_SIZE = 16
_TABLES_LOCK = threading.Lock()


def row_table(rows, layout: KVLayout) -> RowTable:
    """The :class:`RowTable` of ``rows`` (a ``rows[kv][layer]`` list or a RowTable), cached."""
    if isinstance(rows, RowTable):
        if rows.layout != layout:
            raise ValueError("RowTable was built for another layout")
        if not rows.alive():
            raise ValueError("RowTable's KV pool tensors have been freed")
        return rows
    key = (id(rows), layout)
    with _TABLES_LOCK:  # tier calls from several threads
        hit = _TABLES.get(key)
        if hit is not None and hit.matches(rows):
            _TABLES.move_to_end(key)
            return hit
    table = RowTable(rows, layout)
    with _TABLES_LOCK:
        _TABLES[key] = table
        if len(_TABLES) > _TABLES_SIZE:
            _TABLES.popitem(last=False)
    return table


def _check_rows(rows, layout: KVLayout) -> torch.device:
    if not isinstance(rows, (list, tuple)) or len(rows) != layout.kv_count:
        raise ValueError(f"rows must be a list of {layout.kv_count} per-layer lists "
                         f"(rows[kv][layer]), got {type(rows).__name__} of length "
                         f"{len(rows) if isinstance(rows, (list, tuple)) else '?'}")
    device = None
    num_slots = None
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
            num_slots = r.shape[0] if num_slots is None else num_slots
            if r.device != device or r.shape[0] != num_slots:
                raise ValueError(f"rows[{kv}][{layer}] is {r.device}/{r.shape[0]} slots, "
                                 f"rows[0][0] {device}/{num_slots}")
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
            entries: tuple[int, int, int], gather: bool,
            config: LaunchConfig | None = None) -> None:
    """``entries``: (first, step, count) of the (kv * layers + layer) entries to copy."""
    table = row_table(rows, layout)
    token_slots, num_pages = _check_batch(layout, token_slots, staging, table.device)
    if num_pages == 0:
        return
    staging = staging[:num_pages * layout.slot_bytes]
    # The widest word and alignment that every address, stride and row length allows.
    align = math.gcd(table.align, staging.data_ptr(), layout.slot_bytes)
    word = min(align, 4)
    row_words = layout.row_bytes // word
    cfg = config or default_config(row_words, word)
    n_tokens = token_slots.numel()
    first, step, count = entries
    grid = (triton.cdiv(n_tokens, cfg.block_t), triton.cdiv(row_words, cfg.block_c), count)
    if grid[1] > 65535 or grid[2] > 65535:
        raise ValueError(f"launch grid {grid} too large: row of {row_words} words or "
                         f"{count} (kv, layer) entries")
    cpu = table.device.type == "cpu"
    kernel = _copy_rows_interp if cpu else _copy_rows_cuda
    kwargs = {} if cpu else {"num_warps": cfg.num_warps}
    kernel[grid](table.table, token_slots, staging.view(_WORD_DTYPES[word]), n_tokens,
                 layout.slot_bytes // word, first, step, ROW_WORDS=row_words,
                 PAGE_SIZE=layout.page_size, WORD=word, BLOCK_T=cfg.block_t,
                 BLOCK_C=cfg.block_c, ALIGN=align, GATHER=gather, **kwargs)


def _all(layout: KVLayout) -> tuple[int, int, int]:
    return 0, 1, layout.kv_count * layout.num_layers


def _one_layer(layout: KVLayout, layer: int, kv: int | None) -> tuple[int, int, int]:
    if not isinstance(layer, int) or not 0 <= layer < layout.num_layers:
        raise ValueError(f"layer must be in [0, {layout.num_layers}), got {layer!r}")
    if kv is None:  # K of this layer, then V: entries layer and layers + layer
        return layer, layout.num_layers, layout.kv_count
    if not isinstance(kv, int) or not 0 <= kv < layout.kv_count:
        raise ValueError(f"kv must be None or in [0, {layout.kv_count}), got {kv!r}")
    return kv * layout.num_layers + layer, 1, 1


def gather_pages_triton(rows, layout: KVLayout, token_slots: torch.Tensor,
                        staging: torch.Tensor, config: LaunchConfig | None = None) -> None:
    """Pack ``rows[kv][layer][token_slots]`` into page-first ``staging`` pages (one launch).

    ``rows[kv][layer]``: ``[num_slots, row_bytes]`` uint8 views (see :class:`gdskv.pool.KVPool`)
    or a :class:`RowTable` of them;
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
