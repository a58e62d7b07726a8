"""The one mapping from vLLM's offloading geometry and keys to gdskv layouts, stores and keys.

Both plug points (the GPU-direct spec and the secondary tier) use it; it imports no vLLM code,
so the GPU test of the data path runs where vLLM is not installed.

How a vLLM block becomes a gdskv page. vLLM 0.33's offloading connector registers each
attention layer as a canonical int8 ``(num_blocks, page_bytes)`` tensor (kernel layout
``LBHNC``); its block ``b`` is one contiguous run of ``page_bytes`` bytes (padded blocks: the
first ``unpadded`` bytes hold the data). gdskv copies bytes and never looks inside, so a block
is carried as one *row* of ``unpadded`` bytes per layer, and a gdskv page is one offloaded block
of every layer of a KV group, layer after layer::

    page = [layer 0 block bytes][layer 1 block bytes]...[layer L-1 block bytes]

That is expressed as a :class:`~gdskv.layout.KVLayout` with one "token" per page
(``page_size=1``), one row of ``unpadded`` bytes per layer (``kv_heads=1``,
``head_dim=unpadded``) in a one-byte dtype, and ``mla=True`` (one part per layer instead of K
and V): the shape of the bytes, not a claim that the model is MLA. The vLLM facts that decide
whether bytes are interchangeable (model, vLLM's KV dtype, tokens per block, group, rank and
world size) go into the store fingerprint through ``model_name``, so a store written for another
model, dtype, block size or sharding is refused, never read.

Keys are vLLM's ``OffloadKey`` bytes (block hash + 4-byte group index), stored as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...config import TierConfig
from ...layout import KVLayout
from ..common import safe_name, shard_name, store_directories

#: gdskv's name for "one byte per element": copies are byte-wise, so the type is only a width.
BYTE_DTYPE = "float8_e4m3fn"
_BYTE_TORCH_DTYPE = torch.float8_e4m3fn


@dataclass(frozen=True)
class Shard:
    """Which vLLM worker's bytes a store holds, and of which model.

    ``rank``/``world_size`` are vLLM's worker rank and count (TP innermost, then PP); a store is
    per (data-parallel replica, worker rank, KV group), because a worker's bytes of a block
    differ from another worker's (heads are split) and one store has one writer process.
    """

    model: str
    kv_dtype: str
    rank: int = 0
    world_size: int = 1
    tp_size: int = 1
    dp_index: int = 0

    def __post_init__(self) -> None:
        for name in ("world_size", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Shard.{name} must be a positive int, got {value!r}")
        if not 0 <= self.rank < self.world_size or self.world_size % self.tp_size:
            raise ValueError(f"Shard: rank {self.rank} / world {self.world_size} / tp "
                             f"{self.tp_size} is not a valid vLLM worker rank")

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def pp_size(self) -> int:
        return self.world_size // self.tp_size

    @property
    def node_ranks(self) -> tuple[str, ...]:
        """What this replica adds to a cluster store's default node id (:mod:`gdskv.cluster`)."""
        return (f"dp{self.dp_index}",)

    def directories(self, config: TierConfig, what: str, rank: int | None = None, *,
                    all_ranks: bool = False, create: bool = False) -> tuple[str, ...]:
        """The directories of worker ``rank``'s store ``what`` (default: this worker's), or
        with ``all_ranks`` of a store that holds every worker's share (the CPU tier's rows):
        ``<directory>/<model>/<what>/<shard>`` (:func:`~gdskv.adapters.common.shard_name`;
        ``cluster``: the data-parallel replicas share it, each a node with a namespace of its
        own in it), made owner-only when ``create`` (the writer's side). A store under its
        earlier name (``<model>/<what>_rank<r>-of-<n>[_dp<i>]``) stays in use."""
        rank = 0 if all_ranks else self.rank if rank is None else rank
        dp = f"_dp{self.dp_index}" if self.dp_index and not config.cluster else ""
        earlier = f"{safe_name(self.model)}/{what}_rank{rank}-of-{self.world_size}{dp}"
        shard = shard_name(tp_rank=rank % self.tp_size, tp_size=self.tp_size,
                           pp_rank=rank // self.tp_size, pp_size=self.pp_size,
                           dp_rank=self.dp_index, same_on_tp_ranks=all_ranks,
                           cluster=config.cluster)
        return store_directories(config.directories, self.model, what, shard,
                                 earlier=[earlier], create=create)

    def layout(self, *, num_layers: int, row_bytes: int, what: str) -> KVLayout:
        """The byte-row layout of one page: ``num_layers`` rows of ``row_bytes`` bytes."""
        return KVLayout(num_layers=num_layers, page_size=1, head_dim=row_bytes, kv_heads=1,
                        dtype=BYTE_DTYPE, mla=True,
                        model_name=f"vllm:{safe_name(self.model)}:{what}:kv={self.kv_dtype}",
                        tp_rank=self.tp_rank, tp_size=self.tp_size,
                        pp_rank=self.pp_rank, pp_size=self.pp_size)


