"""The engine's KV pool as gdskv sees it: per (K/V, layer) 2-D byte views of token rows.

Engines hand their pool over in one of these forms (checked against a :class:`KVLayout`):

- MHA: ``(k, v)`` where each is a list of per-layer tensors ``[num_slots, kv_heads, head_dim]``
  or one stacked tensor ``[num_layers, num_slots, kv_heads, head_dim]``;
- MLA: one list of per-layer tensors ``[num_slots, 1, head_dim]`` (or ``[num_slots, head_dim]``),
  or one stacked tensor ``[num_layers, num_slots, 1, head_dim]`` (or ``[layers, slots, dim]``).

Rows must be contiguous (the token stride may be anything); copies are byte-wise.

This module is the one place that validates a pool and a call's token slots, and the one cache
of validated pools (:class:`PoolCache`); the kernels take a :class:`KVPool` and read its
:attr:`KVPool.row_table`.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from .layout import KVLayout


class RowTable(NamedTuple):
    """Where a pool's rows are, as the Triton kernels read it."""
    #: ``[kv * layers + layer] -> [row base address, token stride in bytes]``, int64, on the
    #: pool's device
    table: torch.Tensor
    #: largest power of two (<= 16) dividing every row address, stride and the row length
    align: int


#: up to this many token slot indices are range-checked as a Python list (beyond, numpy's
#: reductions are cheaper)
_FEW_SLOTS = 32


def check_token_slots(token_slots, page_size: int, *, num_pages: int | None = None,
                      num_slots: int | None = None, device: torch.device | None = None,
                      distinct: bool = False) -> torch.Tensor:
    """Validate a page batch's token slot indices; returns them 1-D and contiguous.

    ``num_pages``: the count must be exactly ``num_pages * page_size`` (else a multiple of
    ``page_size``); ``num_slots``: every index must be in ``[0, num_slots)`` (this reads the
    indices, a device sync when they are on a GPU); ``device``: where they must be;
    ``distinct``: no index may repeat (the slots a restore writes: two pages restored into one
    slot would leave one page's bytes in the other's; checked with ``num_slots``, in the same
    read of the indices).
    """
    if not isinstance(token_slots, torch.Tensor):
        token_slots = torch.as_tensor(token_slots)
    if token_slots.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"token slot indices must be int32 or int64, got {token_slots.dtype}")
    if device is not None and token_slots.device != device:
        raise ValueError(f"token slot indices are on {token_slots.device}, the KV pool on "
                         f"{device}")
    if token_slots.dim() != 1 or not token_slots.is_contiguous():  # (each op costs host time)
        token_slots = token_slots.reshape(-1).contiguous()
    n = token_slots.numel()
    if num_pages is not None and n != num_pages * page_size:
        raise ValueError(f"got {n} slot indices for {num_pages} pages; expected pages x "
                         f"page_size = {num_pages * page_size}")
    if n % page_size:
        raise ValueError(f"got {n} slot indices, not a multiple of page_size {page_size}")
    if num_slots is not None and n:
        repeated = False
        if token_slots.is_cpu and n <= _FEW_SLOTS:
            # a few pages' indices: Python's min/max over a list cost a third of numpy's two
            # reductions, whose per-call cost shows on a 1-page spill
            idx = token_slots.tolist()
            lo, hi = min(idx), max(idx)
            repeated = distinct and len(set(idx)) != n
        elif token_slots.is_cpu and distinct:  # sorted: its ends are the range, and a repeat
            idx = np.sort(token_slots.numpy())  # is two equal neighbours
            lo, hi = int(idx[0]), int(idx[-1])
            repeated = bool((idx[1:] == idx[:-1]).any())
        elif token_slots.is_cpu:  # numpy's reductions cost a fraction of torch's per call
            idx = token_slots.numpy()
            lo, hi = int(idx.min()), int(idx.max())
        elif distinct:  # the same, on the GPU: one device-to-host read
            s = torch.sort(token_slots).values
            lo, hi, repeats = torch.stack([s[0], s[-1], (s[1:] == s[:-1]).sum().to(s.dtype)
                                           ]).tolist()
            repeated = repeats > 0
        else:  # one reduction, one device-to-host read
            lo, hi = torch.stack(torch.aminmax(token_slots)).tolist()
        if lo < 0 or hi >= num_slots:
            raise ValueError(f"slot index out of range: [{lo}, {hi}] not within pool of "
                             f"{num_slots} slots")
        if repeated:
            raise ValueError(_repeated_slot(token_slots, page_size))
    return token_slots


