"""LightLLM's disk cache (its own CpuKvCacheClient, DiskCacheWorker and cache manager's disk
match over integrations/light_mem) with damaged gdskv slab files (issue 46 #1): after one disk
match meets the damage, query_loadable_pages stops before the pages it could not read, so the
manager does not load them again. Runs in the LightLLM venv (tests/run_lightllm.sh)."""

from __future__ import annotations

import os

import pytest

try:
    import light_mem  # noqa: F401
    from lightllm.server.multi_level_kv_cache.disk_cache_worker import DiskCacheWorker  # noqa: F401
except ImportError as exc:
    pytest.skip(f"LightLLM or light_mem is not importable ({exc}); these tests run in the "
                f"LightLLM venv: bash tests/run_lightllm.sh", allow_module_level=True)

from gdskv.adapters.lightllm import hash_key  # noqa: E402
from test_lightllm_adapter import SHAPES, assert_loaded, on_disk_only, servers  # noqa: E402,F401


@pytest.mark.parametrize("shape", SHAPES)
def test_truncated_slab_settles_as_misses_after_one_match(tmp_path, servers, shape):
    s, hashes, data = on_disk_only(tmp_path, servers, shape, 8, seed=21)
    tier = s.tier
    where = [tier.store.location(tier.directory._index[hash_key(h)]) for h in hashes]
    f, off = where[4]
    os.truncate(tier.store.files[f].path, off + 100)  # page 4 and those after it in its file
    first_lost = min(i for i, (g, o) in enumerate(where) if g == f and o >= off)
    n = s.worker.service._n
    assert s.worker.query_loadable_pages(hashes, 0) == 8  # nothing read yet
    assert s.match(hashes) == ([], 0)  # the load fails: LightLLM takes nothing from disk
    # one match settled it: the disk now offers only the blocks before the lost page
    loadable = first_lost // n * n
    assert s.worker.query_loadable_pages(hashes, 0) == loadable
    assert not s.worker.service.query(hashes)[first_lost // n]
    found, from_disk = s.match(hashes)
    assert from_disk == loadable
    assert_loaded(s, found, data[:loadable])
