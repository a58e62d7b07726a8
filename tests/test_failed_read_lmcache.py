"""LMCache's L2 adapter interface on the real lmcache package (LMCache's parser and plugin
loader) with damaged gdskv slab files (issue 46 #1): after one load meets the damage, lookups
answer miss for the objects it could not read and LMCache is told they are gone. Runs in the
lmcache venv (tests/run_lmcache.sh)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("lmcache", reason="the real lmcache package lives in .venv-lmcache "
                    "(bash tests/run_lmcache.sh)")

from gdskv.adapters.lmcache import object_key_string  # noqa: E402
from test_lmcache_adapter import (OBJ, key, listed, load, lookup, make_adapter,  # noqa: E402
                                  obj, random_bytes, store)


@pytest.mark.parametrize("aligned", [False, True], ids=["unaligned-l1", "aligned-l1"])
def test_truncated_slab_settles_as_misses_after_one_load(tmp_path, aligned):
    adapter = make_adapter(tmp_path)
    try:
        keys = [key(i) for i in range(6)]
        data = [random_bytes(OBJ, i) for i in range(6)]
        assert store(adapter, keys, [obj(d, aligned=aligned) for d in data])
        tier = adapter.tier
        where = {k: tier.store.location(tier.directory._index[object_key_string(k)])
                 for k in keys}
        f0 = [k for k in keys if where[k][0] == 0]
        cut_at = sorted(where[k][1] for k in f0)[-1]
        os.truncate(tier.store.files[0].path, cut_at + 100)  # file 0's last object is cut
        lost = [k for k in f0 if where[k][1] == cut_at]
        assert len(lost) == 1
        # LMCache's sequence: lookup and lock, load, unlock
        assert lookup(adapter, keys) == [True] * 6
        out = [obj(torch.zeros(OBJ, dtype=torch.uint8), aligned=aligned) for _ in keys]
        assert load(adapter, keys, out) == [k not in lost for k in keys]
        assert all(torch.equal(o.raw_data[:OBJ], d) for k, o, d in zip(keys, out, data)
                   if k not in lost)
        adapter.submit_unlock(keys)
        # one load settled it: a miss from now on, and LMCache no longer counts it
        assert lookup(adapter, keys) == [k not in lost for k in keys]
        adapter.submit_unlock([k for k in keys if k not in lost])
        assert adapter.get_usage().total_bytes_used == 5 * OBJ
        assert listed(adapter) == set(keys) - set(lost)
    finally:
        adapter.close()