def _repeated_slot(token_slots: torch.Tensor, page_size: int) -> str:
    """The error for token slot indices that repeat in one restore (which slot, which pages)."""
    idx = token_slots.cpu().numpy()
    values, counts = np.unique(idx, return_counts=True)
    slot = int(values[counts > 1][0])
    pages = sorted({int(p) // page_size for p in np.flatnonzero(idx == slot)})
    return (f"token slots overlap: slot {slot} is given {int(counts[counts > 1][0])} times in "
            f"one call (pages {pages}); each page restored needs slots of its own, or one "
            "page's bytes would land in another's")


class KVPool:
    """Validated view of an engine KV pool.

    ``rows[kv][layer]`` is a ``[num_slots, row_bytes]`` uint8 view sharing the engine's memory.
    """

    def __init__(self, layout: KVLayout, pool) -> None:
        parts = self._split_kv(layout, pool)
        self._set_rows(layout, [
            self._layer_rows(layout, part, "KV pool" if layout.mla else ("K pool", "V pool")[i])
            for i, part in enumerate(parts)
        ])

    @classmethod
    def from_rows(cls, layout: KVLayout, rows) -> "KVPool":
        """A pool given directly as ``rows[kv][layer]``: ``[num_slots, row_bytes]`` uint8 views
        with contiguous rows (kernel tests and benchmarks build these)."""
        if not isinstance(rows, (list, tuple)) or len(rows) != layout.kv_count:
            raise ValueError(f"rows must be a list of {layout.kv_count} per-layer lists "
                             f"(rows[kv][layer]), got {type(rows).__name__} of length "
                             f"{len(rows) if isinstance(rows, (list, tuple)) else '?'}")
        for kv, layers in enumerate(rows):
            if len(layers) != layout.num_layers:
                raise ValueError(f"rows[{kv}] has {len(layers)} layers, layout expects "
                                 f"{layout.num_layers}")
            for layer, r in enumerate(layers):
                if not isinstance(r, torch.Tensor) or r.dtype != torch.uint8 or r.dim() != 2 \
                        or r.shape[1] != layout.row_bytes or (r.shape[1] > 1 and r.stride(1) != 1):
                    raise ValueError(
                        f"rows[{kv}][{layer}] must be a [num_slots, {layout.row_bytes}] uint8 "
                        f"view with contiguous rows, got "
                        f"{getattr(r, 'dtype', type(r))} {tuple(getattr(r, 'shape', ()))}")
        pool = cls.__new__(cls)
        pool._set_rows(layout, [list(layers) for layers in rows])
        return pool

    def _set_rows(self, layout: KVLayout, rows: list[list[torch.Tensor]]) -> None:
        self.layout = layout
        self.rows = rows
        first = self.rows[0][0]
        self.device = first.device
        self.num_slots = first.shape[0]
        for kv_rows in self.rows:
            for r in kv_rows:
                if r.device != self.device or r.shape[0] != self.num_slots:
                    raise ValueError("all KV pool tensors must share one device and slot count; "
                                     f"got {r.device}/{r.shape[0]} vs {self.device}/{self.num_slots}")

    @staticmethod
    def _split_kv(layout: KVLayout, pool) -> list:
        if layout.mla:
            if isinstance(pool, tuple) and len(pool) == 1:
                pool = pool[0]
            return [pool]
        if not isinstance(pool, (tuple, list)) or len(pool) != 2 or isinstance(pool[0], torch.Tensor) \
                and pool[0].dim() != 4:
            raise TypeError("MHA KV pool must be a (k, v) pair; each a stacked tensor "
                            "[layers, slots, heads, head_dim] or a list of per-layer tensors")
        return list(pool)

    @staticmethod
    def _layer_rows(layout: KVLayout, part, what: str) -> list[torch.Tensor]:
        if isinstance(part, torch.Tensor):
            if part.dim() not in (3, 4) or (part.dim() == 3 and not layout.mla):
                raise ValueError(f"stacked {what} must be [layers, slots, heads, head_dim], "
                                 f"got shape {tuple(part.shape)}")
            if part.shape[0] > 1 and part.stride(0) == 0:
                raise ValueError(f"stacked {what}: every layer is the same memory (layer "
                                 "stride 0, an expanded tensor); pass the real KV pool")
            layers: Sequence[torch.Tensor] = list(part.unbind(0))
        elif isinstance(part, Sequence) and all(isinstance(t, torch.Tensor) for t in part):
            layers = part
        else:
            raise TypeError(f"{what} must be a tensor or a list of tensors, got {type(part).__name__}")
        if len(layers) != layout.num_layers:
            raise ValueError(f"{what} has {len(layers)} layers, layout expects {layout.num_layers}")
        out = []
        for i, t in enumerate(layers):
            if t.dtype != layout.torch_dtype:
                raise TypeError(f"{what} layer {i} dtype is {t.dtype}, layout expects "
                                f"{layout.torch_dtype}")
            if t.dim() == 2 and layout.mla:
                t = t.unsqueeze(1)
            if t.dim() != 3 or tuple(t.shape[1:]) != (layout.kv_heads, layout.head_dim):
                raise ValueError(f"{what} layer {i} has shape {tuple(t.shape)}, layout expects "
                                 f"[slots, {layout.kv_heads}, {layout.head_dim}]")
            if t.stride(2) != 1 or t.stride(1) != layout.head_dim:
                raise ValueError(f"{what} layer {i}: each token row must be contiguous "
                                 f"(strides {t.stride()})")
            if t.shape[0] > 1 and abs(t.stride(0)) < layout.kv_heads * layout.head_dim:
                raise ValueError(f"{what} layer {i}: token rows overlap (token stride "
                                 f"{t.stride(0)} < row of {layout.kv_heads * layout.head_dim} "
                                 "elements, an expanded tensor); pass the real KV pool")
            rows = t.flatten(1) if t.is_contiguous() else t.as_strided(
                (t.shape[0], layout.kv_heads * layout.head_dim), (t.stride(0), 1))
            out.append(rows.view(torch.uint8))
        return out

    def check_token_slots(self, token_slots, num_pages: int, *,
                          distinct: bool = False) -> torch.Tensor:
        """Validate a call's token slot indices against this pool; returns them 1-D, on the
        device they came on (``distinct``: a restore's, none may repeat). The tier copies them
        to the GPU on its own stream (:mod:`gdskv.copiers`): a copy on the caller's stream,
        when that is the legacy default stream, would wait for every blocking stream's work,
        kvikio's compat-mode copies included."""
        return check_token_slots(token_slots, self.layout.page_size, num_pages=num_pages,
                                 num_slots=self.num_slots, distinct=distinct)

    @functools.cached_property
    def row_table(self) -> RowTable:
        """The kernels' table of row addresses and strides, built once per pool: checking and
        copying it to the device costs far more host time than launching a kernel."""
        entries, align = [], math.gcd(self.layout.row_bytes, 16)
        for layers in self.rows:
            for r in layers:
                stride = r.stride(0) if r.shape[0] > 1 else self.layout.row_bytes
                align = math.gcd(align, r.data_ptr(), stride)
                entries += [r.data_ptr(), stride]
        table = torch.tensor(entries, dtype=torch.int64).reshape(-1, 2).to(self.device)
        return RowTable(table, align)


def as_pool(layout: KVLayout, rows) -> KVPool:
    """``rows`` as a :class:`KVPool` of ``layout``: a KVPool as it is, or ``rows[kv][layer]``
    uint8 views (see :meth:`KVPool.from_rows`)."""
    if isinstance(rows, KVPool):
        if rows.layout != layout:
            raise ValueError(f"the KV pool was validated for layout {rows.layout.fingerprint!r}, "
                             f"not {layout.fingerprint!r}")
        return rows
    return KVPool.from_rows(layout, rows)


def _leaf_tensors(pool) -> list:
    """The tensors an engine passes as its pool, flattened ((k, v), lists, stacked)."""
    if isinstance(pool, torch.Tensor):
        return [pool]
    if isinstance(pool, (list, tuple)):
        return [t for part in pool for t in _leaf_tensors(part)]
    return [pool]


class PoolCache:
    """The validated views of the pools an engine passes, reused while it passes the same
    tensors.

    Rebuilding a view (and its row table) cost more host time per call than the copies of a
    typical batch: about 300 µs for a 32-layer pool on the development machine, a device copy
    more on a GPU. An engine may pass more than one pool to one tier (calls from several
    threads, each with its own pool; a model with pools of two kinds), so the last
    ``MAX_ENTRIES`` pools are kept, the one used last checked first. The engine's tensors are
    held weakly: when the engine drops them, their cached view goes too.
    """

    #: pools whose views are kept (the least recently made goes first)
    MAX_ENTRIES = 8

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self._entry = None   # the last one used: (key, weak refs to the engine's tensors, KVPool)
        self._entries: dict = {}  # key -> (weak refs, KVPool), oldest first

    def get(self, kv_pool) -> KVPool:
        hit = self._entry
        if hit is not None and type(kv_pool) in (tuple, list) and len(kv_pool) == len(hit[1]):
            # the usual call: the same flat (K, V) tensors as the last one, checked in place
            # (flattening and keying them cost a cold host 10 µs a call)
            for ref, t, (_, address) in zip(hit[1], kv_pool, hit[0]):
                if ref() is not t or t.data_ptr() != address:
                    break
            else:
                return hit[2]
        leaves = _leaf_tensors(kv_pool)
        if not all(isinstance(t, torch.Tensor) for t in leaves):
            return KVPool(self.layout, kv_pool)  # raises the clear TypeError
        key = tuple((id(t), t.data_ptr()) for t in leaves)
        found = self._entries.get(key)
        if found is not None and all(r() is t for r, t in zip(found[0], leaves)):
            self._entry = (key, found[0], found[1])
            return found[1]
        pool = KVPool(self.layout, kv_pool)

        def forget(_ref, cache_key=key) -> None:
            self._entries.pop(cache_key, None)
            if self._entry is not None and self._entry[0] == cache_key:
                self._entry = None

        refs = [weakref.ref(t, forget) for t in leaves]
        while len(self._entries) >= self.MAX_ENTRIES:
            try:  # (another thread's call may change the dict meanwhile)
                self._entries.pop(next(iter(self._entries)), None)
            except (StopIteration, RuntimeError):
                break
        self._entries[key] = (refs, pool)
        self._entry = (key, refs, pool)
        return pool

    @property
    def cached(self) -> KVPool | None:
        """The view used last (None when empty)."""
        return None if self._entry is None else self._entry[2]

    def clear(self) -> None:
        self._entry = None
        self._entries.clear()
