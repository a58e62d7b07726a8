"""gdskv as LightLLM's disk cache: LightLLM's own CpuKvCacheClient, DiskCacheWorker and its cache
manager's disk match, run against the light_mem module of integrations/light_mem.

Needs the LightLLM venv (tests/run_lightllm.sh: LightLLM from ../shared/upstream, installed
--no-deps, and light_mem); skipped with that reason elsewhere.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time

import pytest
import torch

try:
    from lightllm.server.multi_level_kv_cache.cpu_cache_client import CpuKvCacheClient
    from lightllm.server.multi_level_kv_cache.disk_cache_worker import DiskCacheWorker
    from lightllm.server.multi_level_kv_cache.manager import MultiLevelKVCacheManager
    from lightllm.utils.kv_cache_utils import compute_token_list_hash
    import light_mem
except ImportError as exc:
    pytest.skip(f"LightLLM or light_mem is not importable ({exc}); these tests run in the "
                f"LightLLM venv: bash tests/run_lightllm.sh", allow_module_level=True)

from gdskv.adapters import lightllm as adapter  # noqa: E402
from gdskv.adapters.lightllm import LocalCacheService, PageState  # noqa: E402
from gdskv.config import TierConfig  # noqa: E402

from lightllm_env import start_server_env  # noqa: E402

TOKENS_PER_PAGE = 4
SHAPES = ["mha", "mla", "int8kv"]


class Server:
    """The pieces of LightLLM's multi-level cache manager process that touch the disk cache."""

    def __init__(self, tmp_path, shape: str, *, cpu_pages: int = 16, disk_dir=None):
        self.args = start_server_env(tmp_path, shape, cpu_pages=cpu_pages,
                                     token_page_size=TOKENS_PER_PAGE, disk_dir=disk_dir)
        self.client = CpuKvCacheClient(only_create_meta_data=False, init_shm_data=True)
        self.worker = DiskCacheWorker(disk_cache_storage_size=self.args["disk_cache_storage_size"],
                                      cpu_cache_client=self.client,
                                      disk_cache_dir=self.args["disk_cache_dir"])
        # the manager's own _cpu_cache_match/_disk_cache_match, on the state they read
        self.manager = object.__new__(MultiLevelKVCacheManager)
        self.manager.args = type("Args", (), {"enable_disk_cache": True})()
        self.manager.cpu_cache_client = self.client
        self.manager.disk_cache_worker = self.worker
        self.pages = self.client.cpu_kv_cache_tensor.flatten(1).view(torch.uint8)

    @property
    def tier(self):
        return self.worker.service.tier

    def from_gpu(self, hashes: list[int], data: list[torch.Tensor]) -> list[int]:
        """What the router does after a prefill: CPU pages for the hashes, filled, ready, and
        queued for disk offload."""
        with self._locked():
            pages, _ = self.client.allocate_pages(hashes, disk_offload_enable=True)
            assert -1 not in pages, "the test's CPU cache is too small"
            for p, d in zip(pages, data):
                self.pages[p].copy_(d)
            self.client.update_pages_status_to_ready(
                pages, deref=True, disk_offload_enable=True,
                token_num_in_page_list=len(pages) * TOKENS_PER_PAGE)
        return pages

    def offload(self) -> None:
        """One pass of DiskCacheWorker.run's loop (its own methods)."""
        for payloads in self.worker._gather_offload_payloads():
            self.worker._persist_pages_to_disk(payloads)

    def evict_cpu(self) -> None:
        """Fill the whole CPU cache with other pages, so LRU reuses every page."""
        other = [(1 << 127) + i for i in range(self.client.page_num)]
        with self._locked():
            pages, _ = self.client.allocate_pages(other, disk_offload_enable=False)
            assert -1 not in pages
            self.client.update_pages_status_to_ready(pages, deref=True)

    def match(self, hashes: list[int]) -> tuple[list[int], int]:
        """The manager's match of one request: CPU prefix, then disk."""
        cpu = self.manager._cpu_cache_match(hashes)
        return self.manager._disk_cache_match(hashes, cpu)

    def ref_counts(self, pages) -> list[int]:
        items = self.client.page_items.linked_items
        return [items[p].ref_count for p in pages]

    def cpu_has(self, h: int) -> bool:
        return self.client.page_hash_dict.get(h) is not None

    def _locked(self):
        lock = self.client.lock

        class _Held:
            def __enter__(self):
                lock.acquire_sleep1ms()

            def __exit__(self, *exc):
                lock.release()
        return _Held()

    def close(self) -> None:
        self.worker.service.close()


