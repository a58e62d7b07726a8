"""The GPU-direct spec's data path (gdskv.adapters.vllm.blocks) on a KV cache laid out as vLLM
0.33 lays it out, without vLLM: per layer a ``[num_blocks, heads, block_size, 2 * head_dim]``
tensor (layout LBHNC: a block is one contiguous run, K and V per token), handed over as vLLM's
connector hands it to a spec: the canonical int8 ``(num_blocks, page_bytes)`` view. On CPU
through the POSIX backend (CI); on a GPU through kvikio (the lead's GPU run)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from gdskv.adapters.vllm.blocks import BlockTransfers
from gdskv.adapters.common import tier_config
from gdskv.adapters.vllm.mapping import Shard, group_geometry
from gdskv.memory import cuda_available

LAYERS, HEADS, BLOCK, HEAD_DIM, NUM_BLOCKS = 4, 8, 16, 128, 64   # Llama-3-8B rows, 4 layers

CASES = [
    pytest.param("cpu", "posix", id="cpu-posix"),
    pytest.param("cuda", "kvikio", id="cuda-kvikio", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not cuda_available() or importlib.util.find_spec("kvikio") is None,
        reason="needs a CUDA device and kvikio (the GPU machine)")]),
]


def vllm_layer_caches(device: str, seed: int) -> list[torch.Tensor]:
    """vLLM 0.33's per-layer KV cache, as the canonical int8 (num_blocks, page_bytes) views."""
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(LAYERS):
        kv = torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, generator=gen)
        kv = kv.to(torch.bfloat16).to(device)
        layers.append(kv.view(torch.int8).view(NUM_BLOCKS, -1))
    return layers


def run(transfers: BlockTransfers, job_id: int, is_store: bool, keys, block_ids):
    transfers.submit(job_id, is_store, [(0, keys, block_ids)])
    transfers.wait([job_id])
    (result,) = transfers.poll()
    assert result.job_id == job_id and result.is_store == is_store
    return result


@pytest.mark.parametrize("device, backend", CASES)
def test_blocks_round_trip_bit_exact_and_a_bad_page_is_a_failed_block(tmp_path, device,
                                                                      backend):
    caches = vllm_layer_caches(device, seed=3)
    page = caches[0].shape[1]
    assert page == 2 * BLOCK * HEADS * HEAD_DIM * 2  # 64 KiB per layer and block
    geo = group_geometry(0, BLOCK, caches, [page] * LAYERS)
    config = tier_config({"directories": str(tmp_path), "backend": backend,
                          "capacity": "64MiB", "staging_size": "8MiB"}, where="test")
    shard = Shard(model="meta-llama/Meta-Llama-3-8B", kv_dtype="bfloat16")
    transfers = BlockTransfers(shard, config, [geo])
    try:
        keys = [bytes([i]) * 32 + b"\0\0\0\0" for i in range(12)]
        src = list(range(3, 15))
        want = [torch.stack([c[b] for c in caches]).cpu() for b in src]
        stored = run(transfers, 1, True, keys, src)
        assert stored.success and stored.bytes_moved == 12 * LAYERS * page
        dst = list(range(40, 52))
        for c in caches:
            c[dst] = 0
        loaded = run(transfers, 2, False, keys, dst)
        assert loaded.success and loaded.failed_block_ids == []
        for w, b in zip(want, dst):
            assert torch.equal(torch.stack([c[b] for c in caches]).cpu(), w)

        tier = transfers.tiers[0]
        slot = tier.directory.pin([keys[4]])[0][0]
        tier.directory.unpin([slot])
        fidx, off = tier.store.location(slot)
        with open(tier.store.files[fidx].path, "r+b") as f:
            f.seek(off + 12345)
            byte = f.read(1)
            f.seek(off + 12345)
            f.write(bytes([byte[0] ^ 0x40]))
        for c in caches:
            c[dst] = 0
        again = run(transfers, 3, False, keys, dst)
        assert not again.success and again.failed_block_ids == [dst[4]]
        assert again.failed_keys == [keys[4]]
        assert all(not c[dst[4]].any() for c in caches)  # never the bad bytes
        assert torch.equal(torch.stack([c[dst[5]] for c in caches]).cpu(), want[5])
        stats = transfers.stats()[0]
        assert stats["backend"] == backend and stats["corrupt_pages"] == 1
    finally:
        transfers.close()


def test_unusable_geometry_is_refused():
    caches = vllm_layer_caches("cpu", seed=0)
    with pytest.raises(ValueError, match="same bytes per block"):
        group_geometry(0, BLOCK, caches, [caches[0].shape[1]] * 3 + [1024])
    with pytest.raises(ValueError, match="does not fit"):
        group_geometry(0, BLOCK, caches[:1], [caches[0].shape[1] + 1])
    with pytest.raises(ValueError, match="canonical int8"):
        group_geometry(0, BLOCK, [torch.zeros(4, 8, dtype=torch.bfloat16)], [8])
