"""SGLang on its real classes (StorageBackendFactory, SGLang's host pools, the cache
controller's call order) with damaged gdskv slab files (issue 46 #1): after one prefetch meets
the damage, batch_exists and exists answer miss for the pages it could not read, so the
controller stops prefetching them. Runs in the sglang venv (tests/run_sglang.sh)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="sglang is installed only in .venv-sglang (tests/run_sglang.sh)")

from test_sglang_adapter import (NUM_PAGES, attach, build_pool, controller_backup,  # noqa: E402
                                 controller_hit_query, controller_prefetch, fill_random,
                                 host_indices_for, page_bytes, page_hashes, storage_config)


@pytest.mark.parametrize("mla,layout", [(False, "page_first_direct"), (False, "page_first"),
                                        (True, "page_first_direct")],
                         ids=["mha-page_first_direct", "mha-page_first", "mla-page_first_direct"])
def test_truncated_slabs_settle_as_misses_after_one_prefetch(tmp_path, mla, layout):
    pool = build_pool(mla, layout)
    fill_random(pool, seed=11)
    hashes = page_hashes(NUM_PAGES, seed=12)
    storage = attach(storage_config(tmp_path, mla=mla), pool)
    try:
        assert controller_backup(storage, hashes, host_indices_for(list(range(NUM_PAGES)))) \
            == NUM_PAGES
        tier = storage.tier
        skeys = storage._storage_keys(hashes)
        where = [tier.store.location(tier.directory._index[k]) for k in skeys]
        victim = tier.store.files[0].path
        cut = max(off for f, off in where if f == 0) // 2 + 100  # half of file 0's pages
        os.truncate(victim, cut)
        slot = tier.layout.slot_bytes
        lost = [i for i, (f, off) in enumerate(where) if f == 0 and off + slot > cut]
        first_lost = lost[0]
        assert 0 < first_lost < NUM_PAGES
        assert controller_hit_query(storage, hashes) == NUM_PAGES  # nothing read yet
        # into the pool's other half
        dst_idx = host_indices_for(list(range(NUM_PAGES, 2 * NUM_PAGES)))
        # the controller's prefetch stops at the first page it cannot read...
        assert controller_prefetch(storage, hashes, dst_idx) == first_lost
        for p in range(first_lost):
            assert torch.equal(page_bytes(pool, p), page_bytes(pool, NUM_PAGES + p))
        # ...and from then on the existence checks say so: one step settles it
        assert controller_hit_query(storage, hashes) == first_lost
        assert not storage.exists(hashes[first_lost])
        assert storage.exists(hashes[0])
        reads = storage.tier_stats()["read_failed"]
        assert controller_prefetch(storage, hashes[:first_lost + 1], dst_idx) == first_lost
        assert storage.tier_stats()["read_failed"] == reads  # the lost page is not read again
    finally:
        storage.close()
