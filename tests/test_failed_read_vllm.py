"""vLLM on its real classes with damaged gdskv slab files (issue 46 #1): a block whose read
failed settles as a MISS after one failed load, where it used to answer HIT forever and be
loaded (and fail) again. Runs in .venv-vllm (tests/run_vllm.sh)."""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("vllm", reason="vllm is installed only in .venv-vllm (tests/run_vllm.sh)")

from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext  # noqa: E402

from gdskv.adapters.vllm.spec import REFRESH_INTERVAL_S  # noqa: E402
from test_vllm_spec import CTX, connector_worker, extra, load, make_spec, store  # noqa: E402
from test_vllm_tier import drive, store_and_cascade, tiering_manager  # noqa: E402
from vllm_helpers import keys, kv_caches, offloading_config  # noqa: E402


def truncate_at(tier, key) -> None:
    """Cut ``key``'s slab file 100 B into its page: that page and those after it in the file
    end up short."""
    f, off = tier.store.location(tier.directory._index[key])
    os.truncate(tier.store.files[f].path, off + 100)


def test_tiering_manager_settles_a_failed_promotion_as_a_miss(tmp_path):
    """TieringOffloadingManager + GdskvSecondaryTier: the blocks cascade to gdskv, the primary
    is reset, the slab files are truncated. The promotion job fails once; from then on the
    lookup answers MISS (no new promotion), as vLLM's own fs tier does."""
    manager, tier, primary = tiering_manager(tmp_path)
    try:
        ctx = ReqContext("req-a")
        ks = keys(5, salt="damaged")
        store_and_cascade(manager, tier, primary, ctx, {k: 7 for k in ks})
        with manager.lock:
            manager.on_request_finished(ctx)
            manager.reset_cache()
            manager.on_reset_flushed()
        for f in tier.tier.store.files:
            os.truncate(f.path, 0)  # every block of the store is damaged

        ctx2 = ReqContext("req-b")
        with manager.lock:
            manager.on_new_request(ctx2)
            first = [manager.lookup(k, ctx2) for k in ks]
        assert set(first) == {LookupResult.HIT_PENDING}  # promotions queued...
        manager.on_schedule_end(ScheduleEndContext((), ()))  # ...submitted as one job
        assert manager.has_pending_work()
        drive(manager, ctx2, lambda: not manager.has_pending_work())  # the job fails
        with manager.lock:
            after = [manager.lookup(k, ctx2) for k in ks]
        assert after == [LookupResult.MISS] * 5
        assert [tier.lookup(k, ctx2) for k in ks] == [LookupResult.MISS] * 5
        assert not manager.has_pending_work()  # no new promotion was started
        s = tier.stats()
        assert s["unreadable_pages"] == 5 and s.get("hits", 0) == 0
    finally:
        manager.shutdown()


def test_gpu_direct_spec_lookup_misses_after_a_failed_load(tmp_path):
    """GdskvOffloadingManager + vLLM's OffloadingConnectorWorker: the blocks whose pages were
    cut off fail their load (reported for recompute), and the scheduler's next lookup is a
    MISS for them, a HIT for the others (it reads the drop from the worker's journal)."""
    spec = make_spec(offloading_config(extra(tmp_path)))
    caches = kv_caches(16, [2], seed=4)
    manager, cw = spec.get_manager(), connector_worker(spec, caches)
    try:
        ks = keys(4, salt="damaged")
        store(manager, cw, 1, ks, [0, 1, 2, 3])
        tier = cw.worker.transfers.tiers[0]
        slots = [tier.directory._index[k] for k in ks]
        assert slots == sorted(slots) and len({tier.store.location(s)[0] for s in slots}) == 1
        truncate_at(tier, ks[2])  # blocks 2 and 3 are cut off
        load(manager, cw, 2, ks, [8, 9, 10, 11])
        assert cw.worker.take_load_errors() == {2: [10, 11]}
        time.sleep(REFRESH_INTERVAL_S)
        manager.on_schedule_end(None)  # one scheduler step
        with manager.lock:
            assert [manager.lookup(k, CTX) for k in ks] == [LookupResult.HIT] * 2 + \
                [LookupResult.MISS] * 2
    finally:
        cw.shutdown()
