"""vLLM-shaped test inputs built from vLLM's own config classes (needs the vllm package)."""

from __future__ import annotations

import torch

from vllm.v1.kv_offload.base import (CanonicalKVCacheRef, CanonicalKVCaches,
                                     CanonicalKVCacheTensor, make_offload_key)
from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig,
                                       OffloadingGroupConfig, OffloadingModelConfig,
                                       OffloadingParallelConfig)

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
TOKENS_PER_BLOCK = 16
#: a small attention layer: [2 (K,V)][16 tokens][2 heads][64] bf16 = 8 KiB per block
LAYER_PAGE_BYTES = 2 * TOKENS_PER_BLOCK * 2 * 64 * 2


def offloading_config(extra: dict, *, groups=((0, 4),), rank: int = 0, world_size: int = 1,
                      blocks_per_chunk: int = 1, canonical_layout: bool = False,
                      events: bool = True, worker_kv_bytes_per_block: int | None = None
                      ) -> OffloadingConfig:
    """An OffloadingConfig as vLLM's connector builds it; ``groups`` = (group id, layers)."""
    group_configs = tuple(
        OffloadingGroupConfig(tokens_per_block=TOKENS_PER_BLOCK,
                              layer_names=tuple(f"model.layers.{gid}.{i}.attn"
                                                for i in range(n)), group_id=gid)
        for gid, n in groups)
    per_block = worker_kv_bytes_per_block if worker_kv_bytes_per_block is not None else \
        sum(n for _, n in groups) * LAYER_PAGE_BYTES
    return OffloadingConfig(
        groups=group_configs, worker_kv_bytes_per_block=per_block,
        enable_kv_cache_events=events, extra_config=extra, engine_id="gdskv-test",
        model=OffloadingModelConfig(name=MODEL, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=TOKENS_PER_BLOCK,
                                    blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=rank, world_size=world_size, tp_size=world_size, pp_size=1, pcp_size=1,
            dcp_size=1, data_parallel_index=0, data_parallel_size=1,
            data_parallel_rank_local=None, is_parallelism_agnostic=False),
        canonical_layout=canonical_layout)


def kv_caches(num_blocks: int, layers_per_group, *, seed: int = 0, padded: int = 0,
              device="cpu") -> CanonicalKVCaches:
    """Random per-layer canonical int8 ``(num_blocks, page_bytes [+ padding])`` tensors, one
    per layer, as vLLM's connector registers them (CPU tensors standing in for the GPU)."""
    gen = torch.Generator().manual_seed(seed)
    tensors, refs = [], []
    for n in layers_per_group:
        group_refs = []
        for _ in range(n):
            t = torch.randint(-128, 128, (num_blocks, LAYER_PAGE_BYTES + padded),
                              dtype=torch.int8, generator=gen).to(device)
            tensors.append(CanonicalKVCacheTensor(tensor=t, page_size_bytes=t.shape[1]))
            group_refs.append(CanonicalKVCacheRef(tensor_idx=len(tensors) - 1,
                                                  page_size_bytes=LAYER_PAGE_BYTES))
        refs.append(group_refs)
    return CanonicalKVCaches(tensors=tensors, group_data_refs=refs)


def block_bytes(caches: CanonicalKVCaches, group: int, block_id: int) -> list[torch.Tensor]:
    """The bytes of one block in every layer of a group (unpadded)."""
    return [caches.tensors[r.tensor_idx].tensor[block_id, :r.page_size_bytes].clone()
            for r in caches.group_data_refs[group]]


def keys(n: int, group_id: int = 0, salt: str = "") -> list[bytes]:
    """OffloadKeys as vLLM makes them: a 32-byte block hash + the group index."""
    import hashlib
    return [make_offload_key(hashlib.sha256(f"{salt}block{i}".encode()).digest(), group_id)
            for i in range(n)]


def with_dp_index(config: OffloadingConfig, dp_index: int) -> OffloadingConfig:
    """``config`` as data-parallel replica ``dp_index`` of ``dp_index + 1`` sees it."""
    import dataclasses
    return dataclasses.replace(config, parallel=dataclasses.replace(
        config.parallel, data_parallel_index=dp_index, data_parallel_size=dp_index + 1))
