"""Triton gather/scatter between an engine's layer-first KV pool and page-first staging pages.

One launch moves every (K/V, layer) row of a page batch. The pool's per-layer tensors may be
separate allocations, so the kernel reads a small device table, one ``[row base address, token
stride in bytes]`` entry per (kv, layer) (:attr:`gdskv.pool.KVPool.row_table`, built once per
validated pool). A stacked pool is the same table with evenly spaced addresses.

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

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from gdskv.layout import KVLayout
from gdskv.pool import as_pool, check_token_slots

from .checksum import GOLDEN, Verdicts, as_int64

__all__ = ["gather_pages_triton", "scatter_pages_triton", "gather_pages_layer_triton",
           "scatter_pages_layer_triton", "LaunchConfig", "default_config"]


def copy_rows_kernel(table_ptr, slots_ptr, staging_ptr, n_tokens, slot_words, entry_start,
                     entry_step, partial_ptr, want_ptr, ok_ptr, first, n_chunks, length_term,
                     ROW_WORDS: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     WORD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                     ALIGN: tl.constexpr, GATHER: tl.constexpr, VERIFY: tl.constexpr,
                     CHUNKS: tl.constexpr):
    """Copy ``BLOCK_T`` tokens x ``BLOCK_C`` words of one (kv, layer) between pool and staging.

    Grid: (token blocks, column tiles of a row, (kv, layer) entries). Entry ``e`` of the table
    (``[address, token stride in bytes]``, entry = kv * layers + layer, which is also its place
    in a page) handled by program ``pid(2)`` is ``entry_start + pid(2) * entry_step``.
    ``ALIGN``: bytes every row address, stride and staging page offset is a multiple of; the
    hints below are what let the compiler use 16-byte vector loads and stores.

    ``VERIFY`` (scatter only): each token's page checksum is finished here from the page's
    ``n_chunks`` partial sums (``partial_ptr``, int64 ``[pages, n_chunks]``; ``CHUNKS`` is
    ``n_chunks`` rounded up to a power of two) and compared with ``want_ptr[first + page]``;
    rows of a page that does not match are not stored, so the pool never receives unverified
    bytes. The first program of each page writes its verdict (1 ok, 0 not) to
    ``ok_ptr[first + page]`` (``first``: the chunk's place in the call's verdicts): the host
    reads one flag array per call instead of syncing per chunk for the sums.
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
    if VERIFY:
        k = tl.arange(0, CHUNKS)
        sums = tl.load(partial_ptr + page[:, None] * n_chunks + k[None, :],
                       mask=t_mask[:, None] & (k < n_chunks)[None, :], other=0)
        # (length_term arrives as i32 when its value fits: widen before the bitcast)
        z = tl.reduce(sums.to(tl.uint64, bitcast=True), 1, _SUM) \
            + length_term.to(tl.int64).to(tl.uint64, bitcast=True)
        z = z ^ (z >> 30)
        z = z * 0xBF58476D1CE4E5B9
        z = z ^ (z >> 27)
        z = z * 0x94D049BB133111EB
        z = z ^ (z >> 31)
        want = tl.load(want_ptr + first + page, mask=t_mask, other=0).to(tl.uint64, bitcast=True)
        good = z == want
        mask = mask & good[:, None]
        # one writer per page: the page's first token in the first column tile and entry
        writer = t_mask & ((tok + pid_c + tl.program_id(2)) == 0)
        tl.store(ok_ptr + first + page, good.to(tl.int8), mask=writer)
    if GATHER:
        tl.store(dst, tl.load(src, mask=mask), mask=mask)
    else:
        tl.store(src, tl.load(dst, mask=mask), mask=mask)


# Compiled for CUDA tensors; interpreted for CPU tensors. Built explicitly (not with
# @triton.jit) so both exist in one process whatever TRITON_INTERPRET says at import time.
_copy_rows_cuda = JITFunction(copy_rows_kernel, do_not_specialize=["first", "length_term"])
_copy_rows_interp = InterpretedFunction(copy_rows_kernel)

_WORD_DTYPES = {4: torch.int32, 2: torch.int16, 1: torch.uint8}

# tl.sum's own combine function (see :mod:`.triton_checksum` for why not tl.sum).
_SUM = tl.standard._sum_combine


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
#: (bench/results/h200-2026-11-22/kernels/kernels_nvidia-h200.json): whole-row tiles of >= 16 KiB with 8 warps were the
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


