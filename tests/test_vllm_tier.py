"""gdskv as vLLM 0.33's secondary tier, on vLLM's real classes: SecondaryTierFactory and the
TieringOffloadingManager that TieringOffloadingSpec builds (its CPU primary is an mmap in
/dev/shm, so it builds on CPU). Runs in .venv-vllm (tests/run_vllm.sh)."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("vllm", reason="vllm is installed only in .venv-vllm (tests/run_vllm.sh)")

import numpy as np  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402

from gdskv.adapters.vllm.secondary import GdskvSecondaryTier  # noqa: E402
from gdskv.config import ConfigError  # noqa: E402
from vllm_helpers import keys, offloading_config  # noqa: E402

ROW = 32 << 10


def gdskv_tier_config(tmp_path, **options) -> dict:
    cfg = {"type": "GdskvSecondaryTier", "module_path": "gdskv.adapters.vllm.secondary",
           "directories": str(tmp_path), "capacity": "16MiB", "staging_size": "1MiB",
           "io_threads": 2, "sync": "none"}
    cfg.update(options)
    return cfg


def primary_view(num_chunks: int, seed: int = 0) -> tuple[np.ndarray, memoryview]:
    rows = np.random.default_rng(seed).integers(0, 256, (num_chunks, ROW), dtype=np.uint8)
    return rows, memoryview(rows)


def cpu_spec(tmp_path):
    """An OffloadingSpec to hand the tier (the tier reads only its config)."""
    return OffloadingSpecFactory.create_spec(offloading_config(
        {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 20}))


def finished(tier, want: set[int], timeout=30.0) -> dict:
    got, deadline = {}, time.monotonic() + timeout
    while not want <= set(got):
        assert time.monotonic() < deadline, f"jobs {want - set(got)} did not finish"
        for r in tier.get_finished_jobs():
            assert r.job_id not in got, "a job was reported twice"
            got[r.job_id] = r
        time.sleep(0.005)
    return got


def test_factory_builds_the_tier_and_round_trips_rows_bit_exact(tmp_path):
    rows, view = primary_view(16)
    tier = SecondaryTierFactory.create_secondary_tier(gdskv_tier_config(tmp_path), view,
                                                      cpu_spec(tmp_path))
    assert isinstance(tier, GdskvSecondaryTier) and tier.block_size_bytes == ROW
    ks = keys(4)
    ctx = ReqContext("r")
    assert [tier.lookup(k, ctx) for k in ks] == [LookupResult.MISS] * 4
    tier.submit_store(TransferJob(1, ks, np.array([1, 3, 5, 7]), False, ctx))
    res = finished(tier, {1})[1]
    assert res.success and res.successful_keys is None and res.transfer_bytes == 4 * ROW
    assert [tier.lookup(k, ctx) for k in ks] == [LookupResult.HIT] * 4
    want = rows[[1, 3, 5, 7]].copy()
    rows[10:14] = 0
    tier.submit_load(TransferJob(2, ks, np.array([10, 11, 12, 13]), True, ctx))
    assert finished(tier, {2})[2].success
    assert np.array_equal(rows[10:14], want)
    assert tier.get_finished_jobs() == []
    tier.shutdown()


def test_submits_do_not_block_and_partial_failure_is_per_key(tmp_path):
    rows, view = primary_view(8, seed=1)
    tier = SecondaryTierFactory.create_secondary_tier(gdskv_tier_config(tmp_path), view,
                                                      cpu_spec(tmp_path))
    ctx = ReqContext("r")
    ks = keys(3)
    gate = threading.Event()
    put = tier.tier.put_pages

    def slow_put(*args):
        gate.wait(10)
        return put(*args)

    tier.tier.put_pages = slow_put  # the store job waits; the submit must not
    t0 = time.perf_counter()
    tier.submit_store(TransferJob(1, ks, np.array([0, 1, 2]), False, ctx))
    assert time.perf_counter() - t0 < 0.5 and tier.has_pending_work()
    assert list(tier.get_finished_jobs()) == []
    gate.set()
    assert finished(tier, {1})[1].success
    tier.tier.put_pages = put

    # one page goes bad on disk: the load reports the other two as successful_keys
    slot = tier.tier.directory.pin([ks[1]])[0][0]
    tier.tier.directory.unpin([slot])
    fidx, off = tier.tier.store.location(slot)
    with open(tier.tier.store.files[fidx].path, "r+b") as f:
        f.seek(off + 7)
        byte = f.read(1)
        f.seek(off + 7)
        f.write(bytes([byte[0] ^ 1]))
    rows[5:8] = 0
    tier.submit_load(TransferJob(2, ks, np.array([5, 6, 7]), True, ctx))
    res = finished(tier, {2})[2]
    assert not res.success and set(res.successful_keys) == {ks[0], ks[2]}
    assert np.array_equal(rows[5], rows[0]) and np.array_equal(rows[7], rows[2])
    assert not rows[6].any()  # the bad page never reached the primary
    assert tier.lookup(ks[1], ctx) is LookupResult.MISS  # dropped, so vLLM recomputes it
    # a job that cannot run at all fails whole, as a result, not an exception
    tier.submit_store(TransferJob(3, ["not-bytes-but-fine", "x"], np.array([0]), False, ctx))
    res = finished(tier, {3})[3]
    assert not res.success and res.transfer_bytes == 0
    tier.shutdown()


def test_bad_tier_options_are_refused_at_start(tmp_path):
    _, view = primary_view(2)
    spec = cpu_spec(tmp_path)
    with pytest.raises(ConfigError,
                       match=r"unknown .* key 'capcity' \(did you mean capacity\?\)"):
        SecondaryTierFactory.create_secondary_tier(
            gdskv_tier_config(tmp_path, capcity="1G"), view, spec)
    with pytest.raises(ConfigError, match="io_threads"):
        SecondaryTierFactory.create_secondary_tier(
            gdskv_tier_config(tmp_path, io_threads=0), view, spec)
    with pytest.raises(ConfigError, match="jobs must be a positive integer, got 0"):
        SecondaryTierFactory.create_secondary_tier(
            gdskv_tier_config(tmp_path, jobs=0), view, spec)
    # a refused tier leaves nothing locked: a good config over the same directory opens
    SecondaryTierFactory.create_secondary_tier(
        gdskv_tier_config(tmp_path, jobs=3), view, spec).shutdown()


def drive(manager, ctx, until, timeout=30.0):
    """Step the scheduler (on_schedule_end each step) until ``until()`` holds."""
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "the tiering manager did not get there"
        manager.on_schedule_end(ScheduleEndContext((), ()))
        time.sleep(0.005)


def tiering_manager(tmp_path):
    """vLLM's TieringOffloadingManager (built by TieringOffloadingSpec, CPU primary in
    /dev/shm) with a GdskvSecondaryTier below it: (manager, that tier, the primary's rows)."""
    cfg = offloading_config({"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 4 << 20,
                             "secondary_tiers": [gdskv_tier_config(tmp_path)]},
                            worker_kv_bytes_per_block=ROW)
    manager = OffloadingSpecFactory.create_spec(cfg).get_manager()
    tier = manager.secondary_tiers[0]
    assert isinstance(tier, GdskvSecondaryTier)
    primary = np.frombuffer(manager.primary_tier.get_kv_memoryview().cast("B"),
                            dtype=np.uint8).reshape(-1, tier.block_size_bytes)
    return manager, tier, primary


def store_and_cascade(manager, tier, primary, ctx, rows: dict) -> None:
    """Store ``rows`` (key -> row) in the primary as vLLM's worker would (the GPU->CPU copy),
    then step the scheduler until every key has cascaded down to gdskv."""
    with manager.lock:
        manager.on_new_request(ctx)
        out = manager.prepare_store(list(rows), ctx)
    for k, c in zip(out.keys_to_store, out.store_spec.block_ids):
        primary[int(c)] = rows[k]
    with manager.lock:
        manager.complete_store(out.keys_to_store, ctx)
    drive(manager, ctx, lambda: all(tier.tier.contains(k) for k in rows)
          and not manager.has_pending_work())


def test_real_tiering_manager_cascades_to_gdskv_and_promotes_back(tmp_path):
    """vLLM's TieringOffloadingManager with gdskv below it: stores cascade down, a reset
    empties the primary, and lookups promote the blocks back from gdskv bit-exact."""
    manager, tier, primary = tiering_manager(tmp_path)
    try:
        ctx = ReqContext("req-a")
        ks = keys(5, salt="tiering")
        rng = np.random.default_rng(7)
        want = {k: rng.integers(0, 256, primary.shape[1], dtype=np.uint8) for k in ks}
        store_and_cascade(manager, tier, primary, ctx, want)

        with manager.lock:
            manager.on_request_finished(ctx)
            manager.reset_cache()          # the primary forgets every block...
            manager.on_reset_flushed()
            primary[:] = 0
        ctx2 = ReqContext("req-b")
        with manager.lock:
            manager.on_new_request(ctx2)
            first = [manager.lookup(k, ctx2) for k in ks]
        assert LookupResult.MISS not in first  # ...gdskv still has them: promotions start

        def all_hit():
            with manager.lock:
                return all(manager.lookup(k, ctx2) is LookupResult.HIT for k in ks)
        drive(manager, ctx2, all_hit)
        with manager.lock:
            load = manager.prepare_load(ks, ctx2)
        for k, c in zip(ks, load.block_ids):  # promoted rows, as the CPU->GPU copy sees them
            assert np.array_equal(primary[int(c)], want[k])
        with manager.lock:
            manager.complete_load(ks, ctx2)
        assert tier.stats()["hits"] == len(ks)
    finally:
        manager.shutdown()


def test_cluster_store_replicas_share_rows(tmp_path):
    """"cluster": true: the secondary tiers of two data-parallel replicas share one directory;
    each is a node (node id from its replica index) and loads the rows the other stored."""
    from vllm_helpers import with_dp_index
    opts = gdskv_tier_config(tmp_path, cluster=True, cluster_follow_ms=1)
    rows0, view0 = primary_view(8, seed=5)
    rows1, view1 = primary_view(8, seed=6)
    tiers = [SecondaryTierFactory.create_secondary_tier(
        dict(opts), view, OffloadingSpecFactory.create_spec(with_dp_index(offloading_config(
            {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 20}), dp)))
        for dp, view in ((0, view0), (1, view1))]
    assert [t.tier.node_id.split("-")[-1] for t in tiers] == ["dp0", "dp1"]
    ks, ctx = keys(3), ReqContext("r")
    tiers[0].submit_store(TransferJob(1, ks, np.array([0, 1, 2]), False, ctx))
    assert finished(tiers[0], {1})[1].success
    deadline = time.monotonic() + 10
    while tiers[1].lookup(ks[-1], ctx) is not LookupResult.HIT:
        assert time.monotonic() < deadline, "replica 1 never saw replica 0's rows"
        time.sleep(0.01)
    tiers[1].submit_load(TransferJob(2, ks, np.array([5, 6, 7]), True, ctx))
    assert finished(tiers[1], {2})[2].success
    assert np.array_equal(rows1[5:8], rows0[0:3])
    for t in tiers:
        t.shutdown()
