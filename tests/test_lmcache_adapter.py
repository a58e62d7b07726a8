"""gdskv's LMCache L2 adapter on the real lmcache package (its own venv: tests/run_lmcache.sh).

The adapter is built through LMCache's own config parser and plugin loader, driven through
L2AdapterInterface as LMCache's controllers drive it (submit, wait on the eventfd, query) and
checked bit-exact with distinct random bytes per object (LMCache's bench fills each object with
one constant byte).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lmcache", reason="the real lmcache package lives in .venv-lmcache "
                    "(bash tests/run_lmcache.sh)")

from lmcache.v1.distributed.api import ObjectKey  # noqa: E402
from lmcache.v1.distributed.l2_adapters import create_l2_adapter  # noqa: E402
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config  # noqa: E402
from lmcache.v1.memory_management import (MemoryFormat, MemoryObjMetadata,  # noqa: E402
                                          TensorMemoryObj)
from lmcache.v1.platform import consume_fd  # noqa: E402

from gdskv.adapters.lmcache import GdskvL2Adapter, object_key_string  # noqa: E402
from gdskv.backends.base import IOOutcome  # noqa: E402
from gdskv.config import ConfigError  # noqa: E402
from gdskv.memory import alloc_host  # noqa: E402
from reliability_helpers import flip_byte  # noqa: E402

OBJ = 20_000          # one full chunk; not a 4 KiB multiple, so every slot has padding
SLOTS = 16


def spec(directory, **params) -> dict:
    base = {"directories": [str(directory)], "capacity": SLOTS * 20480,
            "object_bytes": OBJ, "staging_size": 4 * 20480, "io_chunk_size": 2 * 20480,
            "files_per_dir": 2, "io_threads": 2}
    base.update(params)
    return {"type": "plugin", "module_path": "gdskv.adapters.lmcache",
            "class_name": "GdskvL2Adapter", "adapter_params": base}


def make_adapter(directory, **params) -> GdskvL2Adapter:
    """Through LMCache's parser and plugin loader, as `--l2-adapter JSON` is."""
    ns = argparse.Namespace(l2_adapter=[json.dumps(spec(directory, **params))])
    cfg = parse_args_to_l2_adapters_config(ns).adapters[0]
    adapter = create_l2_adapter(cfg)
    assert type(adapter) is GdskvL2Adapter
    return adapter


def key(i: int, salt: str = "") -> ObjectKey:
    return ObjectKey(chunk_hash=i.to_bytes(8, "big") + b"\x5a", model_name="org/model-7b",
                     kv_rank=0x01000100 + (i % 3), object_group_id=i % 2, cache_salt=salt)


def obj(data: torch.Tensor, physical: int | None = None, *, aligned: bool = False
        ) -> TensorMemoryObj:
    """An L1 object of data.numel() logical bytes in a buffer of ``physical`` bytes (a short
    last chunk: logical below physical); ``aligned``: the buffer starts on a 4 KiB boundary
    (as LMCache's L1 allocator gives with --l1-align-bytes), so the tier moves it in place;
    else one byte past one (through staging where the store has O_DIRECT)."""
    physical = physical or data.numel()
    raw = alloc_host(physical + 4096, pin=False)[0 if aligned else 1:][:physical]
    raw.fill_(0xEE)
    raw[:data.numel()] = data
    meta = MemoryObjMetadata(shape=torch.Size([data.numel()]), dtype=torch.uint8, address=0,
                             phy_size=physical, fmt=MemoryFormat.KV_2LTD, ref_count=1)
    return TensorMemoryObj(raw_data=raw, metadata=meta, parent_allocator=None)