@pytest.fixture
def servers():
    made = []
    yield made
    for s in made:
        s.close()


def request(n_pages: int, seed: int) -> list[int]:
    """LightLLM's cumulative per-page hashes of a prompt of n_pages full pages."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32000, (n_pages * TOKENS_PER_PAGE + 1,), generator=g).tolist()
    return compute_token_list_hash(tokens, TOKENS_PER_PAGE)


def page_data(server: Server, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (server.pages.shape[1],), dtype=torch.uint8, generator=g)
            for _ in range(n)]


def on_disk_only(tmp_path, servers, shape: str, n: int, seed: int):
    """A server whose n pages of one request went to disk and then left the CPU cache."""
    s = Server(tmp_path, shape)
    servers.append(s)
    hashes, data = request(n, seed=seed), page_data(s, n, seed=seed + 1)
    s.from_gpu(hashes, data)
    s.offload()
    s.evict_cpu()
    return s, hashes, data


def assert_loaded(s: Server, found: list[int], data: list[torch.Tensor]) -> None:
    assert len(found) == len(data)
    for p, d in zip(found, data):
        assert torch.equal(s.pages[p], d)


@pytest.mark.parametrize("shape", SHAPES)
def test_offload_evict_match_load_bit_exact(tmp_path, servers, shape):
    s = Server(tmp_path, shape)
    servers.append(s)
    hashes, data = request(6, seed=1), page_data(s, 6, seed=2)
    pages = s.from_gpu(hashes, data)
    assert s.ref_counts(pages) == [1] * 6  # held for the disk offload
    s.offload()
    assert s.worker.service.query(hashes) == [True] * 6
    assert s.ref_counts(pages) == [0] * 6, "the worker releases pages once they are durable"
    assert s.tier.stats()["pages_stored"] == 6
    assert s.worker.service.layout.model_name == f"model-{shape}"
    s.evict_cpu()
    assert not any(s.cpu_has(h) for h in hashes)
    assert s.worker.query_loadable_pages(hashes, 0) == 6

    found, from_disk = s.match(hashes)
    assert from_disk == 6
    assert_loaded(s, found, data)
    assert s.client.check_allpages_ready(found)


def test_cpu_prefix_then_disk_rest(tmp_path, servers):
    s, hashes, data = on_disk_only(tmp_path, servers, "mha", 6, seed=3)
    # a later request brought the first two pages back to the CPU cache
    front = s.from_gpu(hashes[:2], data[:2])
    s.offload()  # already on disk: released at once (page_already_list)
    assert s.ref_counts(front) == [0, 0]
    found, from_disk = s.match(hashes)
    assert found[:2] == front and from_disk == 4
    assert_loaded(s, found, data)


def test_new_service_over_the_same_directory_still_matches(tmp_path, servers):
    disk = tmp_path / "disk"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    s = Server(tmp_path / "a", "mla", disk_dir=disk)
    hashes, data = request(5, seed=5), page_data(s, 5, seed=6)
    s.from_gpu(hashes, data)
    s.offload()
    s.close()
    # the server restarts: a new CPU cache (empty) and a new service over the same store
    t = Server(tmp_path / "b", "mla", disk_dir=disk)
    servers.append(t)
    assert t.tier.stats()["recovered_pages"] == 5
    found, from_disk = t.match(hashes)
    assert from_disk == 5
    assert_loaded(t, found, data)


def test_cluster_store_servers_on_one_mount_share_pages(tmp_path, servers, monkeypatch):
    """GDSKV_CLUSTER=true: two LightLLM servers whose --disk_cache_dir is one shared mount are
    two nodes of a cluster store (LightLLM's own disk cache worker and cache manager match): b
    finds a's pages on disk and loads them bit-exact; a page a holds is not written again by b."""
    disk = tmp_path / "disk"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.setenv("GDSKV_CLUSTER", "true")
    monkeypatch.setenv("GDSKV_CLUSTER_FOLLOW_MS", "1")
    monkeypatch.setenv("GDSKV_NODE_ID", "server-a")
    a = Server(tmp_path / "a", "mha", disk_dir=disk)
    servers.append(a)
    hashes, data = request(5, seed=31), page_data(a, 5, seed=32)
    a.from_gpu(hashes, data)
    a.offload()
    monkeypatch.setenv("GDSKV_NODE_ID", "server-b")
    b = Server(tmp_path / "b", "mha", disk_dir=disk)
    servers.append(b)
    assert sorted(os.listdir(disk / "gdskv")) == [".gdskv-cluster.lock", "server-a", "server-b"]
    found, from_disk = b.match(hashes)
    assert from_disk == 5
    assert_loaded(b, found, data)
    assert b.tier.stats()["cluster"]["peer_hits"] == 5
    # the pages a holds count as stored for b: a write of them stores nothing of b's own
    assert b.worker.service.query(hashes) == [True] * 5
    task = b.worker.service.create(hashes, torch.tensor(found), "w")
    deadline = time.monotonic() + 30
    while not task.ready() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert task.page_already_list == found
    assert task.state() == [PageState.Finished] * 5
    assert b.tier.own.stats()["pages_stored"] == 0


def test_read_failure_loads_nothing(tmp_path, servers, caplog):
    s, hashes, _ = on_disk_only(tmp_path, servers, "int8kv", 4, seed=7)

    def broken_read(buffer, extents):
        raise OSError(5, "Input/output error (injected)")
    s.tier.backend.read = broken_read
    # (a small call's read on the calling thread fails the same way)
    real_now = s.tier.backend.move_on_caller
    s.tier.backend.move_on_caller = lambda op, buffer, extents: (
        broken_read(buffer, extents) if op == "read" else real_now(op, buffer, extents))
    with caplog.at_level(logging.ERROR):
        found, from_disk = s.match(hashes)
    assert (found, from_disk) == ([], 0)
    # the pages LightLLM allocated for the load went back empty: nothing claims these hashes
    assert not any(s.cpu_has(h) for h in hashes)


def test_corrupt_pages_are_not_loaded(tmp_path, servers):
    s, hashes, _ = on_disk_only(tmp_path, servers, "mha", 4, seed=9)
    slot_bytes = s.worker.service.layout.slot_bytes
    for f in s.tier.store.files:  # flip bytes in every slot's payload
        with open(f.path, "r+b") as fh:
            raw = bytearray(fh.read(slot_bytes * 8))
            for i in range(0, len(raw), 101):
                raw[i] ^= 0xFF
            fh.seek(0)
            fh.write(raw)
    found, from_disk = s.match(hashes)
    assert (found, from_disk) == ([], 0)
    assert not any(s.cpu_has(h) for h in hashes)
    assert s.worker.service.query(hashes) == [False] * 4, "corrupt pages leave the directory"


def test_write_failure_releases_pages_and_stores_nothing(tmp_path, servers):
    s = Server(tmp_path, "mha")
    servers.append(s)
    hashes, data = request(3, seed=11), page_data(s, 3, seed=12)
    pages = s.from_gpu(hashes, data)

    def broken_write(buffer, extents):
        raise OSError(28, "No space left on device (injected)")
    s.tier.backend.write = broken_write
    real_now = s.tier.backend.move_on_caller
    s.tier.backend.move_on_caller = lambda op, buffer, extents: (
        broken_write(buffer, extents) if op == "write" else real_now(op, buffer, extents))
    s.offload()
    assert s.ref_counts(pages) == [0] * 3, "LightLLM gets its pages back"
    assert s.worker.service.query(hashes) == [False] * 3
    assert s.worker.query_loadable_pages(hashes, 0) == 0


# -- the adapter on its own (LightMem's API over a plain tensor) ---------------------------------

def service(tmp_path, pages=32, page_bytes=6000, **kw) -> LocalCacheService:
    cache = torch.zeros(pages, page_bytes, dtype=torch.uint8)
    config = TierConfig(directories=(str(tmp_path / "store"),), capacity="8MiB",
                        staging_size="256KiB", io_chunk_size="64KiB", io_threads=4,
                        backend="posix", files_per_dir=2)
    (tmp_path / "store").mkdir(exist_ok=True)
    return LocalCacheService(cache, str(tmp_path / "cache_file"), 0, config=config,
                             capacity_from_config=True, **kw)


def wait(task, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not task.ready():
        assert time.monotonic() < deadline, "task did not end"
        time.sleep(0.001)


def fill(svc, rows, seed):
    g = torch.Generator().manual_seed(seed)
    for r in rows:
        svc._cache[r] = torch.randint(0, 256, (svc._cache.shape[1],), dtype=torch.uint8,
                                      generator=g)


def test_blocks_of_n_pages(tmp_path):
    svc = service(tmp_path, pages_per_block=4)
    try:
        hashes = list(range(1000, 1010))  # 10 pages: blocks of 4, 4 and 2
        fill(svc, range(10), seed=1)
        written = svc._cache[:10].clone()
        task = svc.create(hashes, torch.arange(10, dtype=torch.int32), "w")
        wait(task)
        assert task.state() == [PageState.Finished] * 3 and task.data_safe()
        assert svc.query(hashes) == [True] * 3
        svc.tier.evict([adapter.hash_key(1005)])
        assert svc.query(hashes) == [True, False, True], "a block is there when all its pages are"
        # a read from start_pos 6 starts at its block (page 4) and puts page i at index i + 16
        svc._cache[16:].zero_()
        task = svc.create(hashes, torch.arange(16, 26, dtype=torch.int32), "r", start_pos=6)
        wait(task)
        assert task.state() == [PageState.Aborted, PageState.Finished]
        assert torch.equal(svc._cache[24:26], written[8:10])
        assert not svc._cache[16:20].any(), "nothing before the start block is touched"
        # a write skips what the disk has: those page indexes come back at once
        task = svc.create(hashes[:8], torch.arange(8, dtype=torch.int32), "w")
        assert sorted(task.page_already_list) == [0, 1, 2, 3, 4, 6, 7]
        wait(task)
        assert task.state() == [PageState.Finished] * 2 and svc.query(hashes[:8]) == [True] * 2
        assert svc.active_threads("r") == 0 and svc.active_threads("w") == 0
    finally:
        svc.close()


def test_many_readers_while_writing(tmp_path):
    """LightLLM's manager loads from up to 500 threads while the worker writes."""
    svc = service(tmp_path, pages=96, page_bytes=5000, num_worker=8)
    try:
        fill(svc, range(96), seed=2)
        expected = svc._cache.clone()
        first = list(range(1, 17))
        wait(svc.create(first, torch.arange(16, dtype=torch.int32), "w"))
        errors: list = []

        def reader(n):
            try:  # thread n reads the 16 stored pages into rows 32 + ... (its own pair)
                rows = [32 + 2 * n, 33 + 2 * n]
                for _ in range(5):
                    pick = [first[(n + 0) % 16], first[(n + 1) % 16]]
                    t = svc.create(pick, torch.tensor(rows, dtype=torch.int32), "r")
                    wait(t)
                    if t.state() != [PageState.Finished] * 2:
                        errors.append((n, t.state()))
                    for r, h in zip(rows, pick):
                        if not torch.equal(svc._cache[r], expected[h - 1]):
                            errors.append((n, "wrong bytes"))
            except Exception as exc:  # pragma: no cover - reported below
                errors.append((n, exc))

        def writer():
            for i in range(8):
                hs = [100 + 2 * i, 101 + 2 * i]
                wait(svc.create(hs, torch.tensor([16 + 2 * i % 16, 17 + 2 * i % 16],
                                                 dtype=torch.int32), "w"))
        threads = [threading.Thread(target=reader, args=(n,)) for n in range(32)]
        threads.append(threading.Thread(target=writer))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[:5]
        assert all(svc.query(list(range(100, 116))))
    finally:
        svc.close()


def test_abort_stops_touching_the_cache(tmp_path, monkeypatch):
    svc = service(tmp_path, pages=32, page_bytes=4096)
    try:
        fill(svc, range(16), seed=3)
        hashes = list(range(500, 516))
        wait(svc.create(hashes, torch.arange(16, dtype=torch.int32), "w"))
        monkeypatch.setattr(adapter, "CALL_BYTES", 2 * 4096)  # 8 tier calls of 2 pages
        real_read = svc.tier.backend.read

        def slow_read(buffer, extents):
            time.sleep(0.05)
            return real_read(buffer, extents)
        svc.tier.backend.read = slow_read
        real_now = svc.tier.backend.move_on_caller

        def slow_now(op, buffer, extents):
            if op == "read":
                time.sleep(0.05)
            return real_now(op, buffer, extents)
        svc.tier.backend.move_on_caller = slow_now
        svc._cache[16:].zero_()
        task = svc.create(hashes, torch.arange(16, 32, dtype=torch.int32), "r")
        time.sleep(0.08)
        svc.abort(task)
        after_abort = svc._cache[16:].clone()
        wait(task)
        time.sleep(0.2)
        assert torch.equal(svc._cache[16:], after_abort), "written into after abort returned"
        states = task.state()
        assert PageState.Aborted in states and states[-1] is PageState.Aborted
        for i, st in enumerate(states):  # finished pages are whole and right
            if st is PageState.Finished:
                assert torch.equal(svc._cache[16 + i], svc._cache[i])
    finally:
        svc.close()


def test_pages_larger_than_a_staging_part_are_served(tmp_path):
    """The page size is LightLLM's choice: staging grows to one page per stage."""
    svc = service(tmp_path, pages=4, page_bytes=300_000)  # staging 256 KiB: 64 KiB a stage
    try:
        assert svc.tier.config.staging_size == 4 * svc.layout.slot_bytes
        fill(svc, range(2), seed=5)
        wait(svc.create([7, 8], torch.tensor([0, 1], dtype=torch.int32), "w"))
        task = svc.create([7, 8], torch.tensor([2, 3], dtype=torch.int32), "r")
        wait(task)
        assert task.state() == [PageState.Finished] * 2
        assert torch.equal(svc._cache[2:4], svc._cache[0:2])
    finally:
        svc.close()


def test_closed_service_fails_tasks_not_threads(tmp_path):
    svc = service(tmp_path)
    svc.tier.close()
    task = svc.create([1, 2], torch.tensor([0, 1], dtype=torch.int32), "r")
    wait(task)
    assert task.state() == [PageState.Aborted] * 2 and svc.query([1, 2]) == [False, False]
    svc.close()


@pytest.mark.parametrize("call, match", [
    (lambda s: s.create([1], torch.tensor([0]), "x"), r"mode must be 'r'.*got 'x'"),
    (lambda s: s.create([1, 2], torch.tensor([0]), "r"), r"1 page indexes for 2 hashes"),
    (lambda s: s.create([1], torch.tensor([32]), "w"), r"page index 32 is outside .*0\.\.31"),
    (lambda s: s.create([1], torch.tensor([0.0]), "w"), r"1-D integer tensor"),
    (lambda s: s.create([1], torch.tensor([True]), "w"), r"1-D integer tensor"),
    (lambda s: s.create([1 << 128], torch.tensor([0]), "w"), r"not a 128-bit"),
    (lambda s: s.create([1], torch.tensor([0]), "r", start_pos=2), r"start_pos must be .*0\.\.1"),
    (lambda s: s.active_threads("rw"), r"mode must be 'r' or 'w'"),
])
def test_malformed_calls_name_the_argument(tmp_path, call, match):
    svc = service(tmp_path)
    try:
        with pytest.raises(ValueError, match=match):
            call(svc)
    finally:
        svc.close()


@pytest.mark.parametrize("tensor, match", [
    (torch.zeros(4, 8, dtype=torch.int8), "dtype torch.int8"),
    (torch.zeros(4, 2, 8, dtype=torch.uint8), "3-D"),
    (torch.zeros(8, 4, dtype=torch.uint8).t(), "not contiguous"),
])
def test_bad_cache_tensor(tmp_path, tensor, match):
    with pytest.raises(ValueError, match=match):
        LocalCacheService(tensor, str(tmp_path / "f"), 1 << 20)


# -- the light_mem module ------------------------------------------------------------------------

def test_light_mem_is_gdskv_and_configured_from_lightllm_and_env(tmp_path, monkeypatch, caplog):
    assert light_mem.PyState is PageState
    cache = torch.zeros(8, 5000, dtype=torch.uint8)
    monkeypatch.setattr(light_mem, "_announced", False)
    with caplog.at_level(logging.WARNING, logger="gdskv.lightllm"):
        svc = light_mem.PyLocalCacheService(cache, str(tmp_path / "cache_file"),
                                            storage_size=1 << 20, num_shard=8, num_worker=2)
        svc2 = light_mem.PyLocalCacheService(cache, str(tmp_path / "other" / "cache_file"),
                                             storage_size=1 << 20)
    try:
        assert list(svc.tier.store.directories) == [str(tmp_path / "gdskv")]
        assert svc.tier.config.capacity == 1 << 20
        assert sum("gdskv serves LightLLM's disk cache" in r.message for r in caplog.records) == 1
    finally:
        svc.close()
        svc2.close()
    monkeypatch.setenv("GDSKV_CAPACITY", "2MiB")
    monkeypatch.setenv("GDSKV_DIRECTORIES", str(tmp_path / "elsewhere"))
    (tmp_path / "elsewhere").mkdir()
    svc = light_mem.PyLocalCacheService(cache, str(tmp_path / "cache_file"), storage_size=1 << 20)
    try:
        assert svc.tier.config.capacity == 2 << 20
        assert list(svc.tier.store.directories) == [str(tmp_path / "elsewhere")]
    finally:
        svc.close()


def test_light_mem_refuses_to_import_beside_a_real_lightmem(monkeypatch):
    import importlib.metadata as md
    real = md.packages_distributions()
    monkeypatch.setattr(md, "packages_distributions",
                        lambda: {**real, "light_mem": ["gdskv-light-mem", "light_mem"]})
    with pytest.raises(ImportError, match=r"both install the light_mem package.*pip uninstall"):
        importlib.reload(light_mem)
    monkeypatch.undo()
    importlib.reload(light_mem)


def test_store_of_another_model_is_refused(tmp_path, monkeypatch):
    """Two models of one page size sharing a --disk_cache_dir never read each other's pages."""
    from gdskv.store import StoreMismatchError
    cache = torch.zeros(4, 3000, dtype=torch.uint8)
    monkeypatch.setenv("LIGHTLLM_START_ARGS", '{"model_dir": "/models/Llama-A/"}')
    svc = light_mem.PyLocalCacheService(cache, str(tmp_path / "cache_file"), 1 << 20)
    assert svc.layout.model_name == "Llama-A"
    svc.close()
    monkeypatch.setenv("LIGHTLLM_START_ARGS", '{"model_dir": "/models/Llama-B"}')
    with pytest.raises(StoreMismatchError, match="written for layout"):
        light_mem.PyLocalCacheService(cache, str(tmp_path / "cache_file"), 1 << 20)
