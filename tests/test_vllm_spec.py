"""The GPU-direct spec on vLLM 0.33's real classes: created by OffloadingSpecFactory, driven by
vLLM's own OffloadingConnectorWorker and the scheduler's call order, CPU tensors standing in
for the GPU KV cache. Runs in .venv-vllm (tests/run_vllm.sh)."""

from __future__ import annotations

import glob
import logging
import os
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vllm is installed only in .venv-vllm (tests/run_vllm.sh)")

import torch  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingConnectorMetadata, TransferJob)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (  # noqa: E402
    OffloadingConnectorWorker)
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec)
from vllm.v1.kv_offload.base import (GPULoadStoreSpec, LookupResult, ReqContext,  # noqa: E402
                                     Medium)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

from gdskv.adapters.vllm.connector import GdskvOffloadingConnector  # noqa: E402
from gdskv.adapters.vllm.spec import (GdskvKeysSpec, GdskvOffloadingSpec,  # noqa: E402
                                      built_by_gdskv_connector)
from gdskv.config import ConfigError  # noqa: E402
from vllm_helpers import block_bytes, kv_caches, keys, offloading_config  # noqa: E402

SPEC = {"spec_name": "GdskvOffloadingSpec", "spec_module_path": "gdskv.adapters.vllm.spec"}
CTX = ReqContext(req_id="req-0")


def extra(tmp_path, **gdskv) -> dict:
    opts = {"directories": str(tmp_path), "capacity": "64MiB", "staging_size": "1MiB",
            "io_threads": 2, "sync": "none"}
    opts.update(gdskv)
    return {**SPEC, "gdskv": opts}


def make_spec(cfg) -> GdskvOffloadingSpec:
    with built_by_gdskv_connector():
        spec = OffloadingSpecFactory.create_spec(cfg)
    assert isinstance(spec, GdskvOffloadingSpec)
    return spec


def connector_worker(spec, caches) -> OffloadingConnectorWorker:
    """vLLM's own connector worker over our spec's worker (register_kv_caches needs a GPU
    model runner; it ends in spec.get_worker(canonical caches), which we call directly)."""
    cw = OffloadingConnectorWorker(spec, vllm_config=None, kv_cache_config=None)
    cw.worker = spec.get_worker(caches)
    return cw


def run_until_done(cw: OffloadingConnectorWorker, job_ids: set[int], timeout=30.0) -> set[str]:
    done: set[int] = set()
    recving: set[str] = set()
    deadline = time.monotonic() + timeout
    while not job_ids <= done:
        assert time.monotonic() < deadline, f"jobs {job_ids - done} did not finish"
        _, r = cw.get_finished(set())
        recving |= r
        meta = cw.build_connector_worker_meta()
        if meta is not None:
            done |= set(meta.completed_jobs)
        time.sleep(0.005)
    return recving


def store(manager, cw, job_id: int, ks: list[bytes], block_ids: list[int]) -> list[bytes]:
    """Scheduler: prepare_store -> store job; worker: submit (next step) -> finish;
    scheduler: complete_store. Returns the keys the manager asked to store."""
    with manager.lock:
        out = manager.prepare_store(ks, CTX)
    wanted = set(out.keys_to_store)
    ids = [b for k, b in zip(ks, block_ids) if k in wanted]
    meta = OffloadingConnectorMetadata(load_jobs={}, store_jobs={job_id: TransferJob(
        "req-0", GPULoadStoreSpec(ids, group_sizes=[len(ids)], block_indices=[0]),
        out.store_spec)})
    cw.prepare_store_kv(meta)            # deferred to the next step's start, as in vLLM
    cw.start_kv_transfers(OffloadingConnectorMetadata(load_jobs={}, store_jobs={}))
    run_until_done(cw, {job_id})
    with manager.lock:
        manager.complete_store(out.keys_to_store, CTX)
    return out.keys_to_store


