"""Hybrid models through SGLang's v2 storage interface, on SGLang's own classes: its host pools for
the sidecar pools (Mamba states, sliding-window KV, the DSA indexer, DeepSeek-V4 paged pools,
draft KV) built on CPU, and its real ``HybridCacheController`` driving the backup and prefetch
paths with gdskv created by ``StorageBackendFactory`` (as ``--hicache-storage-backend dynamic``
does).

Needs the sglang venv (tests/requirements-sglang.txt); skipped with that reason elsewhere.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading

import pytest
import torch

# the main venv has no sglang: these tests run in the sglang venv (tests/run_sglang.sh)
pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="sglang is not importable; see tests/requirements-sglang.txt")

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    STORAGE_BATCH_SIZE,
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from gdskv.adapters.sglang import GdskvHiCacheStorage  # noqa: E402
from sglang_pools import make_host_pool  # noqa: E402
from gdskv.config import ConfigError  # noqa: E402

PAGE = 4
LAYERS = 2
HEADS = 2
HEAD_DIM = 8
MLA_DIM = 24
HOST_PAGES = 400
DSA_PAGE = 64  # SGLang's DSA pools take 64-token pages only
ALL, TRAILING, BLOCKS = (PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES,
                         PoolHitPolicy.BLOCK_GROUPS)


@pytest.fixture(autouse=True)
def single_rank_parallel_state():
    """SGLang's device pools and controller read the parallel layout from its runtime
    context; a one-rank layout, as a server without TP/PP/DCP publishes it."""
    from sglang.srt.runtime_context import get_parallel
    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0, tp_size=1,
                                 pp_rank=0, pp_size=1):
        yield


# -- SGLang's host pools, built on CPU ----------------------------------------------------------
def kv_host(layout="page_first_direct", *, mla=False, page_size=PAGE, pages=HOST_PAGES,
            layers=LAYERS):
    return make_host_pool(mla=mla, layout=layout, page_size=page_size, layers=layers,
                          heads=HEADS, head_dim=HEAD_DIM, mla_dim=MLA_DIM, pages=pages)


def mamba_host(layout="page_first_direct", *, slots=32, side_state=False):
    """MambaPoolHost over CPU "device" states: temporal [layers, slots, heads, dim, state],
    one conv state, and (side_state) a registered per-slot side state."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
    extra = (torch.zeros(slots, 5, dtype=torch.int32),) if side_state else ()
    info = MambaStateBufferInfo(temporal=torch.zeros(3, slots, 2, 4, 8),
                                conv=(torch.zeros(3, slots, 6, 3, dtype=torch.bfloat16),),
                                extra_checkpoint_buffers=extra)
    return MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu",
                         layout=layout)


def swa_host(layout="page_first_direct"):
    """Sliding-window KV: SGLang builds it with build_kv_host_pool, i.e. the KV host pool
    class over the SWA layers."""
    return make_host_pool(mla=False, layout=layout, page_size=PAGE, layers=1, heads=HEADS,
                          head_dim=HEAD_DIM, mla_dim=MLA_DIM, pages=HOST_PAGES)


def dsa_device(page_size=DSA_PAGE, pages=4, layers=LAYERS):
    """SGLang's DSA (DeepSeek V3.2) device pool on CPU: MLA KV plus the indexer's buffers."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    return DSATokenToKVPool(size=pages * page_size, page_size=page_size, kv_lora_rank=16,
                            dtype=torch.bfloat16, qk_rope_head_dim=8, layer_num=layers,
                            device="cpu", index_head_dim=128, enable_memory_saver=False,
                            kv_cache_dim=MLA_DIM)


def indexer_host(anchor, dev=None):
    """DSA indexer host pool over a CPU DSATokenToKVPool, slots as the MLA anchor's (whose
    pages must be DSA_PAGE tokens)."""
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost, make_dsa_indexer_pool_decl
    dev = dev if dev is not None else dsa_device(anchor.page_size)
    return DSAIndexerPoolHost(make_dsa_indexer_pool_decl(dev), anchor, pin_memory=False,
                              device="cpu")


def dsv4_host(layout="page_first", name="deepseek_v4_c4", page_size=PAGE, pages=HOST_PAGES):
    """DeepSeek-V4 paged host pool (compressed KV / indexer pools) over 3 CPU layers."""
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool
    bufs = [torch.zeros(8, 2, 48, dtype=torch.uint8) for _ in range(3)]
    return DeepSeekV4PagedHostPool(name, bufs, item_bytes=96, num_host_pages=pages,
                                   slot_page_size=page_size, layout=layout, device="cpu",
                                   pin_memory=False)


def pool_buffers(pool) -> list[torch.Tensor]:
    getter = getattr(pool, "get_hybrid_pool_buffer", None)
    bufs = list(getter()) if callable(getter) else []
    kv = getattr(pool, "kv_buffer", None)
    bufs += [kv] if isinstance(kv, torch.Tensor) else list(kv or [])
    bufs += list(getattr(pool, "slot_state_buffers", []) or [])
    return [b for b in bufs if b.numel()]


def fill_random(pool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for b in pool_buffers(pool):
        raw = b.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def page_of(pool, start: int) -> torch.Tensor:
    """SGLang's own accessor for one host page's bytes."""
    return pool.get_data_page(start, flat=True).contiguous().view(torch.uint8).clone()


def meta_page(pool, start: int) -> torch.Tensor:
    """The bytes SGLang's zero-copy backends transfer for one page (get_page_buffer_meta)."""
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(start, start + pool.page_size))
    return torch.cat([torch.frombuffer((ctypes.c_uint8 * s).from_address(p),
                                       dtype=torch.uint8).clone() for p, s in zip(ptrs, sizes)])


def slots(pool, pages: list[int]) -> torch.Tensor:
    ps = pool.page_size
    return torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in pages]).to(torch.int64)


def page_hashes(num_pages: int, seed: int = 0) -> list[str]:
    from sglang.srt.mem_cache.utils import get_hash_str
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32000, (num_pages * PAGE,), generator=g).tolist()
    return list(get_hash_str(tokens, None, page_size=PAGE))


# -- the backend, created as SGLang creates it -------------------------------------------------
def storage_config(tmp_path, *, mla=False, tp_rank=0, tp_size=1, **extra):
    d = tmp_path / "l3"
    d.mkdir(exist_ok=True)
    cfg = {"backend_name": "gdskv", "module_path": "gdskv.adapters.sglang",
           "class_name": "GdskvHiCacheStorage", "interface_v1": 1, "directories": str(d),
           "capacity": "16MiB", "staging_size": "256KiB", "io_chunk_size": "64KiB",
           "io_threads": 2, "files_per_dir": 2, "backend": "posix"}
    cfg.update(extra)
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1,
                                attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
                                enable_storage_metrics=False, is_page_first_layout=True,
                                model_name="org/tiny-hybrid", extra_config=cfg)