def group_store_name(group_id: int, tokens_per_block: int) -> str:
    """Sub-store of one KV cache group (``what`` of :meth:`Shard.directories`)."""
    return f"g{group_id}-t{tokens_per_block}"


@dataclass(frozen=True)
class GroupGeometry:
    """One KV group's layers as gdskv sees them: block rows of one width per layer."""

    group_id: int
    tokens_per_block: int
    #: per layer: ``[num_blocks, 1, row_bytes]`` one-byte views of vLLM's block tensors
    rows: tuple[torch.Tensor, ...]
    row_bytes: int

    @property
    def num_blocks(self) -> int:
        return self.rows[0].shape[0]


def block_rows(tensor: torch.Tensor, page_bytes: int, *, what: str) -> torch.Tensor:
    """A ``[num_blocks, 1, page_bytes]`` one-byte view of the first ``page_bytes`` bytes of each
    block of vLLM's ``(num_blocks, padded_page_bytes)`` canonical tensor (the same memory)."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2 or tensor.element_size() != 1:
        raise ValueError(f"{what}: expected vLLM's canonical int8 (num_blocks, page_bytes) "
                         f"block tensor, got {getattr(tensor, 'dtype', type(tensor).__name__)} "
                         f"{tuple(getattr(tensor, 'shape', ()))}")
    if tensor.stride(1) != 1:
        raise ValueError(f"{what}: a block's bytes must be contiguous (strides "
                         f"{tensor.stride()})")
    if not 0 < page_bytes <= tensor.shape[1]:
        raise ValueError(f"{what}: page of {page_bytes} B does not fit a block of "
                         f"{tensor.shape[1]} B")
    return tensor[:, :page_bytes].view(_BYTE_TORCH_DTYPE).unsqueeze(1)


def group_geometry(group_id: int, tokens_per_block: int, tensors: Sequence[torch.Tensor],
                   page_bytes: Sequence[int]) -> GroupGeometry:
    """Check one group's layers (``tensors[i]`` holding ``page_bytes[i]`` bytes per block) and
    view them as block rows. Refused, with the reason: no layers, layers of different widths
    (e.g. a group mixing attention and Mamba state), different block counts or devices."""
    what = f"KV group {group_id}"
    if not tensors:
        raise ValueError(f"{what}: no layers to offload")
    widths = sorted(set(page_bytes))
    if len(widths) != 1:
        raise ValueError(f"{what}: gdskv needs every layer of a group to hold the same bytes "
                         f"per block, got {widths}; this geometry is not supported")
    rows = tuple(block_rows(t, widths[0], what=f"{what} layer {i}")
                 for i, t in enumerate(tensors))
    if len({(r.shape[0], r.device) for r in rows}) != 1:
        raise ValueError(f"{what}: layers differ in block count or device: "
                         f"{sorted({(r.shape[0], str(r.device)) for r in rows})}")
    return GroupGeometry(group_id, tokens_per_block, rows, widths[0])