def load(manager, cw, job_id: int, ks: list[bytes], block_ids: list[int]) -> set[str]:
    with manager.lock:
        assert all(manager.lookup(k, CTX) is LookupResult.HIT for k in ks)
        src = manager.prepare_load(ks, CTX)
    meta = OffloadingConnectorMetadata(store_jobs={}, load_jobs={job_id: TransferJob(
        "req-1", src, GPULoadStoreSpec(block_ids, group_sizes=[len(block_ids)],
                                       block_indices=[0]))})
    cw.start_kv_transfers(meta)
    recving = run_until_done(cw, {job_id})
    with manager.lock:
        manager.complete_load(ks, CTX)
    return recving


def test_store_then_load_into_other_blocks_is_bit_exact_and_survives_restart(tmp_path):
    cfg = offloading_config(extra(tmp_path))
    spec = make_spec(cfg)
    caches = kv_caches(32, [4], seed=1)
    manager, cw = spec.get_manager(), connector_worker(spec, caches)
    ks = keys(6)
    with manager.lock:
        assert [manager.lookup(k, CTX) for k in ks] == [LookupResult.MISS] * 6
    want = {k: block_bytes(caches, 0, b) for k, b in zip(ks, range(2, 8))}
    assert store(manager, cw, 1, ks, list(range(2, 8))) == ks
    assert store(manager, cw, 2, ks, list(range(2, 8))) == []  # already stored: nothing to do
    dst = list(range(20, 26))
    for b in dst:  # make sure the destination differs before the load
        for r in caches.group_data_refs[0]:
            caches.tensors[r.tensor_idx].tensor[b].zero_()
    assert load(manager, cw, 3, ks, dst) == {"req-1"}
    assert cw.worker.take_load_errors() == {}
    for k, b in zip(ks, dst):
        assert all(torch.equal(a, w) for a, w in zip(block_bytes(caches, 0, b), want[k]))
    events = list(manager.take_events())
    assert [(e.medium, e.removed, sorted(e.keys)) for e in events] == \
        [(Medium.STORAGE, False, sorted(ks))]
    cw.shutdown()
    manager.shutdown()

    # restart: a new spec (new manager and worker) over the same directory still hits
    spec2 = make_spec(offloading_config(extra(tmp_path)))
    caches2 = kv_caches(32, [4], seed=2)
    manager2, cw2 = spec2.get_manager(), connector_worker(spec2, caches2)
    load(manager2, cw2, 1, ks[:3], [5, 6, 7])
    for k, b in zip(ks[:3], [5, 6, 7]):
        assert all(torch.equal(a, w) for a, w in zip(block_bytes(caches2, 0, b), want[k]))
    cw2.shutdown()
    manager2.shutdown()


def test_upgrade_keeps_the_stores_under_their_earlier_names(tmp_path, caplog):
    """Stores an earlier gdskv made as <model>/<group>_rank<r>-of-<n> (before the naming the
    adapters share, docs/adapters.md) stay in use after an upgrade, for the scheduler's index
    and the worker alike: the warm cache still hits, said once per store."""
    spec = make_spec(offloading_config(extra(tmp_path)))
    caches = kv_caches(32, [4], seed=1)
    manager, cw = spec.get_manager(), connector_worker(spec, caches)
    ks = keys(4)
    want = {k: block_bytes(caches, 0, b) for k, b in zip(ks, range(2, 6))}
    assert store(manager, cw, 1, ks, list(range(2, 6))) == ks
    cw.shutdown()
    manager.shutdown()
    [current] = spec.store_dirs(spec.config.groups[0])
    assert current.endswith(os.path.join("g0-t16", "tp0-of-1"))
    group_dir = os.path.dirname(current)
    os.rename(current, group_dir + "_rank0-of-1")  # where the earlier naming put it
    os.rmdir(group_dir)
    with caplog.at_level(logging.WARNING, logger="gdskv.adapters"):
        spec2 = make_spec(offloading_config(extra(tmp_path)))
        caches2 = kv_caches(32, [4], seed=2)
        manager2, cw2 = spec2.get_manager(), connector_worker(spec2, caches2)
    try:
        with manager2.lock:
            assert [manager2.lookup(k, CTX) for k in ks] == [LookupResult.HIT] * 4
        load(manager2, cw2, 1, ks, [10, 11, 12, 13])
        for k, b in zip(ks, [10, 11, 12, 13]):
            assert all(torch.equal(a, w) for a, w in zip(block_bytes(caches2, 0, b), want[k]))
    finally:
        cw2.shutdown()
        manager2.shutdown()
    said = [r for r in caplog.records if "earlier gdskv" in r.getMessage()]
    assert len(said) == 1 and "g0-t16_rank0-of-1" in said[0].getMessage()
    assert not os.path.exists(group_dir)  # nothing made under the current name