def random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def wait(fd: int, query, task, timeout: float = 30.0):
    """Wait as LMCache's controllers do: poll the eventfd, then query the task."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    for _ in range(int(timeout * 100)):
        result = query(task)
        if result is not None:
            return result
        if poller.poll(10):
            consume_fd(fd)
    raise AssertionError(f"task {task} did not complete in {timeout} s")


def store(adapter, keys, objects) -> bool:
    task = adapter.submit_store_task(keys, objects)
    result = wait(adapter.get_store_event_fd(),
                  lambda t: adapter.pop_completed_store_tasks().get(t), task)
    return result.is_successful()


def lookup(adapter, keys) -> list[bool]:
    task = adapter.submit_lookup_and_lock_task(keys, {})
    bitmap = wait(adapter.get_lookup_and_lock_event_fd(), adapter.query_lookup_and_lock_result,
                  task)
    return [bitmap.test(i) for i in range(len(keys))]


def load(adapter, keys, objects) -> list[bool]:
    task = adapter.submit_load_task(keys, objects)
    bitmap = wait(adapter.get_load_event_fd(), adapter.query_load_result, task)
    return [bitmap.test(i) for i in range(len(keys))]


def listed(adapter) -> set:
    out, cursor = set(), None
    while True:
        page = adapter.list_l2_keys(page_size=3, cursor=cursor)
        out |= {e.key.to_object_key() for e in page.entries}
        assert all(e.size_bytes == OBJ for e in page.entries)
        if page.next_page_token is None:
            return out
        cursor = page.next_page_token


@pytest.fixture
def adapter(tmp_path):
    a = make_adapter(tmp_path)
    yield a
    a.close()


@pytest.mark.parametrize("aligned", [False, True], ids=["unaligned-l1", "aligned-l1"])
def test_round_trip_bit_exact(adapter, aligned):
    keys = [key(i, salt="u1" if i % 4 == 0 else "") for i in range(6)]
    data = [random_bytes(OBJ, i) for i in range(6)]
    assert store(adapter, keys, [obj(d, aligned=aligned) for d in data])
    assert lookup(adapter, keys + [key(99)]) == [True] * 6 + [False]
    out = [obj(torch.zeros(OBJ, dtype=torch.uint8), aligned=aligned) for _ in keys]
    assert load(adapter, keys, out) == [True] * 6
    for d, o in zip(data, out):
        assert torch.equal(o.raw_data, d)
    stats = adapter.tier.stats()
    if aligned:  # LMCache's aligned L1 objects move in place: no staging copy
        assert stats["pages_written_in_place"] == 6 and stats["pages_read_in_place"] == 6
    adapter.submit_unlock(keys)
    assert listed(adapter) == set(keys)
    usage = adapter.get_usage()
    assert usage.total_bytes_used == 6 * OBJ == adapter.tier.stats()["pages_stored"] * OBJ
    assert usage.total_capacity_bytes == adapter.tier.store.num_slots * OBJ
    assert usage.bytes_by_cache_salt == {"u1": 2 * OBJ, "": 4 * OBJ}
    # storing a key again is a success that LMCache must not count twice
    assert store(adapter, keys[:2], [obj(d) for d in data[:2]])
    assert adapter.get_usage().total_bytes_used == 6 * OBJ
    adapter.delete(keys[:3] + [key(99)])
    assert adapter.get_usage().total_bytes_used == 3 * OBJ
    assert lookup(adapter, keys) == [False] * 3 + [True] * 3
    assert load(adapter, keys[:3], [obj(torch.zeros(OBJ, dtype=torch.uint8))
                                    for _ in range(3)]) == [False] * 3
    assert listed(adapter) == set(keys[3:])
    status = adapter.report_status()
    assert status["is_healthy"] and status["objects_stored"] == 3
    assert status["locked_objects"] == 3  # the last lookup's pins, not yet unlocked
    assert listed(adapter) == {k for k in keys[3:]}


def test_short_last_chunk(adapter):
    """A short object: its logical bytes round-trip; the bytes after them in LMCache's buffer
    are never written by a load; a full object beside it is unaffected."""
    short, full = random_bytes(7_001, 1), random_bytes(OBJ, 2)
    assert store(adapter, [key(1), key(2)], [obj(short, physical=OBJ), obj(full)])
    into = obj(torch.zeros(7_001, dtype=torch.uint8), physical=OBJ)
    full_into = obj(torch.zeros(OBJ, dtype=torch.uint8))
    assert load(adapter, [key(1), key(2)], [into, full_into]) == [True, True]
    assert torch.equal(into.raw_data[:7_001], short)
    assert (into.raw_data[7_001:] == 0xEE).all()
    assert torch.equal(full_into.raw_data, full)


def test_typed_multi_dim_buffer_round_trips_its_bytes(adapter):
    """An object whose buffer is a typed, multi-dimensional tensor (bf16 KV rows) moves as its
    bytes: the adapter's byte view of it, not only the 1-D uint8 buffers the bench gives."""
    data = random_bytes(OBJ, 11)
    typed = obj(data, aligned=True)
    typed.raw_data = typed.raw_data.view(torch.bfloat16).view(2, OBJ // 4)
    assert store(adapter, [key(1)], [typed])
    out = obj(torch.zeros(OBJ, dtype=torch.uint8), aligned=True)
    assert load(adapter, [key(1)], [out]) == [True]
    assert torch.equal(out.raw_data, data)


def test_object_larger_than_object_bytes_fails_the_task(adapter):
    assert not store(adapter, [key(1)], [obj(random_bytes(OBJ + 1, 1))])
    assert lookup(adapter, [key(1)]) == [False]
    assert adapter.get_usage().total_bytes_used == 0


def test_lock_holds_against_eviction(adapter):
    data = random_bytes(OBJ, 7)
    assert store(adapter, [key(1)], [obj(data)])
    assert lookup(adapter, [key(1)]) == [True]
    adapter.delete([key(1)])  # LMCache's eviction controller drops it while it is locked
    assert adapter.get_usage().total_bytes_used == OBJ  # counted until it really goes
    out = obj(torch.zeros(OBJ, dtype=torch.uint8))
    assert load(adapter, [key(1)], [out]) == [True]
    assert torch.equal(out.raw_data, data)
    adapter.submit_unlock([key(1)])
    assert adapter.get_usage().total_bytes_used == 0
    assert lookup(adapter, [key(1)]) == [False]
    # the slot went back at the unlock: the store takes SLOTS new objects again
    keys = [key(100 + i) for i in range(adapter.tier.store.num_slots)]
    assert store(adapter, keys, [obj(random_bytes(OBJ, 100 + i)) for i in range(len(keys))])


def test_full_store_fails_stores_and_never_evicts_by_itself(adapter):
    n = adapter.tier.store.num_slots
    keys = [key(i) for i in range(n)]
    assert store(adapter, keys, [obj(random_bytes(OBJ, i)) for i in range(n)])
    assert lookup(adapter, keys[:1]) == [True]  # locked; all others unlocked
    assert not store(adapter, [key(n)], [obj(random_bytes(OBJ, n))])
    assert lookup(adapter, keys[1:]) == [True] * (n - 1)  # nothing evicted behind LMCache
    assert adapter.get_usage().total_bytes_used == n * OBJ
    assert adapter.get_usage().usage_fraction == 1.0


def test_restart_keeps_objects_keys_and_usage(tmp_path):
    keys = [key(i, salt="s") for i in range(5)]
    data = [random_bytes(OBJ, 50 + i) for i in range(5)]
    a = make_adapter(tmp_path)
    assert store(a, keys, [obj(d) for d in data])
    a.close()
    b = make_adapter(tmp_path)
    try:
        assert b.get_usage().total_bytes_used == 5 * OBJ
        assert listed(b) == set(keys)
        out = [obj(torch.zeros(OBJ, dtype=torch.uint8)) for _ in keys]
        assert lookup(b, keys) == [True] * 5
        assert load(b, keys, out) == [True] * 5
        assert all(torch.equal(o.raw_data, d) for o, d in zip(out, data))
    finally:
        b.close()


def test_cluster_store_two_lmcache_processes_share_objects(tmp_path):
    """"cluster": true: two LMCache processes (nodes "a" and "b") on one shared directory,
    built through LMCache's plugin loader: b loads a's objects bit-exact, while each one's
    usage, capacity and listing are its own namespace's (the objects it can delete)."""
    opts = dict(cluster=True, cluster_discovery_ms=1, cluster_follow_ms=1)
    a = make_adapter(tmp_path, node_id="a", **opts)
    b = None
    try:
        keys = [key(i) for i in range(4)]
        data = [random_bytes(OBJ, 70 + i) for i in range(4)]
        assert store(a, keys[:2], [obj(d) for d in data[:2]])
        b = make_adapter(tmp_path, node_id="b", **opts)
        # one namespace each, beside the cluster start lock
        assert sorted(os.listdir(tmp_path)) == [".gdskv-cluster.lock", "a", "b"]
        assert store(a, keys[2:], [obj(d) for d in data[2:]])  # after b opened
        assert lookup(b, keys + [key(99)]) == [True] * 4 + [False]
        out = [obj(torch.zeros(OBJ, dtype=torch.uint8)) for _ in keys]
        assert load(b, keys, out) == [True] * 4
        assert all(torch.equal(o.raw_data, d) for o, d in zip(out, data))
        b.submit_unlock(keys)
        assert b.tier.stats()["cluster"]["peer_hits"] == 4
        # b holds none of them itself: nothing counted, listed or deletable there
        assert b.get_usage().total_bytes_used == 0 and listed(b) == set()
        assert a.get_usage().total_bytes_used == 4 * OBJ and listed(a) == set(keys)
        assert b.get_usage().total_capacity_bytes == b.tier.store.num_slots * OBJ
        # b storing what a holds stores nothing (dedup) and still counts nothing
        assert store(b, keys[:1], [obj(data[0])])
        assert b.get_usage().total_bytes_used == 0
        # b's own objects are b's: a reads them, b counts them and deletes them
        assert store(b, [key(50)], [obj(random_bytes(OBJ, 50))])
        assert b.get_usage().total_bytes_used == OBJ and listed(b) == {key(50)}
        assert lookup(a, [key(50)]) == [True]
        a.submit_unlock([key(50)])
        b.delete([key(50)])
        assert b.get_usage().total_bytes_used == 0 and lookup(b, [key(50)]) == [False]
        assert b.report_status()["is_healthy"]
    finally:
        if b is not None:
            b.close()
        a.close()


@pytest.mark.parametrize("aligned", [False, True], ids=["unaligned-l1", "aligned-l1"])
def test_read_error_is_a_miss_never_wrong_bytes(adapter, monkeypatch, aligned):
    assert store(adapter, [key(1)], [obj(random_bytes(OBJ, 1), aligned=aligned)])
    backend = adapter.tier.backend
    real_read = backend.read

    def failing_read(buf, extents):
        fut = real_read(buf, extents)
        fut.result()
        # whatever the failed read left in staging must not reach LMCache; read in place it
        # is in LMCache's buffer, which LMCache drops for a missed object
        for m in ([buf.numpy()] if buf is not None else [m for e in extents for m in e.memory]):
            m[:] = 0x77
        from concurrent.futures import Future
        bad: Future = Future()
        bad.set_result(IOOutcome(errors={i: OSError(5, "injected EIO")
                                         for i in range(len(extents))}))
        return bad

    monkeypatch.setattr(backend, "read", failing_read)
    # (a small call's read on the calling thread fails the same way)
    real_now = backend.move_on_caller
    monkeypatch.setattr(backend, "move_on_caller", lambda op, buf, extents: (
        failing_read(buf, extents) if op == "read" else real_now(op, buf, extents)))
    out = obj(torch.zeros(OBJ, dtype=torch.uint8), aligned=aligned)
    assert load(adapter, [key(1)], [out]) == [False]
    in_place = adapter.tier.stats().get("pages_read_in_place", 0) == 1
    assert in_place == (aligned or not any(f.direct for f in adapter.tier.store.files))
    if not in_place:  # through staging a missed object's buffer is left as it was
        assert (out.raw_data == 0).all()


def test_write_error_fails_the_store_task(adapter, monkeypatch):
    backend = adapter.tier.backend

    def failing_write(buf, extents):
        from concurrent.futures import Future
        bad: Future = Future()
        bad.set_result(IOOutcome(errors={i: OSError(28, "injected ENOSPC")
                                         for i in range(len(extents))}))
        return bad

    monkeypatch.setattr(backend, "write", failing_write)
    real_now = backend.move_on_caller
    monkeypatch.setattr(backend, "move_on_caller", lambda op, buf, extents: (
        failing_write(buf, extents) if op == "write" else real_now(op, buf, extents)))
    assert not store(adapter, [key(1), key(2)], [obj(random_bytes(OBJ, i)) for i in (1, 2)])
    assert lookup(adapter, [key(1), key(2)]) == [False, False]
    assert adapter.get_usage().total_bytes_used == 0


def test_corrupt_page_is_a_miss_and_leaves_lmcache_accounting(adapter):
    assert store(adapter, [key(1), key(2)], [obj(random_bytes(OBJ, i)) for i in (1, 2)])
    flip_byte(adapter.tier, object_key_string(key(1)), 100)
    out = [obj(torch.zeros(OBJ, dtype=torch.uint8)) for _ in range(2)]
    assert load(adapter, [key(1), key(2)], out) == [False, True]
    assert adapter.get_usage().total_bytes_used == OBJ
    assert listed(adapter) == {key(2)}


@pytest.mark.parametrize("params, message", [
    ({"capcity": "1GiB"}, "unknown adapter_params key 'capcity' (did you mean capacity?)"),
    ({"object_bytes": "big"}, "object_bytes"),
    ({"object_bytes": 0}, "object_bytes must be positive, got 0"),
    ({"eviction": "lru"}, "LMCache owns eviction"),
    ({"sync": "sometimes"}, "sync: 'sometimes' is not one of"),
])
def test_bad_adapter_params_stop_start_up(tmp_path, params, message):
    with pytest.raises(ConfigError) as info:
        make_adapter(tmp_path, **params)
    assert message in str(info.value)


def test_missing_object_bytes_and_directories(tmp_path, monkeypatch):
    monkeypatch.delenv("GDSKV_DIRECTORIES", raising=False)
    s = spec(tmp_path)["adapter_params"]
    del s["object_bytes"]
    with pytest.raises(ConfigError, match="needs \"object_bytes\""):
        GdskvL2Adapter(s)
    s = spec(tmp_path)["adapter_params"]
    del s["directories"]
    with pytest.raises(ConfigError, match="no store directory"):
        GdskvL2Adapter(s)


def test_lmcache_bench_l2_verifies_round_trip(tmp_path):
    """LMCache's own qualification tool on the adapter, with its round-trip check on."""
    s = spec(tmp_path, object_bytes=64 << 10, capacity=8 << 20, staging_size=1 << 20,
             io_chunk_size=256 << 10)
    out = tmp_path / "bench.json"
    bench = os.path.join(os.path.dirname(sys.executable), "lmcache")
    run = subprocess.run([bench, "bench", "l2", "--l2-adapter", json.dumps(s), "--num-keys", "16",
                          "--data-size-kb", "64", "--in-flight", "2", "--rounds", "2",
                          "--lookup-max-hit-rate", "1.0", "--no-skip-verify", "--format", "json",
                          "--output", str(out), "-q"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "LMCACHE_DISABLE_BANNER": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    metrics = json.loads(out.read_text())["metrics"]
    ops = {m["operation"]: m for k, m in metrics.items() if k.startswith("op_")}
    for op in ("Store", "Lookup", "Load"):
        assert ops[op]["total_success"] == ops[op]["total_keys"] == 64, ops[op]


def test_calls_after_close_fail_quietly(tmp_path):
    a = make_adapter(tmp_path)
    a.close()
    a.submit_store_task([key(1)], [obj(random_bytes(OBJ, 1))])
    assert list(a.pop_completed_store_tasks().values()) == [-1]
    t = a.submit_load_task([key(1)], [obj(torch.zeros(OBJ, dtype=torch.uint8))])
    assert a.query_load_result(t).test(0) is False
    a.submit_unlock([key(1)])
    a.delete([key(1)])
    assert a.report_status()["state"] == "closed" and not a.report_status()["is_healthy"]
