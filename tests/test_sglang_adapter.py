"""The SGLang adapter against the real sglang package: loaded by SGLang's StorageBackendFactory
the way ``--hicache-storage-backend dynamic`` loads it, driven the way SGLang's cache controller
drives an ``interface_v1`` backend (batch_exists, then batch_set_v1 / batch_get_v1 in batches of
``STORAGE_BATCH_SIZE`` = 128 pages) over SGLang's own host pool classes.

Needs the sglang venv (tests/requirements-sglang.txt); skipped with that reason elsewhere.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time

import pytest
import torch

try:
    from sglang.srt.mem_cache.hicache_storage import (
        STORAGE_BATCH_SIZE,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
    )
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
except ImportError as exc:  # the main venv has no sglang
    pytest.skip(f"sglang is not importable ({exc}); these tests run in the sglang venv: "
                "see tests/requirements-sglang.txt", allow_module_level=True)

from gdskv.adapters.sglang import GdskvHiCacheStorage  # noqa: E402
from gdskv.config import ConfigError  # noqa: E402
from gdskv.namespaces import START_LOCK  # noqa: E402

from sglang_pools import make_host_pool, pool_kind  # noqa: E402

MODULE = "gdskv.adapters.sglang"
CLASS = "GdskvHiCacheStorage"
PAGE = 4
LAYERS = 2
HEADS = 2
HEAD_DIM = 8
MLA_DIM = 24
NUM_PAGES = 300  # three controller batches: 128 + 128 + 44


def storage_config(tmp_path, *, mla=False, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                   model="org/tiny-llama", metrics=False, **extra) -> HiCacheStorageConfig:
    """What SGLang's cache controller builds (_generate_storage_config) for a dynamic backend."""
    d = tmp_path / "l3"
    d.mkdir(exist_ok=True)
    cfg = {"backend_name": "gdskv", "module_path": MODULE, "class_name": CLASS,
           "interface_v1": 1, "directories": str(d), "capacity": "16MiB",
           "staging_size": "256KiB", "io_chunk_size": "64KiB", "io_threads": 2,
           "files_per_dir": 2, "backend": "posix"}
    cfg.update(extra)
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=metrics,
        is_page_first_layout=True, model_name=model, extra_config=cfg)


def attach(config: HiCacheStorageConfig, host_pool):
    """CacheController.attach_storage_backend: create through the factory, then register."""
    backend = StorageBackendFactory.create_backend("dynamic", config, host_pool)
    backend.register_mem_pool_host(host_pool)
    # SGLang picks the zero-copy page functions from this flag.
    assert bool(config.extra_config.get("interface_v1", 0))
    return backend


def page_hashes(num_pages: int, seed: int = 0) -> list[str]:
    """Chained page hashes of token ids, as SGLang computes storage keys."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32000, (num_pages * PAGE,), generator=g).tolist()
    try:
        from sglang.srt.mem_cache.utils import get_hash_str
        return list(get_hash_str(tokens, None, page_size=PAGE))
    except ImportError:  # older layouts of the package: same idea, plain sha256 chain
        import hashlib
        out, prev = [], b""
        for i in range(num_pages):
            h = hashlib.sha256(prev + str(tokens[i * PAGE:(i + 1) * PAGE]).encode())
            prev = h.digest()
            out.append(h.hexdigest())
        return out


def host_indices_for(pages: list[int]) -> torch.Tensor:
    """Token slots of whole host pages (SGLang's host allocator hands out page-aligned runs)."""
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages]).to(torch.int64)


def controller_backup(storage, hashes, host_indices) -> int:
    """CacheController._page_backup with _page_set_zero_copy; returns pages written."""
    done, prefix = 0, []
    for i in range(0, len(hashes), STORAGE_BATCH_SIZE):
        batch = hashes[i:i + STORAGE_BATCH_SIZE]
        idx = host_indices[i * PAGE:(i + len(batch)) * PAGE]
        ok = storage.batch_set_v1(batch, idx, HiCacheStorageExtraInfo(prefix_keys=prefix))
        assert isinstance(ok, list) and len(ok) == len(batch)
        if not all(ok):
            break
        prefix = prefix + batch
        done += len(batch)
    return done


def controller_hit_query(storage, hashes) -> int:
    """CacheController._storage_hit_query: leading hits, 128 keys per batch_exists."""
    hits, prefix = 0, []
    for i in range(0, len(hashes), STORAGE_BATCH_SIZE):
        batch = hashes[i:i + STORAGE_BATCH_SIZE]
        n = storage.batch_exists(batch, HiCacheStorageExtraInfo(prefix_keys=prefix))
        assert isinstance(n, int)
        hits += n
        if n < len(batch):
            break
        prefix = prefix + batch
    return hits