def test_padded_blocks_and_two_kv_groups(tmp_path):
    """Hybrid models: two groups with their own layers, keys and block ids, one store each;
    padded block tensors (page < block stride) carry only the page bytes."""
    cfg = offloading_config(extra(tmp_path), groups=((0, 3), (1, 2)))
    spec = make_spec(cfg)
    caches = kv_caches(16, [3, 2], seed=3, padded=512)
    manager, cw = spec.get_manager(), connector_worker(spec, caches)
    k0, k1 = keys(2, group_id=0), keys(3, group_id=1)
    with manager.lock:
        out = manager.prepare_store(k0 + k1, CTX)
    src = GPULoadStoreSpec([1, 2, 3, 4, 5], group_sizes=[2, 3], block_indices=[0, 0])
    cw.prepare_store_kv(OffloadingConnectorMetadata({}, {7: TransferJob("r", src,
                                                                         out.store_spec)}))
    cw.start_kv_transfers(OffloadingConnectorMetadata({}, {}))
    run_until_done(cw, {7})
    with manager.lock:
        manager.complete_store(out.keys_to_store, CTX)
        assert all(manager.lookup(k, CTX) is LookupResult.HIT for k in k0 + k1)
        spec_in = manager.prepare_load(k0 + k1, CTX)
    dst = GPULoadStoreSpec([10, 11, 12, 13, 14], group_sizes=[2, 3], block_indices=[0, 0])
    cw.start_kv_transfers(OffloadingConnectorMetadata({8: TransferJob("r", spec_in, dst)}, {}))
    run_until_done(cw, {8})
    for g, pairs in ((0, [(1, 10), (2, 11)]), (1, [(3, 12), (4, 13), (5, 14)])):
        for a, b in pairs:
            assert all(torch.equal(x, y) for x, y in zip(block_bytes(caches, g, a),
                                                         block_bytes(caches, g, b)))
    # one store per group: <directory>/<model>/g<group>-t<tokens>/<shard> (docs/adapters.md)
    assert len(glob.glob(str(tmp_path / "*" / "g*" / "tp0-of-1" / "gdskv-journal.log"))) == 2
    cw.shutdown()


def test_two_tp_ranks_hit_only_when_both_stored(tmp_path):
    cfgs = [offloading_config(extra(tmp_path), rank=r, world_size=2) for r in (0, 1)]
    specs = [make_spec(c) for c in cfgs]
    caches = [kv_caches(8, [2], seed=10 + r) for r in (0, 1)]
    workers = [connector_worker(s, c) for s, c in zip(specs, caches)]
    manager = specs[0].get_manager()  # the scheduler's (rank 0) spec
    ks = keys(2)
    with manager.lock:
        out = manager.prepare_store(ks, CTX)
    job = TransferJob("r", GPULoadStoreSpec([1, 2], [2], [0]), out.store_spec)
    workers[0].prepare_store_kv(OffloadingConnectorMetadata({}, {1: job}))
    workers[0].start_kv_transfers(OffloadingConnectorMetadata({}, {}))
    run_until_done(workers[0], {1})
    with manager.lock:
        manager.refresh(force=True)
        assert manager.lookup(ks[0], CTX) is LookupResult.MISS  # rank 1 has not stored yet
    workers[1].prepare_store_kv(OffloadingConnectorMetadata({}, {1: job}))
    workers[1].start_kv_transfers(OffloadingConnectorMetadata({}, {}))
    run_until_done(workers[1], {1})
    with manager.lock:
        manager.complete_store(ks, CTX)
        assert manager.lookup(ks[0], CTX) is LookupResult.HIT
    for r in (0, 1):  # each rank restores its own bytes
        load(manager, workers[r], 2, ks, [5, 6])
        for a, b in ((1, 5), (2, 6)):
            assert all(torch.equal(x, y) for x, y in zip(block_bytes(caches[r], 0, a),
                                                         block_bytes(caches[r], 0, b)))
    for w in workers:
        w.shutdown()