def attach(config, kv_pool, sidecars: dict):
    """What HybridCacheController.attach_storage_backend does: factory, the anchor, the v2
    burst (the KV entry included), then on_host_pools_registered."""
    backend = StorageBackendFactory.create_backend("dynamic", config, kv_pool)
    backend.register_mem_pool_host(kv_pool)
    backend.register_mem_host_pool_v2(kv_pool, PoolName.KV)
    for name, pool in sidecars.items():
        backend.register_mem_host_pool_v2(pool, name)
    backend.on_host_pools_registered()
    return backend


def in_batches(keys, host_indices, page_size):
    for i in range(0, len(keys), STORAGE_BATCH_SIZE):
        batch = keys[i:i + STORAGE_BATCH_SIZE]
        yield batch, host_indices[i * page_size:(i + len(batch)) * page_size]


# -- 1. every sidecar pool class and layout: bit-exact round trips ------------------------------
def _mamba(layout, side=False):
    return lambda kv: mamba_host(layout, slots=HOST_PAGES, side_state=side)


def _indexer(kv):
    return indexer_host(kv)


POOL_CASES = {
    # name: (pool name, KV is MLA, KV layout, sidecar builder, expected mode); the indexer's
    # KV pool has DSA_PAGE-token pages
    "mamba-page_first": (PoolName.MAMBA, False, "page_first", _mamba("page_first"), "regions"),
    "mamba-page_first_direct": (PoolName.MAMBA, False, "page_first_direct",
                                _mamba("page_first_direct"), "regions"),
    "mamba-side-state": (PoolName.MAMBA, False, "page_first_direct",
                         _mamba("page_first_direct", side=True), "flat"),
    "swa-page_first": (PoolName.SWA, False, "page_first", lambda kv: swa_host("page_first"),
                       "regions"),
    "swa-page_first_direct": (PoolName.SWA, False, "page_first_direct",
                              lambda kv: swa_host("page_first_direct"), "regions"),
    "swa-layer_first": (PoolName.SWA, False, "layer_first", lambda kv: swa_host("layer_first"),
                        "regions"),
    "indexer-page_first_direct": (PoolName.INDEXER, True, "page_first_direct", _indexer,
                                  "regions"),
    "indexer-page_first": (PoolName.INDEXER, True, "page_first", _indexer, "regions"),
    "indexer-layer_first": (PoolName.INDEXER, True, "layer_first", _indexer, "flat"),
    "dsv4-c4-page_first": (PoolName.DEEPSEEK_V4_C4, True, "page_first",
                           lambda kv: dsv4_host("page_first"), "regions"),
    "dsv4-c4-page_first_direct": (PoolName.DEEPSEEK_V4_C4, True, "page_first_direct",
                                  lambda kv: dsv4_host("page_first_direct"), "regions"),
    "dsv4-c4-layer_first": (PoolName.DEEPSEEK_V4_C4, True, "layer_first",
                            lambda kv: dsv4_host("layer_first"), "regions"),
    "draft-mha": (PoolName.DRAFT, False, "page_first_direct",
                  lambda kv: kv_host("page_first_direct"), "regions"),
}


@pytest.mark.parametrize("case", list(POOL_CASES))
def test_sidecar_round_trip_on_sglangs_pool_classes(tmp_path, case):
    name, mla, layout, build, mode = POOL_CASES[case]
    kv_page = DSA_PAGE if name == PoolName.INDEXER else PAGE
    src_kv = kv_host(layout, mla=mla, page_size=kv_page)
    dst_kv = kv_host(layout, mla=mla, page_size=kv_page)
    src, dst = build(src_kv), build(dst_kv)
    assert type(src).__module__.startswith("sglang.")
    fill_random(src, seed=1)
    fill_random(src_kv, seed=4)
    n = 150  # more than one controller batch
    g = torch.Generator().manual_seed(2)
    limit = src.size // src.page_size
    src_pages = torch.randperm(limit, generator=g)[:n].tolist()
    dst_pages = torch.randperm(limit, generator=g)[:n].tolist()
    keys = page_hashes(n, seed=3)

    writer = attach(storage_config(tmp_path, mla=mla), src_kv, {name: src})
    try:
        side = writer.sidecars[str(name.value)]
        assert side.pool.mode == mode
        assert side.pool.page_bytes == src.get_dummy_flat_data_page().numel() * \
            src.get_dummy_flat_data_page().element_size()
        for batch, idx in in_batches(keys, slots(src, src_pages), src.page_size):
            res = writer.batch_set_v2([PoolTransfer(name=name, host_indices=idx, keys=batch)])
            assert res == {name: [True] * len(batch)}
        # What is stored is what SGLang's own backends move for the page: the zero-copy
        # regions in regions mode, get_data_page in flat mode. The DSA indexer in
        # page_first_direct rides in the KV page: the stored page is the KV page, then it.
        assert side.in_kv_page == (case == "indexer-page_first_direct")
        tier = side.store.tier
        stored = torch.empty(3, tier.layout.page_bytes, dtype=torch.uint8)
        kv_bytes = tier.layout.page_bytes - side.pool.page_bytes
        assert kv_bytes == (writer.kv_layout.page_bytes if side.in_kv_page else 0)
        assert tier.get_pages(side.storage_keys(keys[:3]), [[stored[i]] for i in range(3)]) == \
            [True] * 3
        for i in range(3):
            start = src_pages[i] * src.page_size
            want = meta_page(src, start) if mode == "regions" else page_of(src, start)
            assert torch.equal(stored[i, kv_bytes:], want)
            if side.in_kv_page:
                assert torch.equal(stored[i, :kv_bytes], meta_page(src_kv, start))
    finally:
        writer.close()

    # A restarted server (new backend over the same directories) reads them into other slots.
    reader = attach(storage_config(tmp_path, mla=mla), dst_kv, {name: dst})
    try:
        for batch, idx in in_batches(keys, slots(dst, dst_pages), dst.page_size):
            res = reader.batch_get_v2([PoolTransfer(name=name, host_indices=idx, keys=batch)])
            assert res == {name: [True] * len(batch)}
        for s, d in zip(src_pages, dst_pages):
            assert torch.equal(page_of(src, s * src.page_size), page_of(dst, d * dst.page_size))
        assert reader.pool_stats()[str(name.value)]["recovered_pages"] == n
    finally:
        reader.close()


