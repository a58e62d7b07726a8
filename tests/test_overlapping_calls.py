"""A restore may not write two pages to the same memory (issue 46 #11): repeated token slots in
one ``get``, or ``get_pages`` regions that share memory, are refused with a ValueError before
anything reaches the pool or the regions (else both pages reported a hit and one page's slots
held the other's bytes). A spill may read the same memory twice: that stays allowed."""

from __future__ import annotations

import pytest
import torch

from conftest import empty_like_pool, random_pool
from gdskv.layout import BytePageLayout, KVLayout
from gdskv.memory import alloc_host
from gdskv.tier import Tier

LAYOUT = KVLayout(num_layers=2, page_size=4, head_dim=16, kv_heads=2, dtype="fp16")
POOL_SLOTS = 64


@pytest.fixture
def tier(make_config, device):
    with Tier(LAYOUT, make_config(), device=device) as t:
        yield t


def stored(tier, device):
    pool = random_pool(LAYOUT, POOL_SLOTS, device=device)
    slots = torch.arange(4 * LAYOUT.page_size, device=device)
    assert tier.put(["a", "b", "c", "d"], pool, slots) == [True] * 4
    return pool


@pytest.mark.parametrize("how", ["across-pages", "within-a-page", "many-pages"])
def test_get_into_repeated_token_slots_is_refused(tier, device, how):
    stored(tier, device)
    ps = LAYOUT.page_size
    if how == "across-pages":  # page 1's slots are page 0's
        keys, slots = ["a", "b"], list(range(ps)) * 2
    elif how == "within-a-page":
        keys, slots = ["a"], [5] * ps
    else:  # 4 pages (more than a few indices: the sorted check), the last slot repeated
        keys, slots = ["a", "b", "c", "d"], list(range(4 * ps - 1)) + [0]
    slots = torch.tensor(slots, device=device)
    out = empty_like_pool(random_pool(LAYOUT, POOL_SLOTS, device=device))
    with pytest.raises(ValueError, match=r"token slots overlap: slot \d+ is given 2 times|"
                                         r"token slots overlap: slot 5 is given 4 times"):
        tier.get(keys, out, slots)
    with pytest.raises(ValueError, match="token slots overlap"):
        tier.get_async(keys, out, slots)
    assert all(not t.any() for t in (out if isinstance(out, tuple) else (out,)))
    assert tier.stats().get("hits", 0) == 0
    # the pages are still there and a call with slots of their own restores them
    assert tier.get(keys, out, torch.arange(len(keys) * ps, device=device)) == [True] * len(keys)


def test_a_spill_may_read_the_same_slots_twice(tier, device):
    pool = random_pool(LAYOUT, POOL_SLOTS, device=device)
    ps = LAYOUT.page_size
    assert tier.put(["x", "y"], pool, torch.arange(ps, device=device).repeat(2)) == [True] * 2
    out = empty_like_pool(pool)
    assert tier.get(["x", "y"], out, torch.arange(2 * ps, device=device)) == [True, True]


def test_get_pages_into_shared_memory_is_refused(tmp_path):
    from gdskv.config import TierConfig
    layout = BytePageLayout(page_bytes=8192, kind="overlap-test")
    cfg = TierConfig(directories=(str(tmp_path),), capacity="1MiB", staging_size="256KiB")
    data = [torch.randint(0, 256, (8192,), dtype=torch.uint8) for _ in range(3)]
    with Tier(layout, cfg, device="cpu") as tier:
        assert tier.put_pages(["p", "q", "r"], [[d] for d in data]) == [True] * 3
        buf = alloc_host(4 * 8192, pin=False)
        buf.zero_()
        cases = {
            "the same buffer twice": [[buf[:8192]], [buf[:8192]], [buf[16384:24576]]],
            "overlapping slices": [[buf[:8192]], [buf[4096:12288]], [buf[16384:24576]]],
            "a region inside another page's": [[buf[:8192]], [buf[8192:12288], buf[:4096]],
                                               [buf[16384:24576]]],
        }
        for what, regions in cases.items():
            with pytest.raises(ValueError, match="get_pages: the regions of pages 0 and 1 "
                                                 "share memory"):
                tier.get_pages(["p", "q", "r"], regions)
            with pytest.raises(ValueError, match="share memory"):
                tier.get_pages_async(["p", "q", "r"], regions)
        with pytest.raises(ValueError, match="get_pages: page 0's regions overlap"):
            tier.get_pages(["p"], [[buf[:4096], buf[2048:6144]]])
        assert not buf.any()  # refused before any read
        # adjacent, not shared: fine; and a spill may read shared memory
        ok = [[buf[i * 8192:(i + 1) * 8192]] for i in range(3)]
        assert tier.get_pages(["p", "q", "r"], ok) == [True] * 3
        assert all(torch.equal(buf[i * 8192:(i + 1) * 8192], data[i]) for i in range(3))
        assert tier.put_pages(["s", "t"], [[data[0]], [data[0]]]) == [True, True]