def test_corrupt_page_is_a_load_error_never_wrong_bytes(tmp_path):
    spec = make_spec(offloading_config(extra(tmp_path)))
    caches = kv_caches(16, [2], seed=4)
    manager, cw = spec.get_manager(), connector_worker(spec, caches)
    ks = keys(4)
    store(manager, cw, 1, ks, [0, 1, 2, 3])
    tier = cw.worker.transfers.tiers[0]
    slot = tier.directory.pin([ks[1]])[0][0]
    tier.directory.unpin([slot])
    fidx, off = tier.store.location(slot)
    with open(tier.store.files[fidx].path, "r+b") as f:  # flip one byte of page 1 on disk
        f.seek(off + 100)
        b = f.read(1)
        f.seek(off + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    before = block_bytes(caches, 0, 9)
    load(manager, cw, 2, ks, [8, 9, 10, 11])
    assert cw.worker.take_load_errors() == {2: [9]}  # for gdskv's connector: recompute block 9
    assert all(torch.equal(x, y) for x, y in zip(block_bytes(caches, 0, 9), before))
    for a, b in ((0, 8), (2, 10), (3, 11)):
        assert all(torch.equal(x, y) for x, y in zip(block_bytes(caches, 0, a),
                                                     block_bytes(caches, 0, b)))
    with manager.lock:  # the tier dropped the page; the manager reads that from the journal
        manager.refresh(force=True)
        assert manager.lookup(ks[1], CTX) is LookupResult.MISS
        assert manager.lookup(ks[0], CTX) is LookupResult.HIT
        assert [e.removed for e in manager.take_events()] == [False, True]
    cw.shutdown()


def test_store_failure_leaves_the_block_a_miss(tmp_path):
    """A store whose write fails finishes (vLLM's worker asserts nothing fails) and its keys
    never become hits."""
    spec = make_spec(offloading_config(extra(tmp_path, eviction="none",
                                             capacity=str(3 * 4 * 8192 + 8192))))
    caches = kv_caches(8, [4], seed=5)
    manager, cw = spec.get_manager(), connector_worker(spec, caches)
    ks = keys(5)
    store(manager, cw, 1, ks, [0, 1, 2, 3, 4])
    with manager.lock:
        hits = [manager.lookup(k, CTX) is LookupResult.HIT for k in ks]
    assert 0 < sum(hits) < 5  # the store holds fewer pages than were offered
    cw.shutdown()


def test_connector_reports_failed_blocks_to_the_scheduler(tmp_path):
    """GdskvOffloadingConnector's worker side (built without __init__, which needs a GPU
    VllmConfig; its checks are tested below): blocks that did not load come back from
    get_block_ids_with_load_errors with one KV group, their request in failed_recving with
    several."""
    for groups in (1, 2):
        d = tmp_path / f"g{groups}"
        d.mkdir()
        spec = make_spec(offloading_config(extra(d)))
        caches = kv_caches(8, [2], seed=6)
        manager, cw = spec.get_manager(), connector_worker(spec, caches)
        ks = keys(2)
        store(manager, cw, 1, ks, [0, 1])
        cw.worker.transfers.tiers[0].evict(ks)  # both pages gone between lookup and load
        conn = GdskvOffloadingConnector.__new__(GdskvOffloadingConnector)
        conn.connector_worker, conn._num_groups = cw, groups
        conn._load_reqs, conn._invalid_blocks = {}, set()
        with manager.lock:
            src = manager.prepare_load(ks, CTX)
        conn._connector_metadata = OffloadingConnectorMetadata({5: TransferJob(
            "req-9", src, GPULoadStoreSpec([4, 5], [2], [0]))}, {})
        conn.start_load_kv(None)
        cw.worker.wait({5})
        results = conn.get_transfer_results(set())
        assert results.finished_recving == {"req-9"}
        if groups == 1:
            assert results.failed_recving == set()
            assert conn.get_block_ids_with_load_errors() == {4, 5}
        else:
            assert results.failed_recving == {"req-9"}
            assert conn.get_block_ids_with_load_errors() == set()
        assert conn.get_block_ids_with_load_errors() == set()  # reported once
        cw.shutdown()


def _kv_cache_config(groups: int) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"layer{g}"], spec) for g in range(groups)])