# -- 2. SGLang's real HybridCacheController drives backup and prefetch -------------------------
@contextlib.contextmanager
def hybrid_controller(tmp_path, entries, *, dev=None, **extra):
    """HybridCacheController built on CPU over a HostPoolGroup of SGLang's host pools (an MHA
    device pool unless ``dev`` is given), storage attached at construction
    (``--hicache-storage-backend dynamic``); detached on exit."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry
    if dev is None:
        dev = MHATokenToKVPool(size=64, page_size=PAGE, dtype=torch.bfloat16, head_num=HEADS,
                               head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu",
                               enable_memory_saver=False, enable_alt_stream=False)
    page = entries[PoolName.KV].page_size
    allocator = PagedTokenToKVPoolAllocator(dev.size, page, torch.bfloat16, "cpu", dev,
                                            need_sort=False)
    group = HostPoolGroup([PoolEntry(name=name, host_pool=pool, device_pool=dev,
                                     layer_mapper=lambda i: i,
                                     is_primary_index_anchor=name == PoolName.KV)
                           for name, pool in entries.items()])
    cfg = storage_config(tmp_path, **extra).extra_config
    ctrl = HybridCacheController(allocator, group, page, None, threading.Event(),
                                 io_backend="direct", storage_backend="dynamic",
                                 model_name="org/tiny-hybrid", storage_backend_extra_config=cfg,
                                 write_policy="write_through")
    try:
        yield ctrl
    finally:
        ctrl.detach_storage_backend()


def controller_backup(ctrl, tokens, hashes, host_indices, extra_pools):
    """HybridCacheController.write_storage; returns the finished operation."""
    ctrl.write_storage(host_indices, tokens, hash_value=hashes, prefix_keys=None,
                       extra_pools=extra_pools)
    return ctrl.ack_backup_queue.get(timeout=60)


def controller_prefetch(ctrl, tokens, extra_pools, rid="r", page=PAGE):
    """HybridCacheController.prefetch, the scheduler's part (host slots for the hit, as the
    radix cache allocates them), then the controller's transfer; returns (operation, anchor
    host indices, completed tokens, per-pool hits)."""
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    ctrl.prefetch(CacheRequestHandle(rid, 0), tokens, None, None, extra_pools=extra_pools)
    op = ctrl.prefetch_hit_queue.get(timeout=60)
    hit = op.storage_hit_count
    if hit == 0:
        return op, None, 0, {}
    host = ctrl.mem_pool_host.alloc(hit)
    op.host_indices = host
    for t in op.pool_transfers or []:
        if t.indices_from_pool is None:  # pools with slots of their own (Mamba, SWA)
            pool = ctrl.mem_pool_host.entry_map[t.name].host_pool
            want = min(len(t.keys), hit // page) * pool.page_size
            t.host_indices = pool.alloc(want)
    ctrl.prefetch_buffer.put(op)
    completed, pool_hits = 0, {}
    while True:
        ack = ctrl.ack_prefetch_queue.get(timeout=60)
        if ack.completed_tokens is not None:
            completed = ack.completed_tokens
        if ack.pool_hits is not None:
            pool_hits = {str(getattr(k, "value", k)): v for k, v in ack.pool_hits.items()}
        if ack.completed_req:
            return op, host, completed, pool_hits


def test_controller_mamba_and_draft_backup_restart_prefetch(tmp_path):
    """A Qwen3-Next-style model with an MTP draft: KV (v1) + Mamba state (TRAILING_PAGES, own
    slots) + draft KV (ALL_PAGES, KV-derived), written and read back by the real controller,
    across a restart."""
    n = 150
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 32000, (n * PAGE,), generator=g).tolist()

    def entries():
        return {PoolName.KV: kv_host(), PoolName.MAMBA: mamba_host(slots=8),
                PoolName.DRAFT: kv_host()}

    src = entries()
    for pool in src.values():
        fill_random(pool, seed=5)
    with hybrid_controller(tmp_path, src) as ctrl:
        host = ctrl.mem_pool_host.alloc(n * PAGE)
        mslot = src[PoolName.MAMBA].alloc(1)
        from sglang.srt.mem_cache.utils import get_hash_str
        hashes = get_hash_str(tokens, None, page_size=PAGE)
        op = controller_backup(ctrl, tokens, hashes, host, [
            PoolTransfer(name=PoolName.MAMBA, host_indices=mslot, keys=[hashes[-1]],
                         hit_policy=TRAILING),
            PoolTransfer(name=PoolName.DRAFT, indices_from_pool=PoolName.KV, hit_policy=ALL)])
        assert op.completed_tokens == n * PAGE
        assert op.pool_storage_result.extra_pool_hit_pages == {PoolName.MAMBA: 1,
                                                                PoolName.DRAFT: n}

    dst = entries()
    with hybrid_controller(tmp_path, dst) as ctrl:  # a restarted server
        op, host2, completed, hits = controller_prefetch(ctrl, tokens, [
            PoolTransfer(name=PoolName.MAMBA, keys=["__placeholder__"], hit_policy=TRAILING),
            PoolTransfer(name=PoolName.DRAFT, indices_from_pool=PoolName.KV, hit_policy=ALL)])
        # The state exists only at the end of the span: that is the one stop point.
        assert op.pool_storage_result.restorable_prefix_pages == [n]
        assert completed == n * PAGE and hits["mamba"] == 1
        for kv in (PoolName.KV, PoolName.DRAFT):
            for a, b in zip(host[::PAGE].tolist(), host2[::PAGE].tolist()):
                assert torch.equal(page_of(src[kv], a), page_of(dst[kv], b))
        assert torch.equal(page_of(src[PoolName.MAMBA], int(mslot[0])),
                           page_of(dst[PoolName.MAMBA], int(op.pool_transfers[0].host_indices[0])))


@pytest.mark.parametrize("layers", [LAYERS, 4])
def test_controller_dsa_indexer_rides_in_the_kv_page(tmp_path, layers):
    """DeepSeek V3.2 (MLA KV + the DSA indexer: KV-derived, ALL_PAGES) by the real controller:
    the indexer's page is stored in its KV page (one store, one read, one checksum), written by
    the controller's batch_set_v2 and read by its batch_get_v1; the batch_get_v2 that follows
    each KV batch reads nothing more. Bit-exact across a restart.

    With 4 layers the KV page is whole 4 KiB blocks (4 x 64 tokens x 48 B), as a real model's
    is, so under O_DIRECT it moves in place out of SGLang's page-aligned host pool and the
    indexer's page, whose slots start at unaligned addresses, through a scratch row in the same
    I/O; with 2 layers (6 KiB) the page goes through staging."""
    from sglang.srt.mem_cache.utils import get_hash_str
    n = 150  # two controller batches
    g = torch.Generator().manual_seed(30)
    tokens = torch.randint(0, 32000, (n * DSA_PAGE,), generator=g).tolist()
    hashes = get_hash_str(tokens, None, page_size=DSA_PAGE)
    indexer = [PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV,
                            hit_policy=ALL)]

    def entries():
        dev = dsa_device(layers=layers)
        kv = kv_host(mla=True, page_size=DSA_PAGE, layers=layers)
        return dev, {PoolName.KV: kv, PoolName.INDEXER: indexer_host(kv, dev)}

    def moved_in_place(tier, direction: str) -> bool:
        """Whether every page moved in place (else: staged), checked against the rule."""
        st = tier.stats()
        in_place, staged = (st.get(f"pages_{direction}_in_place", 0),
                            st.get(f"region_pages_{direction}_staged", 0))
        assert in_place + staged == n
        return staged == 0

    dev, src = entries()
    for pool in src.values():
        fill_random(pool, seed=31)
    with hybrid_controller(tmp_path, src, dev=dev) as ctrl:
        b = ctrl.storage_backend
        assert b.sidecars_in_kv_page() == ["indexer"] and b.is_mla
        host = ctrl.mem_pool_host.alloc(n * DSA_PAGE)
        op = controller_backup(ctrl, tokens, hashes, host, [PoolTransfer(**vars(t))
                                                            for t in indexer])
        assert op.completed_tokens == n * DSA_PAGE
        assert op.pool_storage_result.extra_pool_hit_pages == {PoolName.INDEXER: n}
        assert b.tier.stats()["pages_stored"] == n
        direct = b.tier.store.direct
        whole_blocks = layers * DSA_PAGE * MLA_DIM * 2 % 4096 == 0
        assert moved_in_place(b.tier, "written") == (whole_blocks or not direct)
    model_dir = tmp_path / "l3" / "org-tiny-hybrid"
    assert sorted(p.name for p in model_dir.iterdir()) == ["kv+indexer"]

    dev, dst = entries()
    with hybrid_controller(tmp_path, dst, dev=dev) as ctrl:  # a restarted server
        tier = ctrl.storage_backend.tier
        read_before = tier.stats().get("hits", 0)
        op, host2, completed, hits = controller_prefetch(
            ctrl, tokens, [PoolTransfer(**vars(t)) for t in indexer], page=DSA_PAGE)
        assert completed == n * DSA_PAGE
        assert tier.stats()["hits"] - read_before == n  # each page read once
        assert moved_in_place(tier, "read") == (whole_blocks or not direct)
        for name in (PoolName.KV, PoolName.INDEXER):
            for a, c in zip(host[::DSA_PAGE].tolist(), host2[::DSA_PAGE].tolist()):
                assert torch.equal(page_of(src[name], a), page_of(dst[name], c))


def test_controller_sliding_window_pool(tmp_path):
    """Sliding-window KV (TRAILING_PAGES over a 3-page window, own slots) by the real
    controller; a prefetch of a longer span stops at the stored window's end."""
    n, window = 20, 3
    g = torch.Generator().manual_seed(6)
    tokens = torch.randint(0, 32000, ((n + 5) * PAGE,), generator=g).tolist()
    src = {PoolName.KV: kv_host(), PoolName.SWA: swa_host()}
    fill_random(src[PoolName.SWA], seed=7)
    fill_random(src[PoolName.KV], seed=8)
    from sglang.srt.mem_cache.utils import get_hash_str
    hashes = get_hash_str(tokens[:n * PAGE], None, page_size=PAGE)
    with hybrid_controller(tmp_path, src) as ctrl:
        host = ctrl.mem_pool_host.alloc(n * PAGE)
        swa_slots = src[PoolName.SWA].alloc(window * PAGE)
        op = controller_backup(ctrl, tokens[:n * PAGE], hashes, host, [
            PoolTransfer(name=PoolName.SWA, host_indices=swa_slots, keys=hashes[-window:],
                         hit_policy=TRAILING)])
        assert op.completed_tokens == n * PAGE
        # read back into other slots of the pool (random bytes until then)
        op, _, completed, hits = controller_prefetch(ctrl, tokens, [
            PoolTransfer(name=PoolName.SWA, keys=["__placeholder__"] * window,
                         hit_policy=TRAILING)])
        assert op.storage_hit_count == n * PAGE and completed == n * PAGE
        assert op.pool_storage_result.restorable_prefix_pages == [n]
        assert hits["swa"] == window
        got = op.pool_transfers[0].host_indices
        assert not set(got.tolist()) & set(swa_slots.tolist())
        for a, b in zip(swa_slots[::PAGE].tolist(), got[::PAGE].tolist()):
            assert torch.equal(page_of(src[PoolName.SWA], a), page_of(src[PoolName.SWA], b))


