"""The tier reuses its validated view of an engine pool while the engine passes the same
tensors, and never keeps a pool alive after the engine drops it."""

from __future__ import annotations

import gc
import weakref

import torch

from gdskv.layout import KVLayout
from gdskv.tier import Tier

from conftest import random_pool

LAYOUT = KVLayout(num_layers=2, page_size=4, head_dim=16, kv_heads=2, dtype="fp16")


def test_pool_view_reused_then_released(make_config):
    with Tier(LAYOUT, make_config(), device="cpu") as tier:
        pool = random_pool(LAYOUT, 64)
        tier.put(["a"], pool, torch.arange(4))
        first = tier._pools.cached
        tier.get(["a"], pool, torch.arange(4, 8))
        assert tier._pools.cached is first  # same tensors: same view
        other = random_pool(LAYOUT, 64, seed=3)
        tier.put(["b"], other, torch.arange(4))
        assert tier._pools.cached is not first  # other tensors: validated again
        ref = weakref.ref(other[0])
        del other
        gc.collect()
        assert ref() is None and tier._pools.cached is None  # dropped with the engine's pool
        # the restored bytes came from the first pool, into other slots of it
        k = pool[0].view(torch.int16)  # raw bits (random fp16 bits include NaNs)
        assert torch.equal(k[:, 4:8], k[:, 0:4])


def test_pool_view_checked_again_when_a_tensor_changes(make_config):
    """The reuse check looks at each tensor's identity and its memory: a new tuple of the same
    tensors reuses the view, a tensor in another place, its memory swapped (``set_``) or a
    nested pool of other tensors does not."""
    with Tier(LAYOUT, make_config(), device="cpu") as tier:
        pool = random_pool(LAYOUT, 64)
        tier.put(["a"], pool, torch.arange(4))
        first = tier._pools.cached
        assert tier._pools.get(tuple(pool)) is first and tier._pools.get(list(pool)) is first
        assert tier._pools.get((pool[1], pool[0])) is not first  # K and V swapped
        pool = random_pool(LAYOUT, 64)
        second = tier._pools.get(pool)
        pool[0].set_(pool[0].clone())  # same tensor object, new memory
        third = tier._pools.get(pool)
        assert third is not second
        assert tier._pools.get(pool) is third
        nested = ([pool[0][i] for i in range(LAYOUT.num_layers)],
                  [pool[1][i] for i in range(LAYOUT.num_layers)])
        assert tier._pools.get(nested) is not third


def test_pool_views_of_several_pools_are_kept(make_config):
    """Calls that alternate between pools (threads with pools of their own) reuse each pool's
    view; past ``MAX_ENTRIES`` pools the oldest view goes, and a dropped pool's view goes with
    it."""
    with Tier(LAYOUT, make_config(), device="cpu") as tier:
        pools = [random_pool(LAYOUT, 64, seed=s) for s in range(3)]
        views = [tier._pools.get(p) for p in pools]
        assert [tier._pools.get(p) for p in reversed(pools)] == list(reversed(views))
        assert len({id(v) for v in views}) == 3
        tier._pools.MAX_ENTRIES = 3
        newest = random_pool(LAYOUT, 64, seed=9)
        tier._pools.get(newest)  # a fourth pool: the least recently made view (pools[0]) goes
        assert tier._pools.get(pools[0]) is not views[0]
        assert tier._pools.get(pools[2]) is views[2]
        ref = weakref.ref(pools[1][0])
        del pools[1], views[1]
        gc.collect()
        assert ref() is None and len(tier._pools._entries) <= 3
        assert all(all(r() is not None for r in refs) for refs, _ in tier._pools._entries.values())