def controller_prefetch(storage, hashes, host_indices) -> int:
    """CacheController._page_transfer with _page_get_zero_copy; returns pages loaded."""
    done = 0
    for i in range(0, len(hashes), STORAGE_BATCH_SIZE):
        batch = hashes[i:i + STORAGE_BATCH_SIZE]
        idx = host_indices[i * PAGE:(i + len(batch)) * PAGE]
        res = storage.batch_get_v1(batch, idx)
        assert isinstance(res, list) and len(res) == len(batch)
        inc = res.index(False) if False in res else len(res)
        done += inc
        if inc < len(batch):
            break
    return done


def fill_random(pool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    raw = pool.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def page_bytes(pool, page: int) -> torch.Tensor:
    """SGLang's own accessor for one host page's bytes."""
    return pool.get_data_page(page * PAGE, flat=True).view(torch.uint8).clone()


def meta_regions(pool, pages: list[int]) -> list[torch.Tensor]:
    """The byte regions SGLang's get_page_buffer_meta names for these pages (what SGLang's own
    zero-copy backends would transfer)."""
    ptrs, sizes = pool.get_page_buffer_meta(host_indices_for(pages))
    return [torch.frombuffer((ctypes.c_uint8 * s).from_address(p), dtype=torch.uint8).clone()
            for p, s in zip(ptrs, sizes)]


LAYOUT_CASES = [(mla, layout) for mla in (False, True)
                for layout in ("page_first", "page_first_direct")]
CASE_IDS = [f"{'mla' if m else 'mha'}-{lay}" for m, lay in LAYOUT_CASES]


def build_pool(mla: bool, layout: str):
    return make_host_pool(mla=mla, layout=layout, page_size=PAGE, layers=LAYERS, heads=HEADS,
                          head_dim=HEAD_DIM, mla_dim=MLA_DIM, pages=2 * NUM_PAGES + 8)


def test_pools_are_sglangs_own():
    """Report which host pool implementation the other tests ran on."""
    kind = pool_kind()
    if kind != "sglang":
        pytest.skip(f"SGLang's host pool classes do not import here ({kind}); the tests used "
                    "the formula-following pool in tests/sglang_pools.py")
    pool = build_pool(False, "page_first_direct")
    assert type(pool).__module__.startswith("sglang.")


@pytest.mark.parametrize("mla,layout", LAYOUT_CASES, ids=CASE_IDS)
def test_controller_round_trip(tmp_path, mla, layout):
    src_pool, dst_pool = build_pool(mla, layout), build_pool(mla, layout)
    fill_random(src_pool, seed=1)
    g = torch.Generator().manual_seed(2)
    src_pages = torch.randperm(2 * NUM_PAGES, generator=g)[:NUM_PAGES].tolist()
    dst_pages = torch.randperm(2 * NUM_PAGES, generator=g)[:NUM_PAGES].tolist()
    hashes = page_hashes(NUM_PAGES)

    writer = attach(storage_config(tmp_path, mla=mla), src_pool)
    assert isinstance(writer, GdskvHiCacheStorage)
    try:
        assert controller_hit_query(writer, hashes) == 0
        assert controller_backup(writer, hashes, host_indices_for(src_pages)) == NUM_PAGES
        assert controller_hit_query(writer, hashes) == NUM_PAGES
        # The stored page is exactly SGLang's zero-copy regions in gdskv's page order.
        probe = src_pages[:3]
        stored = torch.empty(3, writer.kv_layout.page_bytes, dtype=torch.uint8)
        assert writer.tier.get_pages(writer._storage_keys(hashes[:3]),
                                     [[stored[i]] for i in range(3)]) == [True] * 3
        regions = meta_regions(src_pool, probe)
        per_page = len(regions) // 3
        lay = writer.kv_layout
        for i in range(3):
            expect = [r for r in regions[i * per_page:(i + 1) * per_page]]
            if layout == "page_first":  # SGLang's region is [token][layer][row] per K/V
                expect = [r.view(PAGE, LAYERS, lay.row_bytes).transpose(0, 1).reshape(-1)
                          for r in expect]
            assert torch.equal(stored[i], torch.cat(expect))
    finally:
        writer.close()

    # A restarted server (new process, new pool) finds the pages and loads them elsewhere.
    reader = attach(storage_config(tmp_path, mla=mla), dst_pool)
    try:
        assert controller_hit_query(reader, hashes) == NUM_PAGES
        assert controller_prefetch(reader, hashes, host_indices_for(dst_pages)) == NUM_PAGES
        for s, d in zip(src_pages, dst_pages):
            assert torch.equal(page_bytes(src_pool, s), page_bytes(dst_pool, d))
        st = reader.tier_stats()
        assert st["hits"] == NUM_PAGES and st["corrupt_pages"] == 0
    finally:
        reader.close()


def test_partial_prefix_and_second_write_is_noop(tmp_path):
    pool = build_pool(False, "page_first_direct")
    fill_random(pool, seed=3)
    hashes = page_hashes(NUM_PAGES, seed=4)
    idx = host_indices_for(list(range(NUM_PAGES)))
    s = attach(storage_config(tmp_path), pool)
    try:
        assert controller_backup(s, hashes[:200], idx[:200 * PAGE]) == 200
        assert controller_hit_query(s, hashes) == 200
        written = s.tier_stats()["bytes_written"]
        assert controller_backup(s, hashes[:200], idx[:200 * PAGE]) == 200
        assert s.tier_stats()["bytes_written"] == written
        s.clear()
        assert controller_hit_query(s, hashes) == 0
    finally:
        s.close()


def test_upgrade_keeps_the_store_under_its_earlier_name(tmp_path, caplog):
    """A rank's store an earlier gdskv made as <model>/tp1-2 (before the naming the adapters
    share, docs/adapters.md) stays in use after an upgrade: its pages still hit, said once."""
    pool = build_pool(False, "page_first_direct")
    fill_random(pool, seed=41)
    hashes = page_hashes(NUM_PAGES, seed=42)
    s = attach(storage_config(tmp_path, tp_rank=1, tp_size=2), pool)
    try:
        assert controller_backup(s, hashes, host_indices_for(range(NUM_PAGES))) == NUM_PAGES
        current = s.tier.store.directories[0]
    finally:
        s.close()
    model_dir = os.path.join(os.path.realpath(tmp_path / "l3"), "org-tiny-llama")
    assert current == os.path.join(model_dir, "kv", "tp1-of-2")
    os.rename(current, os.path.join(model_dir, "tp1-2"))  # where the earlier naming put it
    os.rmdir(os.path.join(model_dir, "kv"))
    dst_pool = build_pool(False, "page_first_direct")
    with caplog.at_level(logging.WARNING, logger="gdskv.adapters"):
        s = attach(storage_config(tmp_path, tp_rank=1, tp_size=2), dst_pool)
    try:
        assert s.tier.store.directories == [os.path.join(model_dir, "tp1-2")]
        assert controller_hit_query(s, hashes) == NUM_PAGES
        dst = list(range(NUM_PAGES, 2 * NUM_PAGES))
        assert controller_prefetch(s, hashes, host_indices_for(dst)) == NUM_PAGES
        for a, b in zip(range(NUM_PAGES), dst):
            assert torch.equal(page_bytes(pool, a), page_bytes(dst_pool, b))
    finally:
        s.close()
    said = [r.getMessage() for r in caplog.records if "earlier gdskv" in r.getMessage()]
    assert len(said) == 1 and os.path.join("kv", "tp1-of-2") in said[0]
    assert not os.path.exists(os.path.join(model_dir, "kv"))  # nothing made under the new name


def test_tp_ranks_and_models_never_cross_hit(tmp_path):
    """Two TP ranks write the same hashes with different bytes (their own heads); each reads
    back its own. Another TP size or model name sees nothing."""
    hashes = page_hashes(40, seed=5)
    idx = host_indices_for(list(range(40)))
    pools, storages = [], []
    try:
        for rank in range(2):
            pool = build_pool(False, "page_first")
            fill_random(pool, seed=10 + rank)
            st = attach(storage_config(tmp_path, tp_rank=rank, tp_size=2), pool)
            assert controller_backup(st, hashes, idx) == 40
            pools.append(pool)
            storages.append(st)
        assert storages[0].key_suffix != storages[1].key_suffix
        assert "_tp0-2" in storages[0].key_suffix and "_tp1-2" in storages[1].key_suffix
        assert storages[0].tier.layout.fingerprint != storages[1].tier.layout.fingerprint
        for rank, (pool, st) in enumerate(zip(pools, storages)):
            out = build_pool(False, "page_first")
            other = build_pool(False, "page_first")
            fill_random(other, seed=10 + 1 - rank)
            assert st.batch_get_v1(hashes, idx) == [True] * 40
            # read into the storage's own pool after wiping it
            before = [page_bytes(pool, p) for p in range(40)]
            pool.kv_buffer.zero_()
            assert controller_prefetch(st, hashes, idx) == 40
            for p in range(40):
                assert torch.equal(page_bytes(pool, p), before[p])
                assert not torch.equal(page_bytes(pool, p), page_bytes(other, p))
            del out
    finally:
        for st in storages:
            st.close()
    for kwargs in ({"tp_rank": 0, "tp_size": 1}, {"tp_rank": 0, "tp_size": 2, "pp_size": 2},
                   {"tp_rank": 0, "tp_size": 2, "model": "org/other-model"}):
        st = attach(storage_config(tmp_path, **kwargs), build_pool(False, "page_first"))
        try:
            assert controller_hit_query(st, hashes) == 0, kwargs
        finally:
            st.close()


def test_mla_only_the_writer_rank_writes(tmp_path):
    hashes = page_hashes(20, seed=6)
    idx = host_indices_for(list(range(20)))
    pool = build_pool(True, "page_first_direct")
    fill_random(pool, seed=7)
    follower = attach(storage_config(tmp_path, mla=True, tp_rank=1, tp_size=2), pool)
    writer = attach(storage_config(tmp_path, mla=True, tp_rank=0, tp_size=2), pool)
    try:
        assert not follower.is_writer and writer.is_writer
        assert follower.batch_set_v1(hashes, idx) == [True] * 20  # success, nothing written
        assert writer.tier_stats().get("bytes_written", 0) == 0
        assert controller_hit_query(writer, hashes) == 0
        assert controller_backup(writer, hashes, idx) == 20
        assert writer.tier_stats()["bytes_written"] == 20 * writer.kv_layout.page_bytes
        # MLA KV is the same on every TP rank: the key carries no TP rank.
        assert "_tp" not in writer.key_suffix
    finally:
        writer.close()
        follower.close()


@pytest.mark.parametrize("layout", ["page_first_direct", "page_first", "layer_first"])
def test_mla_tp2_other_rank_reads_the_writers_pages(tmp_path, monkeypatch, layout):
    """MLA with TP=2: rank 0 writes; rank 1 (its own adapter, its own host pool) follows the
    writer's store read-only and gets hits with bit-exact pages, including pages written after
    it opened. SGLang takes the minimum hit count over ranks, so both must see them."""
    from gdskv.adapters.sglang import rank_store
    monkeypatch.setattr(rank_store, "FOLLOWER_RETRY_S", 0.0)  # retry the open on every call
    n = 150
    hashes = page_hashes(n, seed=20)
    src_pool, dst_pool = build_pool(True, layout), build_pool(True, layout)
    fill_random(src_pool, seed=21)
    src_pages = list(range(n))
    dst_pages = torch.randperm(2 * NUM_PAGES, generator=torch.Generator().manual_seed(22))[:n]
    dst_pages = dst_pages.tolist()
    # Rank 1 starts before rank 0 has made the store: misses, no error, no files of its own.
    rank1 = attach(storage_config(tmp_path, mla=True, tp_rank=1, tp_size=2), dst_pool)
    rank0 = None
    try:
        assert rank1.tier is None and controller_hit_query(rank1, hashes) == 0
        assert rank1.batch_get_v1(hashes[:2], host_indices_for(dst_pages[:2])) == [False] * 2
        shard = os.path.join(str(tmp_path / "l3"), rank1.model_name, "kv", "tp-all")
        assert os.listdir(shard) == []  # the follower made no lock, manifest or slab file
        rank0 = attach(storage_config(tmp_path, mla=True, tp_rank=0, tp_size=2), src_pool)
        assert controller_backup(rank1, hashes, host_indices_for(src_pages)) == n  # no-op
        assert controller_backup(rank0, hashes[:100], host_indices_for(src_pages[:100])) == 100
        assert controller_hit_query(rank1, hashes) == 100  # opened the writer's store now
        assert rank1.tier is not None and rank1.tier.read_only
        assert rank1.tier.store.directories == rank0.tier.store.directories
        # Pages the writer adds later show up at rank 1's next query.
        assert controller_backup(rank0, hashes[100:], host_indices_for(src_pages[100:])) == 50
        time.sleep(rank1.tier.FOLLOW_INTERVAL * 1.5)
        assert controller_hit_query(rank1, hashes) == n
        assert controller_prefetch(rank1, hashes, host_indices_for(dst_pages)) == n
        for s_, d in zip(src_pages, dst_pages):
            assert torch.equal(page_bytes(src_pool, s_), page_bytes(dst_pool, d))
        st = rank1.tier_stats()
        assert st["hits"] == n and st["corrupt_pages"] == 0 and st.get("bytes_written", 0) == 0
        # The older per-page interface reads through the follower too.
        target = dst_pool.get_dummy_flat_data_page()
        assert rank1.exists(hashes[7])
        assert rank1.get(hashes[7], target) is target
        assert torch.equal(target.view(torch.uint8), page_bytes(src_pool, src_pages[7]))
        # Writer evicts: rank 1 stops reporting the page.
        rank0.tier.evict(rank0._storage_keys(hashes[:1]))
        rank1.tier.refresh()
        assert controller_hit_query(rank1, hashes) == 0
    finally:
        rank1.close()
        if rank0 is not None:
            rank0.close()


def test_data_path_failures_become_false(tmp_path, caplog):
    pool = build_pool(False, "page_first_direct")
    fill_random(pool, seed=8)
    hashes = page_hashes(10, seed=9)
    idx = host_indices_for(list(range(10)))
    s = attach(storage_config(tmp_path), pool)
    try:
        with caplog.at_level(logging.ERROR, logger="gdskv.sglang"):
            # wrong number of host indices for the keys
            assert s.batch_set_v1(hashes, idx[:-1]) == [False] * 10
            assert s.batch_get_v1(hashes, idx[:-1]) == [False] * 10
            # host indices that are not whole host pages
            assert s.batch_set_v1(hashes[:1], idx[1:PAGE + 1]) == [False]
        assert any("batch_set_v1" in r.message for r in caplog.records)
        assert controller_backup(s, hashes, idx) == 10

        # the disk fails under a read: misses, no exception
        def broken_read(buffer, extents):
            raise OSError(5, "Input/output error (injected)")
        real_read, real_now = s.tier.backend.read, s.tier.backend.move_on_caller
        s.tier.backend.read = broken_read
        # (a small call's read on the calling thread fails the same way)
        s.tier.backend.move_on_caller = lambda op, buffer, extents: (
            broken_read(buffer, extents) if op == "read" else real_now(op, buffer, extents))
        assert s.batch_get_v1(hashes, idx) == [False] * 10
        s.tier.backend.read, s.tier.backend.move_on_caller = real_read, real_now

        # pages whose bytes changed on disk fail their checksums: misses, never wrong data
        for f in s.tier.store.files:
            with open(f.path, "r+b") as fh:
                data = bytearray(fh.read(s.kv_layout.slot_bytes * 10))
                for i in range(0, len(data), 97):
                    data[i] ^= 0xFF
                fh.seek(0)
                fh.write(data)
        pool.kv_buffer.zero_()
        assert s.batch_get_v1(hashes, idx) == [False] * 10
        assert not pool.kv_buffer.view(torch.uint8).any()

        # a closed tier (e.g. after detach): misses and failures, no exception
        s.tier.close()
        assert s.batch_exists(hashes) == 0
        assert s.batch_get_v1(hashes, idx) == [False] * 10
        assert s.batch_set_v1(hashes, idx) == [False] * 10
    finally:
        s.close()  # the tier is closed already; close() does not mind


def test_legacy_interface_like_generic_page_path(tmp_path):
    """The older calls, as CacheController._generic_page_set/_generic_page_get use them."""
    for mla, layout in LAYOUT_CASES:
        src, dst = build_pool(mla, layout), build_pool(mla, layout)
        fill_random(src, seed=11)
        hashes = page_hashes(5, seed=12)
        sub = tmp_path / f"{mla}-{layout}"
        sub.mkdir()
        s = attach(storage_config(sub, mla=mla), src)
        try:
            data = [src.get_data_page(p * PAGE) for p in range(5)]
            assert s.batch_set(hashes, data) is True
            assert all(s.exists(h) for h in hashes) and not s.exists("nope")
            assert s.set(hashes[0], data[0]) is True
            # the legacy and zero-copy paths store the same page format
            assert s.batch_get_v1(hashes, host_indices_for(list(range(5)))) == [True] * 5
            dummies = [dst.get_dummy_flat_data_page() for _ in hashes]
            got = s.batch_get(hashes, dummies)
            for p, page in enumerate(got):
                assert page is not None
                dst.set_from_flat_data_page((10 + p) * PAGE, page)
                assert torch.equal(page_bytes(src, p), page_bytes(dst, 10 + p))
            assert s.get("missing", dst.get_dummy_flat_data_page()) is None
        finally:
            s.close()


def test_options_from_extra_config_and_env(tmp_path, monkeypatch):
    monkeypatch.setenv("GDSKV_IO_THREADS", "3")
    monkeypatch.setenv("GDSKV_VERIFY", "0")
    s = attach(storage_config(tmp_path, capacity="8MiB", file_storage_path="/unused"),
               build_pool(False, "page_first"))  # SGLang's own key passes
    try:
        assert s.config.io_threads == 2  # extra_config wins over the env
        assert s.config.verify is False  # from the env
        assert s.tier.store.num_slots * s.kv_layout.slot_bytes <= 8 << 20
    finally:
        s.close()
    # a misspelt key is fatal, as a misspelt GDSKV_* variable is, and nothing is created
    (tmp_path / "typo").mkdir()
    with pytest.raises(ConfigError, match=r"'capcity' \(did you mean capacity\?\)"):
        GdskvHiCacheStorage(storage_config(tmp_path / "typo", capcity="8MiB"), {})
    assert os.listdir(tmp_path / "typo" / "l3") == []
    monkeypatch.delenv("GDSKV_VERIFY")
    with pytest.raises(ConfigError, match="capacity"):
        GdskvHiCacheStorage(storage_config(tmp_path, capacity="lots"), {})
    cfg = storage_config(tmp_path)
    cfg.extra_config.pop("directories")
    monkeypatch.delenv("GDSKV_DIRECTORIES", raising=False)
    with pytest.raises(ValueError, match="directories"):
        GdskvHiCacheStorage(cfg, {})
    monkeypatch.setenv("GDSKV_DIRECTORIES", str(tmp_path / "l3"))
    s = GdskvHiCacheStorage(cfg, {})
    assert s.config.directories == (str(tmp_path / "l3"),)
    monkeypatch.setenv("GDSKV_NO_SUCH_OPTION", "1")
    with pytest.raises(ConfigError, match="GDSKV_NO_SUCH_OPTION"):
        GdskvHiCacheStorage(storage_config(tmp_path), {})


def test_storage_metrics(tmp_path):
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics
    except ImportError as exc:
        pytest.skip(f"SGLang's metrics module does not import here ({exc})")
    pool = build_pool(False, "page_first_direct")
    fill_random(pool, seed=13)
    hashes = page_hashes(8, seed=14)
    idx = host_indices_for(list(range(8)))
    s = attach(storage_config(tmp_path, metrics=True), pool)
    try:
        controller_backup(s, hashes, idx)
        controller_prefetch(s, hashes, idx)
        m = s.get_stats()
        assert isinstance(m, StorageMetrics)
        assert m.backup_pgs == [8] and m.prefetch_pgs == [8]
        assert m.backup_bandwidth[0] > 0 and m.prefetch_bandwidth[0] > 0
        assert s.get_stats().backup_pgs == []  # drained
    finally:
        s.close()
    s = attach(storage_config(tmp_path), pool)
    assert s.get_stats() is None
    s.close()


# -- issue 48: a host pool gdskv does not move in place goes through SGLang's page calls -------
def test_pool_not_moved_in_place_goes_through_sglangs_page_calls(tmp_path, caplog):
    """A KV host pool gdskv has no in-place path for (here SGLang's page_head layout; a new
    SGLang pool class alike) used to be refused at attach. Its pages now go through SGLang's
    generic page calls, in the v1 calls and the per-page calls alike (the same bytes), and
    come back after a restart."""
    src = build_pool(False, "page_head")
    fill_random(src, seed=31)
    hashes = page_hashes(10, seed=32)
    idx = host_indices_for(list(range(10)))
    with caplog.at_level(logging.WARNING, logger="gdskv.sglang"):
        s = attach(storage_config(tmp_path), src)
    try:
        assert any("layout 'page_head'" in r.message and "generic page calls" in r.message
                   for r in caplog.records)
        assert s.kv_layout is None and os.path.isdir(tmp_path / "l3" / "org-tiny-llama" / "kv")
        assert controller_backup(s, hashes[:5], idx[:5 * PAGE]) == 5
        assert s.batch_set(hashes[5:], [src.get_data_page(p * PAGE) for p in range(5, 10)])
    finally:
        s.close()
    dst = build_pool(False, "page_head")
    s = attach(storage_config(tmp_path), dst)  # a restart
    try:
        assert controller_hit_query(s, hashes) == 10
        assert controller_prefetch(s, hashes, idx) == 10
        got = s.batch_get(hashes[:5], [dst.get_dummy_flat_data_page() for _ in range(5)])
        for p in range(10):
            assert torch.equal(page_bytes(dst, p), page_bytes(src, p))
            if p < 5:
                assert torch.equal(got[p].view(torch.uint8), page_bytes(src, p))
    finally:
        s.close()


def test_pool_with_no_page_calls_fails_at_attach(tmp_path):
    """A pool neither moved in place nor handed over by SGLang's page calls stops SGLang at
    start-up, naming both reasons, rather than failing every call later."""
    class NoPages:
        layout, page_size, size = "page_head", PAGE, 64
    with pytest.raises(ValueError, match=r"NoPages has layout 'page_head' .* and SGLang's "
                       r"generic page calls do not take it either: .*get_dummy_flat_data_page"):
        attach(storage_config(tmp_path), NoPages())
    # SGLang's page_unified layout: a dummy page, but no get_data_page for it
    with pytest.raises(ValueError, match=r"layout 'page_unified' .* do not take it either: "
                       r"Unsupported layout: page_unified"):
        attach(storage_config(tmp_path), build_pool(False, "page_unified"))
    assert os.path.isdir(tmp_path / "l3")


# -- issue 19: one clear error for every bad input through SGLang's extra config ---------------
@pytest.mark.parametrize("field, text", [("read_only", "false"), ("verify", "false"),
                                         ("preallocate", "no")])
def test_string_booleans_in_the_json_extra_config(tmp_path, field, text):
    """JSON strings are parsed like GDSKV_* values: "false" is False (it used to be truthy and
    silently turned a writer into a follower, or left verification on)."""
    pool = build_pool(False, "page_first_direct")
    fill_random(pool, seed=21)
    s = attach(storage_config(tmp_path, **{field: text}), pool)
    try:
        assert getattr(s.config, field) is False
        assert not s.tier.read_only
        hashes = page_hashes(4, seed=22)
        assert controller_backup(s, hashes, host_indices_for([0, 1, 2, 3])) == 4
    finally:
        s.close()
    with pytest.raises(ConfigError, match=r"read_only: expected a boolean .* got 'nope'"):
        GdskvHiCacheStorage(storage_config(tmp_path, read_only="nope"), {})


@pytest.mark.parametrize("device, match", [
    (None, r"device: None is not a device"),
    ("tpu", r"device: 'tpu'"),
    pytest.param("cuda", r"device: 'cuda' but no CUDA device is usable here; use \"cpu\"",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")),
])
def test_bad_device_is_one_config_error(tmp_path, device, match):
    with pytest.raises(ConfigError, match=match):
        GdskvHiCacheStorage(storage_config(tmp_path, device=device), {})


def test_store_directory_must_exist_unless_asked_to_create(tmp_path):
    missing = tmp_path / "nvme0" / "kv"  # e.g. a drive that is not mounted
    with pytest.raises(ConfigError, match=r"directories: '.*nvme0/kv' does not exist \(an "
                       r"unmounted drive\?\).*\"create_directories\": true"):
        GdskvHiCacheStorage(storage_config(tmp_path, directories=str(missing)), {})
    assert not (tmp_path / "nvme0").exists()
    with pytest.raises(ConfigError, match=r"directories: '/etc/hostname' exists but is not a "
                       r"directory"):
        GdskvHiCacheStorage(storage_config(tmp_path, directories="/etc/hostname"), {})
    pool = build_pool(False, "page_first")
    s = attach(storage_config(tmp_path, directories=str(missing), create_directories=True), pool)
    try:
        assert missing.is_dir() and s.tier is not None
    finally:
        s.close()


def test_negative_host_indices_are_refused_not_wrapped(tmp_path, caplog):
    """page_first_direct: -4..-1 used to wrap to the last host page (Python indexing) and report
    True for the wrong page; they are refused like out-of-range pool slots."""
    pool = build_pool(False, "page_first_direct")
    fill_random(pool, seed=23)
    last = pool.kv_buffer.shape[1] - 1  # the page a wrapped -1 would hit
    before = page_bytes(pool, last)
    s = attach(storage_config(tmp_path), pool)
    try:
        hashes = page_hashes(2, seed=24)
        bad = torch.cat([torch.arange(-PAGE, 0), torch.arange(0, PAGE)]).to(torch.int64)
        with caplog.at_level(logging.ERROR, logger="gdskv.sglang"):
            assert s.batch_set_v1(hashes, bad) == [False, False]
        assert s.batch_exists(hashes) == 0  # nothing was stored
        assert controller_backup(s, hashes, host_indices_for([0, 1])) == 2
        assert s.batch_get_v1(hashes, bad) == [False, False]
        assert torch.equal(page_bytes(pool, last), before)  # the last page was not written
        assert any("host index out of range" in r.getMessage() for r in caplog.records)
    finally:
        s.close()


def _dp(config: HiCacheStorageConfig, dp_rank: int) -> HiCacheStorageConfig:
    import dataclasses
    return dataclasses.replace(config, dp_rank=dp_rank)


def test_cluster_store_dp_ranks_share_pages(tmp_path):
    """"cluster": true: two engine processes (DP ranks 0 and 1) on one directory are two nodes
    of a cluster store: each writes its own namespace (node id from its DP rank) and prefetches
    the pages the other backed up, bit-exact; a backup of pages the other holds stores nothing."""
    pools = [build_pool(False, "page_first_direct") for _ in range(3)]
    fill_random(pools[0], seed=1)
    fill_random(pools[1], seed=2)
    first, second = page_hashes(NUM_PAGES, seed=1), page_hashes(NUM_PAGES, seed=2)
    src = list(range(NUM_PAGES))
    dst = list(range(NUM_PAGES, 2 * NUM_PAGES))
    dp0 = attach(_dp(storage_config(tmp_path, cluster=True), 0), pools[0])
    try:
        assert controller_backup(dp0, first, host_indices_for(src)) == NUM_PAGES
        dp1 = attach(_dp(storage_config(tmp_path, cluster=True), 1), pools[1])
        try:
            assert dp0.tier.node_id.endswith("-dp0") and dp1.tier.node_id.endswith("-dp1")
            shard = os.path.dirname(dp0.tier.store.directories[0])
            assert sorted(os.listdir(shard)) == sorted([START_LOCK, dp0.tier.node_id,
                                                        dp1.tier.node_id])
            # dp1 reads dp0's pages
            assert controller_hit_query(dp1, first) == NUM_PAGES
            assert controller_prefetch(dp1, first, host_indices_for(dst)) == NUM_PAGES
            for s, d in zip(src, dst):
                assert torch.equal(page_bytes(pools[0], s), page_bytes(pools[1], d))
            # dedup: dp1 backing up the same pages stores none of them itself
            assert controller_backup(dp1, first, host_indices_for(dst)) == NUM_PAGES
            assert dp1.tier.own.stats()["pages_stored"] == 0
            # dp0 (opened first) finds dp1's pages once dp1 writes them
            fill_random(pools[1], seed=2)
            assert controller_backup(dp1, second, host_indices_for(src)) == NUM_PAGES
            deadline = time.monotonic() + 10
            while controller_hit_query(dp0, second) < NUM_PAGES and time.monotonic() < deadline:
                time.sleep(0.05)
            assert controller_prefetch(dp0, second, host_indices_for(dst)) == NUM_PAGES
            for s, d in zip(src, dst):
                assert torch.equal(page_bytes(pools[1], s), page_bytes(pools[0], d))
            assert dp0.tier_stats()["cluster"]["peer_hits"] == NUM_PAGES
        finally:
            dp1.close()
    finally:
        dp0.close()


def test_cluster_store_mla_follower_rank_reads_every_node(tmp_path):
    """MLA with TP 2 in a cluster: the writer rank of DP rank 0 writes; the other TP rank of
    DP rank 1 (a read-only cluster node) reads those pages."""
    pools = [build_pool(True, "page_first_direct") for _ in range(2)]
    fill_random(pools[0], seed=3)
    hashes = page_hashes(NUM_PAGES, seed=3)
    writer = attach(_dp(storage_config(tmp_path, mla=True, tp_size=2, cluster=True), 0),
                    pools[0])
    try:
        assert controller_backup(writer, hashes, host_indices_for(range(NUM_PAGES))) == NUM_PAGES
        reader = attach(_dp(storage_config(tmp_path, mla=True, tp_rank=1, tp_size=2,
                                           cluster=True), 1), pools[1])
        try:
            assert reader.tier.own is None and reader.tier.read_only
            assert controller_hit_query(reader, hashes) == NUM_PAGES
            dst = list(range(NUM_PAGES, 2 * NUM_PAGES))
            assert controller_prefetch(reader, hashes, host_indices_for(dst)) == NUM_PAGES
            for s, d in zip(range(NUM_PAGES), dst):
                assert torch.equal(page_bytes(pools[0], s), page_bytes(pools[1], d))
        finally:
            reader.close()
    finally:
        writer.close()