@pytest.mark.parametrize("change, message", [
    (dict(kv_load_failure_policy="fail"), "kv_load_failure_policy"),
    (dict(extra={"spec_name": "CPUOffloadingSpec"}), "spec_name"),
    (dict(extra={"sync_load_budget_bytes": 1 << 20}, groups=2), "sync_load_budget_bytes"),
])
def test_connector_refuses_configs_it_cannot_serve(change, message):
    transfer = KVTransferConfig(
        kv_connector="GdskvOffloadingConnector", kv_role="kv_both",
        kv_connector_module_path="gdskv.adapters.vllm.connector",
        kv_load_failure_policy=change.get("kv_load_failure_policy", "recompute"),
        kv_connector_extra_config=dict(change.get("extra", {})))
    with pytest.raises(ValueError, match=message):
        GdskvOffloadingConnector(SimpleNamespace(kv_transfer_config=transfer),
                                 KVConnectorRole.WORKER, _kv_cache_config(change.get("groups", 1)))


def test_spec_refuses_unsupported_setups_at_start(tmp_path):
    with pytest.raises(ValueError, match="GdskvOffloadingConnector"):
        OffloadingSpecFactory.create_spec(offloading_config(extra(tmp_path)))
    with pytest.raises(ValueError, match="blocks_per_chunk=2"):
        make_spec(offloading_config(extra(tmp_path), blocks_per_chunk=2))
    with pytest.raises(ValueError, match="canonical"):
        make_spec(offloading_config(extra(tmp_path), canonical_layout=True))
    with pytest.raises(ConfigError,
                       match=r"unknown .* key 'capacityy' \(did you mean capacity\?\)"):
        make_spec(offloading_config({**SPEC, "gdskv": {"directories": str(tmp_path),
                                                       "capacityy": "1G"}}))
    with pytest.raises(ConfigError, match="capacity"):
        make_spec(offloading_config(extra(tmp_path, capacity="lots")))
    with pytest.raises(ConfigError, match="directories"):
        make_spec(offloading_config({**SPEC, "gdskv": {}}))
    with pytest.raises(ConfigError,
                       match=r"'.*/unmounted' does not exist \(an unmounted drive\?\)"):
        make_spec(offloading_config(extra(tmp_path / "unmounted")))
    # a group whose layers hold different bytes per block (e.g. attention + Mamba state)
    spec = make_spec(offloading_config(extra(tmp_path), groups=((0, 2),)))
    caches = kv_caches(4, [2])
    caches.group_data_refs[0][1].page_size_bytes //= 2
    with pytest.raises(ValueError, match="same bytes per block"):
        spec.get_worker(caches)


def test_a_job_whose_keys_do_not_match_its_blocks_moves_nothing(tmp_path):
    spec = make_spec(offloading_config(extra(tmp_path)))
    caches = kv_caches(8, [2], seed=8)
    manager, cw = spec.get_manager(), connector_worker(spec, caches)
    wrong_group, short = keys(2, group_id=3), keys(1)
    for job_id, ks in ((1, wrong_group), (2, short)):
        job = TransferJob("r", GPULoadStoreSpec([1, 2], [2], [0]), GdskvKeysSpec(ks))
        cw.prepare_store_kv(OffloadingConnectorMetadata({}, {job_id: job}))
        cw.start_kv_transfers(OffloadingConnectorMetadata({}, {}))
        run_until_done(cw, {job_id})  # finished, as vLLM's worker needs, with nothing stored
    tier = cw.worker.transfers.tiers[0]
    assert tier.stats()["pages_stored"] == 0 and tier.stats().get("bytes_written", 0) == 0
    cw.shutdown()