# -- 3. hit policies on real stores: edge cases --------------------------------------------------
def write_kv(backend, keys, kv_pool, pages):
    for batch, idx in in_batches(keys, slots(kv_pool, pages), kv_pool.page_size):
        assert all(backend.batch_set_v1(batch, idx))


def test_trailing_page_missing_shortens_the_prefix(tmp_path):
    """Mamba states exist at the ends of pages 4, 8 and 12 (one per radix node, as SGLang
    writes them); the state at 12 evicted: the usable prefix falls back to 8, not to a KV hit
    without its state."""
    kv, mamba = kv_host(), mamba_host(slots=16)
    fill_random(mamba, seed=9)
    keys = page_hashes(12, seed=10)
    b = attach(storage_config(tmp_path), kv, {PoolName.MAMBA: mamba})
    try:
        write_kv(b, keys, kv, list(range(12)))
        for i, end in enumerate((4, 8, 12)):
            res = b.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, hit_policy=TRAILING,
                                               host_indices=torch.tensor([i]),
                                               keys=[keys[end - 1]])])
            assert res == {PoolName.MAMBA: [True]}
        query = [PoolTransfer(name=PoolName.MAMBA, keys=["__placeholder__"],
                              hit_policy=TRAILING)]
        r = b.batch_exists_v2(keys, query)
        assert (r.kv_hit_pages, r.restorable_prefix_pages) == (12, [4, 8, 12])
        assert r.extra_pool_hit_pages == {PoolName.KV: 12, PoolName.MAMBA: 12}
        side = b.sidecars["mamba"]
        assert side.store.tier.evict(side.storage_keys([keys[11]])) == 1
        r = b.batch_exists_v2(keys, query)
        assert (r.kv_hit_pages, r.restorable_prefix_pages) == (8, [4, 8])
        assert b.batch_exists(keys) == 12  # the KV pages themselves are all there
        # the evicted state reads as a miss and leaves the target slot alone
        target = torch.tensor([15])
        before = page_of(mamba, 15)
        assert b.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=target,
                                            keys=[keys[11]])]) == {PoolName.MAMBA: [False]}
        assert torch.equal(page_of(mamba, 15), before)
        assert b.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=target,
                                            keys=[keys[7]])]) == {PoolName.MAMBA: [True]}
        assert torch.equal(page_of(mamba, 15), page_of(mamba, 1))
    finally:
        b.close()


def test_sliding_window_holes(tmp_path):
    """A 2-page window: the prefix lengths whose last two pages are stored, and only those."""
    kv, swa = kv_host(), swa_host()
    keys = page_hashes(6, seed=11)
    b = attach(storage_config(tmp_path), kv, {PoolName.SWA: swa})
    try:
        write_kv(b, keys, kv, list(range(6)))
        present = [0, 1, 3, 4, 5]  # page 2's window page is missing
        res = b.batch_set_v2([PoolTransfer(name=PoolName.SWA, hit_policy=TRAILING,
                                           host_indices=slots(swa, present),
                                           keys=[keys[i] for i in present])])
        assert res == {PoolName.SWA: [True] * 5}
        r = b.batch_exists_v2(keys, [PoolTransfer(name=PoolName.SWA, keys=["a", "b"],
                                                  hit_policy=TRAILING)])
        assert (r.kv_hit_pages, r.restorable_prefix_pages) == (6, [1, 2, 5, 6])
    finally:
        b.close()