def _check_staging(layout: KVLayout, num_pages: int, staging: torch.Tensor,
                   device: torch.device) -> None:
    need = num_pages * layout.slot_bytes
    if not isinstance(staging, torch.Tensor) or staging.dtype != torch.uint8 \
            or staging.dim() != 1 or staging.numel() < need or not staging.is_contiguous():
        raise ValueError(f"staging must be a contiguous 1-D uint8 tensor of at least {need} "
                         f"bytes, got {getattr(staging, 'dtype', type(staging).__name__)} "
                         f"{tuple(getattr(staging, 'shape', ()))}")
    if staging.device != device:
        raise ValueError(f"staging is on {staging.device}, the KV pool on {device}")


def _launch(rows, layout: KVLayout, token_slots: torch.Tensor, staging: torch.Tensor,
            entries: tuple[int, int, int], gather: bool,
            config: LaunchConfig | None = None, verdicts: Verdicts | None = None) -> None:
    """``entries``: (first, step, count) of the (kv * layers + layer) entries to copy."""
    pool = as_pool(layout, rows)
    token_slots = check_token_slots(token_slots, layout.page_size, device=pool.device)
    num_pages = token_slots.numel() // layout.page_size
    _check_staging(layout, num_pages, staging, pool.device)
    if num_pages == 0:
        return
    table = pool.row_table
    # The widest word and alignment that every address, stride and row length allows.
    align = math.gcd(table.align, staging.data_ptr(), layout.slot_bytes)
    word = min(align, 4)
    row_words = layout.row_bytes // word
    cfg = config or default_config(row_words, word)
    n_tokens = token_slots.numel()
    first_entry, step, count = entries
    grid = (triton.cdiv(n_tokens, cfg.block_t), triton.cdiv(row_words, cfg.block_c), count)
    if grid[1] > 65535 or grid[2] > 65535:
        raise ValueError(f"launch grid {grid} too large: row of {row_words} words or "
                         f"{count} (kv, layer) entries")
    cpu = pool.device.type == "cpu"
    kernel = _copy_rows_interp if cpu else _copy_rows_cuda
    kwargs = {} if cpu else {"num_warps": cfg.num_warps}
    if verdicts is None:  # the verify arguments are unused: any tensor will do
        partial = want = ok = table.table
        first, n_chunks, length_term, chunks = 0, 1, 0, 1
    else:
        partial, want, ok, first = verdicts.partial, verdicts.want, verdicts.ok, verdicts.first
        if partial.shape[0] < num_pages or min(want.numel(), ok.numel()) < first + num_pages:
            raise ValueError(f"verdicts cover {partial.shape[0]} pages' sums and "
                             f"{min(want.numel(), ok.numel())} checksums; the chunk needs "
                             f"{num_pages} sums and checksums {first}..{first + num_pages - 1}")
        n_chunks = partial.shape[1]
        length_term = as_int64(verdicts.page_bytes * GOLDEN % (1 << 64))
        chunks = triton.next_power_of_2(n_chunks)
    kernel[grid](table.table, token_slots, staging.view(_WORD_DTYPES[word]), n_tokens,
                 layout.slot_bytes // word, first_entry, step, partial, want, ok, first,
                 n_chunks, length_term, ROW_WORDS=row_words,
                 PAGE_SIZE=layout.page_size, WORD=word, BLOCK_T=cfg.block_t,
                 BLOCK_C=cfg.block_c, ALIGN=align, GATHER=gather,
                 VERIFY=verdicts is not None, CHUNKS=chunks, **kwargs)


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

    ``rows``: a :class:`gdskv.pool.KVPool` (its row table is reused), or ``rows[kv][layer]``
    ``[num_slots, row_bytes]`` uint8 views (validated and tabled on every call);
    ``token_slots``: int32/int64, pages x page_size entries, all within the pool (not checked
    here: that needs a device sync; :meth:`KVPool.check_token_slots` does it).
    """
    _launch(rows, layout, token_slots, staging, _all(layout), True, config)


def scatter_pages_triton(rows, layout: KVLayout, token_slots: torch.Tensor,
                         staging: torch.Tensor, config: LaunchConfig | None = None,
                         verdicts: Verdicts | None = None) -> None:
    """Unpack page-first ``staging`` pages into ``rows[kv][layer][token_slots]`` (one launch).
    With ``verdicts``, only pages whose checksum matches are unpacked (see
    :func:`copy_rows_kernel`'s ``VERIFY``)."""
    _launch(rows, layout, token_slots, staging, _all(layout), False, config, verdicts)


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
