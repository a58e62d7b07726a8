"""The engine's KV pool as gdskv sees it: per (K/V, layer) 2-D byte views of token rows.

Engines hand their pool over in one of these forms (checked against a :class:`KVLayout`):

- MHA: ``(k, v)`` where each is a list of per-layer tensors ``[num_slots, kv_heads, head_dim]``
  or one stacked tensor ``[num_layers, num_slots, kv_heads, head_dim]``;
- MLA: one list of per-layer tensors ``[num_slots, 1, head_dim]`` (or ``[num_slots, head_dim]``),
  or one stacked tensor ``[num_layers, num_slots, 1, head_dim]`` (or ``[layers, slots, dim]``).

Rows must be contiguous (the token stride may be anything); copies are byte-wise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .layout import KVLayout


class KVPool:
    """Validated view of an engine KV pool.

    ``rows[kv][layer]`` is a ``[num_slots, row_bytes]`` uint8 view sharing the engine's memory.
    """

    def __init__(self, layout: KVLayout, pool) -> None:
        self.layout = layout
        parts = self._split_kv(layout, pool)
        self.rows: list[list[torch.Tensor]] = [
            self._layer_rows(layout, part, "KV pool" if layout.mla else ("K pool", "V pool")[i])
            for i, part in enumerate(parts)
        ]
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
            rows = t.flatten(1) if t.is_contiguous() else t.as_strided(
                (t.shape[0], layout.kv_heads * layout.head_dim), (t.stride(0), 1))
            out.append(rows.view(torch.uint8))
        return out

    def check_token_slots(self, token_slots: torch.Tensor, num_pages: int) -> torch.Tensor:
        """Validate a page batch's token slot indices; returns them 1-D, on the device they
        came on. The tier copies them to the GPU on its own stream (:mod:`gdskv.copiers`): a
        copy on the caller's stream, when that is the legacy default stream, would wait for
        every blocking stream's work, kvikio's compat-mode copies included."""
        if not isinstance(token_slots, torch.Tensor):
            token_slots = torch.as_tensor(token_slots)
        if token_slots.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"slot indices must be int32 or int64, got {token_slots.dtype}")
        token_slots = token_slots.reshape(-1)
        expected = num_pages * self.layout.page_size
        if token_slots.numel() != expected:
            raise ValueError(f"got {token_slots.numel()} slot indices for {num_pages} pages; "
                             f"expected pages x page_size = {expected}")
        if expected:
            lo, hi = int(token_slots.min()), int(token_slots.max())
            if lo < 0 or hi >= self.num_slots:
                raise ValueError(f"slot index out of range: [{lo}, {hi}] not within pool of "
                                 f"{self.num_slots} slots")
        return token_slots