def test_sidecar_evicted_while_kv_stays_is_no_hit(tmp_path):
    """DeepSeek V3.2: MLA KV + DSA indexer (ALL_PAGES). The indexer store is small, so LRU
    evicts the oldest indexer pages while their KV stays: those pages are no hit, and a page
    evicted in the middle cuts the prefix there."""
    kv = kv_host(mla=True, page_size=DSA_PAGE)
    idx_pool = indexer_host(kv)
    fill_random(idx_pool, seed=12)
    page_bytes = idx_pool.get_dummy_flat_data_page().numel()
    keys = page_hashes(100, seed=13)
    b = attach(storage_config(tmp_path, mla=True,
                              pool_capacity={"indexer": 70 * (page_bytes + 4095) // 4096 * 4096}),
               kv, {PoolName.INDEXER: idx_pool})
    try:
        write_kv(b, keys, kv, list(range(100)))
        tier = b.sidecars["indexer"].store.tier
        assert tier.store.num_slots < 100
        for i in range(0, 100, 20):  # five backups; the oldest pages are evicted by the last
            res = b.batch_set_v2([PoolTransfer(name=PoolName.INDEXER, hit_policy=ALL,
                                               host_indices=slots(idx_pool, list(range(i, i + 20))),
                                               keys=keys[i:i + 20])])
            assert res[PoolName.INDEXER] == [True] * 20
        query = [PoolTransfer(name=PoolName.INDEXER, hit_policy=ALL)]
        assert b.batch_exists(keys) == 100
        r = b.batch_exists_v2(keys, query)
        assert (r.kv_hit_pages, r.restorable_prefix_pages) == (0, [])
        assert PoolName.INDEXER not in r.extra_pool_hit_pages
        got = b.batch_get_v2([PoolTransfer(name=PoolName.INDEXER, keys=keys[:5],
                                           host_indices=slots(idx_pool, list(range(200, 205))))])
        assert got == {PoolName.INDEXER: [False] * 5}
        # The newest pages are all there; one evicted in their middle cuts the prefix.
        tail = keys[100 - tier.store.num_slots:]
        r = b.batch_exists_v2(tail, query)
        assert r.kv_hit_pages == len(tail)
        assert tier.evict(b.sidecars["indexer"].storage_keys([tail[10]])) == 1
        r = b.batch_exists_v2(tail, query)
        assert (r.kv_hit_pages, r.extra_pool_hit_pages[PoolName.INDEXER]) == (10, 10)
    finally:
        b.close()


def test_indexer_in_the_kv_page_edge_cases(tmp_path):
    """The DSA indexer stored in its KV page: written whole by its batch_set_v2 (a KV page
    written alone would carry whatever the indexer's slots held, so batch_set_v1 only reports
    what is stored), evicted with its KV, and a batch_get_v2 answered from the KV read only
    when that read was this thread's last one, of the same keys into the same slots."""
    kv = kv_host(mla=True, page_size=DSA_PAGE)
    idx = indexer_host(kv)
    fill_random(kv, seed=32)
    fill_random(idx, seed=33)
    keys = page_hashes(6, seed=34)
    b = attach(storage_config(tmp_path, mla=True), kv, {PoolName.INDEXER: idx})
    try:
        assert b.sidecars_in_kv_page() == ["indexer"]
        tier = b.tier
        assert b.batch_set_v1(keys, slots(kv, range(6))) == [False] * 6
        assert tier.stats()["pages_stored"] == 0
        assert b.batch_set_v2([PoolTransfer(name=PoolName.INDEXER, keys=keys,
                                            host_indices=slots(idx, range(6)))]) == \
            {PoolName.INDEXER: [True] * 6}
        assert b.batch_set_v1(keys, slots(kv, range(6))) == [True] * 6
        assert tier.stats()["pages_stored"] == 6
        query = [PoolTransfer(name=PoolName.INDEXER, hit_policy=ALL)]
        assert b.batch_exists_v2(keys, query).kv_hit_pages == 6

        def reads():
            return tier.stats().get("hits", 0)

        def same(dst_pages, src_pages=range(6), pools=(kv, idx)):
            return all(torch.equal(page_of(p, d * DSA_PAGE), page_of(p, s * DSA_PAGE))
                       for p in pools for d, s in zip(dst_pages, src_pages))

        def get_v2(keys_, pages):
            return b.batch_get_v2([PoolTransfer(name=PoolName.INDEXER, keys=keys_,
                                                host_indices=slots(idx, pages))])

        # v1 then v2 of the same keys and slots: one read
        r = reads()
        assert b.batch_get_v1(keys, slots(kv, range(10, 16))) == [True] * 6
        assert get_v2(keys, range(10, 16)) == {PoolName.INDEXER: [True] * 6}
        assert reads() - r == 6 and same(range(10, 16))
        # ...once: the next v2 call reads again
        assert get_v2(keys, range(10, 16)) == {PoolName.INDEXER: [True] * 6}
        assert reads() - r == 12
        # other slots than the KV read's: read on its own, into those slots only
        assert b.batch_get_v1(keys, slots(kv, range(20, 26))) == [True] * 6
        r = reads()
        assert get_v2(keys, range(30, 36)) == {PoolName.INDEXER: [True] * 6}
        assert reads() - r == 6 and same(range(30, 36), pools=(idx,))
        # a KV read of other keys in between: the earlier read answers nothing
        assert b.batch_get_v1(keys[:3], slots(kv, range(40, 43))) == [True] * 3
        assert b.batch_get_v1(keys[3:], slots(kv, range(43, 46))) == [True] * 3
        r = reads()
        assert get_v2(keys[:3], range(40, 43)) == {PoolName.INDEXER: [True] * 3}
        assert reads() - r == 3
        # another thread's KV read answers nothing for this one
        assert b.batch_get_v1(keys, slots(kv, range(50, 56))) == [True] * 6
        out = {}
        worker = threading.Thread(target=lambda: out.update(get_v2(keys, range(50, 56))))
        r = reads()
        worker.start()
        worker.join()
        assert out == {PoolName.INDEXER: [True] * 6} and reads() - r == 6
        # eviction takes the KV page and its indexer together
        assert tier.evict(b._storage_keys([keys[2]])) == 1
        assert b.batch_exists(keys) == 2 and b.batch_exists_v2(keys, query).kv_hit_pages == 2
        assert b.batch_get_v1(keys, slots(kv, range(60, 66))) == [True, True, False] + [True] * 3
        assert get_v2(keys, range(60, 66)) == {PoolName.INDEXER: [True, True, False, True, True,
                                                                    True]}
        # SGLang's storage metrics count the bytes each call moved: the v2 answer moved none
        b.enable_metrics = True
        b.get_stats()  # drained
        assert b.batch_get_v1(keys[:2], slots(kv, range(70, 72))) == [True, True]
        assert get_v2(keys[:2], range(70, 72)) == {PoolName.INDEXER: [True, True]}
        assert b.batch_set_v1(keys[:2], slots(kv, range(70, 72))) == [True, True]
        m = b.get_stats()
        assert m.prefetch_pgs == [2] and m.backup_pgs == []
        # the per-page calls cannot take a KV page alone: refused, never a wrong page
        assert b.batch_get(keys[:1], [kv.get_dummy_flat_data_page()]) == [None]
        assert b.batch_set(keys[:1], [page_of(kv, 0)]) is False
    finally:
        b.close()


def test_indexer_in_a_store_of_its_own_when_asked(tmp_path):
    """"sidecar_in_kv_page": false (or a pool_capacity of its own, SGLang's per-page calls, or
    a layout whose KV page is not moved whole) keeps the indexer in a store of its own."""
    for case, (extra, layout) in enumerate((
            ({"sidecar_in_kv_page": False}, "page_first_direct"),
            ({"pool_capacity": {"indexer": "4MiB"}}, "page_first_direct"),
            ({"interface_v1": 0}, "page_first_direct"),  # SGLang's per-page calls: KV alone
            ({}, "page_first"))):
        kv = kv_host(layout, mla=True, page_size=DSA_PAGE)
        (tmp_path / str(case)).mkdir()
        b = attach(storage_config(tmp_path / str(case), mla=True, **extra), kv,
                   {PoolName.INDEXER: indexer_host(kv)})
        try:
            assert b.sidecars_in_kv_page() == []
            assert b.sidecars["indexer"].store is not b._kv_store
            assert b.tier.layout == b.kv_layout
        finally:
            b.close()


def test_block_groups_report_complete_groups_without_gating(tmp_path):
    """A compressed pool (DeepSeek-V4 style) with BLOCK_GROUPS: one key per group covering 2
    FULL pages. The pool's verdict is its leading complete groups; an incomplete group never
    shortens the KV hit."""
    kv, c4 = kv_host(mla=True), dsv4_host("page_first", page_size=PAGE)
    fill_random(c4, seed=14)
    keys = page_hashes(8, seed=15)
    group_keys = [f"{keys[2 * g + 1]}" for g in range(4)]  # a group ends on an odd page
    b = attach(storage_config(tmp_path, mla=True), kv, {PoolName.DEEPSEEK_V4_C4: c4})
    try:
        write_kv(b, keys, kv, list(range(8)))
        res = b.batch_set_v2([PoolTransfer(name=PoolName.DEEPSEEK_V4_C4,
                                           host_indices=slots(c4, [0, 1, 2, 3]),
                                           keys=group_keys)])
        assert res == {PoolName.DEEPSEEK_V4_C4: [True] * 4}
        query = [PoolTransfer(name=PoolName.DEEPSEEK_V4_C4, keys=group_keys,
                              hit_policy=BLOCKS, block_pages=2, group_pages=1)]
        r = b.batch_exists_v2(keys, query)
        assert r.kv_hit_pages == 8 and r.extra_pool_hit_pages[PoolName.DEEPSEEK_V4_C4] == 8
        b.sidecars["deepseek_v4_c4"].store.tier.evict(
            b.sidecars["deepseek_v4_c4"].storage_keys([group_keys[2]]))
        r = b.batch_exists_v2(keys, query)
        assert r.kv_hit_pages == 8 and r.restorable_prefix_pages == list(range(1, 9))
        assert r.extra_pool_hit_pages[PoolName.DEEPSEEK_V4_C4] == 4  # groups 0 and 1
        two_per_group = [PoolTransfer(name=PoolName.DEEPSEEK_V4_C4, keys=group_keys,
                                      hit_policy=BLOCKS, block_pages=4, group_pages=2)]
        r = b.batch_exists_v2(keys, two_per_group)  # group 1 (keys 2, 3) is incomplete
        assert r.extra_pool_hit_pages[PoolName.DEEPSEEK_V4_C4] == 4 and r.kv_hit_pages == 8
    finally:
        b.close()


# -- 4. MLA with TP=2: replicated sidecars follow the writer, Mamba stays per rank ---------------
def catch_up(backend) -> None:
    """Followers catch up with the writer's journal by themselves at most every 50 ms; now."""
    for tier in [backend.tier] + [side.store.open() for side in backend.sidecars.values()]:
        if tier is not None and tier.read_only:
            tier.refresh()


def test_mla_tp2_indexer_followed_mamba_per_rank(tmp_path):
    kv0, kv1 = kv_host(mla=True, page_size=DSA_PAGE), kv_host(mla=True, page_size=DSA_PAGE)
    idx0, idx1 = indexer_host(kv0), indexer_host(kv1)
    m0, m1 = mamba_host(slots=8), mamba_host(slots=8)
    for p, s in ((idx0, 16), (m0, 17), (m1, 18)):
        fill_random(p, seed=s)
    keys = page_hashes(10, seed=19)
    r0 = attach(storage_config(tmp_path, mla=True, tp_rank=0, tp_size=2), kv0,
                {PoolName.INDEXER: idx0, PoolName.MAMBA: m0})
    r1 = attach(storage_config(tmp_path, mla=True, tp_rank=1, tp_size=2), kv1,
                {PoolName.INDEXER: idx1, PoolName.MAMBA: m1})
    try:
        assert r1.sidecars["indexer"].store.follower and not r1.sidecars["mamba"].store.follower
        # the indexer rides in the MLA KV page (one store, followed by rank 1)
        assert r1.sidecars["indexer"].store is r1._kv_store
        pages = slots(idx0, list(range(10)))
        fill_random(kv0, seed=24)
        for r, m in ((r0, m0), (r1, m1)):  # SGLang backs Mamba up on every rank
            assert r.batch_set_v2([
                PoolTransfer(name=PoolName.INDEXER, host_indices=pages, keys=keys),
                PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([0]),
                             keys=[keys[-1]])]) == {PoolName.INDEXER: [True] * 10,
                                                    PoolName.MAMBA: [True]}
        write_kv(r0, keys, kv0, list(range(10)))  # the pages are stored: v1 reports them
        query = [PoolTransfer(name=PoolName.INDEXER, hit_policy=ALL),
                 PoolTransfer(name=PoolName.MAMBA, keys=["x"], hit_policy=TRAILING)]
        for r in (r0, r1):
            catch_up(r)
            res = r.batch_exists_v2(keys, query)
            assert (res.kv_hit_pages, res.restorable_prefix_pages) == (10, [10])
        got = r1.batch_get_v2([PoolTransfer(name=PoolName.INDEXER, keys=keys,
                                            host_indices=slots(idx1, list(range(20, 30)))),
                               PoolTransfer(name=PoolName.MAMBA, keys=[keys[-1]],
                                            host_indices=torch.tensor([5]))])
        assert got == {PoolName.INDEXER: [True] * 10, PoolName.MAMBA: [True]}
        for i in range(10):  # rank 1 reads rank 0's indexer pages (identical on every rank)
            assert torch.equal(page_of(idx1, (20 + i) * DSA_PAGE), page_of(idx0, i * DSA_PAGE))
        # and with the KV pages: the v1 read brings both in, the v2 call that follows it is
        # answered from that read
        assert r1.batch_get_v1(keys, slots(kv1, list(range(30, 40)))) == [True] * 10
        assert r1.batch_get_v2([PoolTransfer(name=PoolName.INDEXER, keys=keys,
                                             host_indices=slots(idx1, list(range(30, 40))))]) \
            == {PoolName.INDEXER: [True] * 10}
        for i in range(10):
            assert torch.equal(page_of(kv1, (30 + i) * DSA_PAGE), page_of(kv0, i * DSA_PAGE))
            assert torch.equal(page_of(idx1, (30 + i) * DSA_PAGE), page_of(idx0, i * DSA_PAGE))
        # ...but its own Mamba state, never rank 0's
        assert torch.equal(page_of(m1, 5), page_of(m1, 0))
        assert not torch.equal(page_of(m1, 5), page_of(m0, 0))
    finally:
        r0.close()
        r1.close()


# -- 5. SGLang's failure injector around the factory-created backend ---------------------------
def test_injected_failures_never_give_a_wrong_hit(tmp_path, monkeypatch):
    """SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE / _RANDOM_DELAY wrap the backend the factory
    creates. The real controller backs up and prefetches KV + Mamba + draft KV over and over;
    whatever it reports loaded is bit-exact, whatever failed."""
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.15")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.002")
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector
    from sglang.srt.mem_cache.utils import get_hash_str
    src = {PoolName.KV: kv_host(), PoolName.MAMBA: mamba_host(slots=64),
           PoolName.DRAFT: kv_host()}
    for pool in src.values():
        fill_random(pool, seed=20)
    g = torch.Generator().manual_seed(21)
    checked = {"kv": 0, "mamba": 0, "short": 0}
    with hybrid_controller(tmp_path, src) as ctrl:
        assert isinstance(ctrl.storage_backend, HiCacheStorageFailureInjector)
        assert isinstance(ctrl.storage_backend._backend, GdskvHiCacheStorage)
        for round_ in range(12):
            n = int(torch.randint(1, 40, (1,), generator=g))
            tokens = torch.randint(0, 32000, (n * PAGE,), generator=g).tolist()
            hashes = get_hash_str(tokens, None, page_size=PAGE)
            host = ctrl.mem_pool_host.alloc(n * PAGE)
            mslot = src[PoolName.MAMBA].alloc(1)
            controller_backup(ctrl, tokens, hashes, host, [
                PoolTransfer(name=PoolName.MAMBA, host_indices=mslot, keys=[hashes[-1]],
                             hit_policy=TRAILING),
                PoolTransfer(name=PoolName.DRAFT, indices_from_pool=PoolName.KV,
                             hit_policy=ALL)])
            for attempt in range(3):
                op, got, completed, hits = controller_prefetch(ctrl, tokens, [
                    PoolTransfer(name=PoolName.MAMBA, keys=["p"], hit_policy=TRAILING),
                    PoolTransfer(name=PoolName.DRAFT, indices_from_pool=PoolName.KV,
                                 hit_policy=ALL)], rid=f"r{round_}-{attempt}")
                done = completed // PAGE
                checked["short"] += done < n
                for a, b in zip(host[::PAGE][:done].tolist(), got[::PAGE][:done].tolist()
                                if got is not None else []):
                    for name in (PoolName.KV, PoolName.DRAFT):
                        assert torch.equal(page_of(src[name], a), page_of(src[name], b))
                    checked["kv"] += 1
                if done == n and hits.get("mamba") == 1:
                    dst = int(op.pool_transfers[0].host_indices[0])
                    assert torch.equal(page_of(src[PoolName.MAMBA], int(mslot[0])),
                                       page_of(src[PoolName.MAMBA], dst))
                    checked["mamba"] += 1
                if got is not None:
                    ctrl.mem_pool_host.free(got)
                for t in op.pool_transfers or []:
                    if t.indices_from_pool is None and t.host_indices is not None:
                        src[PoolName.MAMBA].free(t.host_indices)
            ctrl.mem_pool_host.free(host)
            src[PoolName.MAMBA].free(mslot)
    # the run did check something on both paths, and failures did cut some prefetches short
    assert checked["kv"] > 0 and checked["mamba"] > 0 and checked["short"] > 0