def test_cluster_store_replicas_share_blocks(tmp_path):
    """"cluster": true: two data-parallel replicas on one directory are two nodes of a cluster
    store. Replica 1's scheduler finds the blocks replica 0 stored, does not store them again,
    and its worker loads them bit-exact from replica 0's namespace."""
    from vllm_helpers import with_dp_index
    opts = extra(tmp_path, cluster=True, cluster_follow_ms=1, cluster_discovery_ms=1)
    specs = [make_spec(with_dp_index(offloading_config(opts), dp)) for dp in (0, 1)]
    caches = [kv_caches(8, [2], seed=30 + dp) for dp in (0, 1)]
    workers = [connector_worker(s, c) for s, c in zip(specs, caches)]
    managers = [s.get_manager() for s in specs]
    tiers = [s._worker.transfers.tiers[0] for s in specs]
    assert [t.node_id.split("-")[-1] for t in tiers] == ["dp0", "dp1"]
    ks = keys(2)
    assert store(managers[0], workers[0], 1, ks, [1, 2]) == ks
    with managers[1].lock:
        managers[1].refresh(force=True)
        assert [managers[1].lookup(k, CTX) for k in ks] == [LookupResult.HIT] * 2
        assert managers[1].prepare_store(ks, CTX).keys_to_store == []  # held by replica 0
    load(managers[1], workers[1], 2, ks, [5, 6])
    for a, b in ((1, 5), (2, 6)):
        assert all(torch.equal(x, y) for x, y in zip(block_bytes(caches[0], 0, a),
                                                     block_bytes(caches[1], 0, b)))
    assert tiers[1].stats()["cluster"]["peer_hits"] == 2
    assert len(tiers[1].own.directory) == 0
    for w in workers:
        w.shutdown()


def test_cluster_index_completes_a_block_across_replicas_and_forgets_a_reclaimed_one(tmp_path):
    """TP 2 x 2 replicas in a cluster: a block whose rank-0 share one replica stored and whose
    rank-1 share the other stored is a hit for both schedulers, and each worker rank loads its
    share from wherever it is. Once the replica holding a share is reclaimed, it is a miss."""
    import shutil

    from vllm_helpers import with_dp_index
    opts = extra(tmp_path, cluster=True, cluster_follow_ms=1, cluster_discovery_ms=1)
    cfgs = {(dp, r): with_dp_index(offloading_config(opts, rank=r, world_size=2), dp)
            for dp in (0, 1) for r in (0, 1)}
    specs = {k: make_spec(c) for k, c in cfgs.items()}
    caches = {k: kv_caches(8, [2], seed=40 + 2 * k[0] + k[1]) for k in cfgs}
    workers = {k: connector_worker(specs[k], caches[k]) for k in cfgs}
    managers = {dp: specs[(dp, 0)].get_manager() for dp in (0, 1)}
    ks = keys(2)
    with managers[0].lock:
        out = managers[0].prepare_store(ks, CTX)
    job = TransferJob("r", GPULoadStoreSpec([1, 2], [2], [0]), out.store_spec)
    for k in ((0, 0), (1, 1)):  # rank 0's share from replica 0, rank 1's from replica 1
        workers[k].prepare_store_kv(OffloadingConnectorMetadata({}, {1: job}))
        workers[k].start_kv_transfers(OffloadingConnectorMetadata({}, {}))
        run_until_done(workers[k], {1})
    for dp in (0, 1):
        with managers[dp].lock:
            managers[dp].refresh(force=True)
            assert [managers[dp].lookup(k, CTX) for k in ks] == [LookupResult.HIT] * 2
    for k in ((0, 1), (1, 0)):  # each loads the share it did not store, from the other
        specs[k]._worker.transfers.tiers[0].refresh()  # found the other's namespace by now
        load(managers[k[0]], workers[k], 2, ks, [5, 6])
        src = caches[(1 - k[0], k[1])]
        for a, b in ((1, 5), (2, 6)):
            assert all(torch.equal(x, y) for x, y in zip(block_bytes(src, 0, a),
                                                         block_bytes(caches[k], 0, b)))
    rank1_dir = specs[(1, 1)].store_dirs(specs[(1, 1)].config.groups[0])[1]
    replica1 = specs[(1, 1)]._worker.transfers.tiers[0].node_id
    for w in workers.values():
        w.shutdown()
    shutil.rmtree(f"{rank1_dir}/{replica1}")  # gdskv cluster reclaim, by hand
    with managers[0].lock:
        managers[0].refresh(force=True)
        assert [managers[0].lookup(k, CTX) for k in ks] == [LookupResult.MISS] * 2