def test_injected_failures_dsa_indexer_in_the_kv_page(tmp_path, monkeypatch):
    """The same injector around a DeepSeek-V3.2-shaped model whose indexer rides in the KV
    page: whatever the real controller reports loaded is bit-exact in both pools."""
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.2")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.002")
    from sglang.srt.mem_cache.utils import get_hash_str
    dev = dsa_device()
    kv = kv_host(mla=True, page_size=DSA_PAGE)
    src = {PoolName.KV: kv, PoolName.INDEXER: indexer_host(kv, dev)}
    for pool in src.values():
        fill_random(pool, seed=35)
    g = torch.Generator().manual_seed(36)
    checked = {"pages": 0, "short": 0}

    def indexer():
        return [PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV,
                             hit_policy=ALL)]

    with hybrid_controller(tmp_path, src, dev=dev) as ctrl:
        assert ctrl.storage_backend._backend.sidecars_in_kv_page() == ["indexer"]
        for round_ in range(10):
            n = int(torch.randint(1, 12, (1,), generator=g))
            tokens = torch.randint(0, 32000, (n * DSA_PAGE,), generator=g).tolist()
            hashes = get_hash_str(tokens, None, page_size=DSA_PAGE)
            host = ctrl.mem_pool_host.alloc(n * DSA_PAGE)
            controller_backup(ctrl, tokens, hashes, host, indexer())
            for attempt in range(3):
                op, got, completed, _ = controller_prefetch(ctrl, tokens, indexer(),
                                                            rid=f"d{round_}-{attempt}",
                                                            page=DSA_PAGE)
                done = completed // DSA_PAGE
                checked["short"] += done < n
                for a, c in zip(host[::DSA_PAGE][:done].tolist(),
                                got[::DSA_PAGE][:done].tolist() if got is not None else []):
                    for pool in src.values():
                        assert torch.equal(page_of(pool, a), page_of(pool, c))
                    checked["pages"] += 1
                if got is not None:
                    ctrl.mem_pool_host.free(got)
            ctrl.mem_pool_host.free(host)
    assert checked["pages"] > 0 and checked["short"] > 0


# -- 6. refusals and bad transfers ---------------------------------------------------------------
def test_controller_batch_is_sglangs():
    from gdskv.adapters.sglang.sidecar import CONTROLLER_BATCH_PAGES
    assert CONTROLLER_BATCH_PAGES == STORAGE_BATCH_SIZE


def test_sidecar_store_sizes(tmp_path):
    """A sidecar store's capacity follows SGLang's host-memory split (or pool_capacity), its
    staging holds one controller batch."""
    kv, mamba = kv_host(), mamba_host(slots=HOST_PAGES)
    b = attach(storage_config(tmp_path, capacity="16MiB", staging_size="8MiB",
                              pool_capacity={"swa": "3MiB"}),
               kv, {PoolName.MAMBA: mamba, PoolName.SWA: swa_host()})
    try:
        m, s = b.sidecars["mamba"], b.sidecars["swa"]
        kv_host_bytes = b.kv_layout.page_bytes * (kv.size // PAGE)
        share = (16 << 20) * m.pool.host_bytes / kv_host_bytes
        stored = m.store.tier.store.num_slots * m.store.layout.slot_bytes
        assert share / 2 < stored <= share
        assert s.store.tier.store.num_slots * s.store.layout.slot_bytes <= 3 << 20
        assert m.store.tier.config.staging_size == STORAGE_BATCH_SIZE * m.store.layout.slot_bytes
    finally:
        b.close()


def test_registration_refusals(tmp_path):
    kv = kv_host()
    b = StorageBackendFactory.create_backend("dynamic", storage_config(tmp_path), kv)
    # a sidecar pool before the KV pool (issue 48: it was refused): a store of its own, its
    # capacity the KV capacity (no KV host pool to scale it by yet)
    b.register_mem_host_pool_v2(mamba_host(), PoolName.MAMBA)
    try:
        m = b.sidecars["mamba"]
        assert not m.in_kv_page and m.store.tier.config.capacity == b.config.capacity
        b.register_mem_pool_host(kv)
        with pytest.raises(ValueError, match="already registered"):
            b.register_mem_host_pool_v2(mamba_host(), PoolName.MAMBA)

        class NoPages:
            page_size = 1
        with pytest.raises(ValueError, match="get_dummy_flat_data_page.*SGLang cannot hand"):
            b.register_mem_host_pool_v2(NoPages(), PoolName.SWA)
        # the KV store is open for the first KV pool: a second one would be served by it
        b.on_host_pools_registered()
        with pytest.raises(RuntimeError, match="KV store is open already"):
            b.register_mem_pool_host(kv_host(layout="page_first"))
    finally:
        b.close()
    with pytest.raises(ConfigError, match="pool_capacity"):
        GdskvHiCacheStorage(storage_config(tmp_path, pool_capacity="8GiB"), {})
    with pytest.raises(ConfigError, match=r"pool_capacity\['mamba'\]"):
        GdskvHiCacheStorage(storage_config(tmp_path, pool_capacity={"mamba": "lots"}), {})
    with pytest.raises(ConfigError, match="sidecar_in_kv_page"):
        GdskvHiCacheStorage(storage_config(tmp_path, sidecar_in_kv_page="sometimes"), {})


def test_kv_transfers_of_the_v2_calls_reach_the_kv_store(tmp_path):
    """issue 48: a KV transfer sent through batch_set_v2 / batch_get_v2 (as SGLang's own unit
    tests send one) used to be "never registered" and stored nothing; it is the KV store's,
    moved in place as the v1 calls move it, and MLA ranks that do not write report success."""
    kv, dst = kv_host(), kv_host()
    fill_random(kv, seed=41)
    keys = page_hashes(6, seed=42)
    b = attach(storage_config(tmp_path), kv, {})
    try:
        idx = slots(kv, list(range(6)))
        assert b.batch_set_v2([PoolTransfer(name=PoolName.KV, keys=keys, host_indices=idx)]) \
            == {PoolName.KV: [True] * 6}
        assert b.batch_exists(keys) == 6 and b.batch_exists_v2(keys).kv_hit_pages == 6
        assert b.batch_get_v1(keys, idx) == [True] * 6  # the store the v1 calls read
    finally:
        b.close()
    b = attach(storage_config(tmp_path), dst, {})
    try:
        got = b.batch_get_v2([PoolTransfer(name=PoolName.KV, keys=keys,
                                           host_indices=slots(dst, list(range(6))))])
        assert got == {PoolName.KV: [True] * 6}
        for p in range(6):
            assert torch.equal(page_of(dst, p * PAGE), page_of(kv, p * PAGE))
    finally:
        b.close()
    (tmp_path / "mla").mkdir()
    reader = attach(storage_config(tmp_path / "mla", mla=True, tp_rank=1, tp_size=2),
                    kv_host(mla=True), {})
    try:
        assert reader.batch_set_v2([PoolTransfer(name=PoolName.KV, keys=keys,
                                                 host_indices=idx)]) == {PoolName.KV: [True] * 6}
    finally:
        reader.close()


def test_bad_transfers_are_misses_never_exceptions(tmp_path, caplog):
    kv, mamba = kv_host(), mamba_host(slots=8)
    fill_random(mamba, seed=22)
    keys = page_hashes(3, seed=23)
    b = attach(storage_config(tmp_path), kv, {PoolName.MAMBA: mamba})
    try:
        with caplog.at_level(logging.ERROR, logger="gdskv.sglang"):
            # a pool never registered
            assert b.batch_set_v2([PoolTransfer(name=PoolName.SWA, keys=keys,
                                                host_indices=torch.arange(12))]) == \
                {PoolName.SWA: [False] * 3}
            # wrong number of host indices, and none at all
            assert b.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, keys=keys,
                                                host_indices=torch.arange(2))]) == \
                {PoolName.MAMBA: [False] * 3}
            assert b.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, keys=keys)]) == \
                {PoolName.MAMBA: [False] * 3}
            # an unknown hit policy gives no hit
            write_kv(b, keys, kv, [0, 1, 2])
            assert b.batch_exists_v2(keys, [PoolTransfer(name=PoolName.MAMBA, keys=keys,
                                                         hit_policy="from_the_future")]) \
                .kv_hit_pages == 0
        assert any("never registered" in r.message for r in caplog.records)
        assert any("batch_set_v2" in r.message for r in caplog.records)
        # two transfers of one pool: one list, so the first's failure is not hidden
        res = b.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, keys=keys[:1],
                                           host_indices=torch.arange(5)),
                              PoolTransfer(name=PoolName.MAMBA, keys=keys[1:],
                                           host_indices=torch.tensor([1, 2]))])
        assert res == {PoolName.MAMBA: [False, True, True]}
        # a region SGLang's metadata would place outside the pool's buffers: refused, a miss
        real_meta = mamba.get_page_buffer_meta
        mamba.get_page_buffer_meta = lambda idx: ([p + (1 << 40) for p in real_meta(idx)[0]],
                                                  real_meta(idx)[1])
        before = page_of(mamba, 6)
        try:
            assert b.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, keys=keys[1:2],
                                                host_indices=torch.tensor([6]))]) == \
                {PoolName.MAMBA: [False]}
        finally:
            del mamba.get_page_buffer_meta
        assert torch.equal(page_of(mamba, 6), before)
        # after close: misses and failures, no exception
        b.close()
        assert b.batch_exists_v2(keys, [PoolTransfer(name=PoolName.MAMBA, keys=keys[:1],
                                                     hit_policy=TRAILING)]).kv_hit_pages == 0
        assert b.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, keys=keys[1:],
                                            host_indices=torch.tensor([3, 4]))]) == \
            {PoolName.MAMBA: [False, False]}
    finally:
        b.close()
