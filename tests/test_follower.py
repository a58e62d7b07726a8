"""Read-only followers: a tier over a store another tier (another process) owns and writes.

The follower takes no lock, so most tests run writer and follower in one process; one runs the
writer in a spawned child process, as an MLA TP rank's store is written by another rank."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

from gdskv.config import ConfigError, TierConfig
from gdskv.layout import KVLayout
from gdskv.memory import cuda_available
from gdskv.store import StoreError, StoreLockedError
from gdskv.tier import Tier

from conftest import NEEDS_NIXL

LAYOUT = KVLayout(num_layers=2, page_size=4, head_dim=64, kv_heads=2, model_name="follower-test")
PB = LAYOUT.page_bytes


def config(directory, **overrides) -> TierConfig:
    base = dict(directories=(str(directory),), capacity=64 * LAYOUT.slot_bytes,
                staging_size=16 * LAYOUT.slot_bytes, io_chunk_size=4 * LAYOUT.slot_bytes,
                io_threads=2, files_per_dir=2, backend="posix")
    base.update(overrides)
    return TierConfig(**base)


def pages(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (PB,), dtype=torch.uint8, generator=g) for _ in range(n)]


def keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i}" for i in range(n)]


def read(tier: Tier, ks: list[str]) -> tuple[list[bool], list[torch.Tensor]]:
    out = [torch.zeros(PB, dtype=torch.uint8) for _ in ks]
    return tier.get_pages(ks, [[o] for o in out]), out


def put(tier: Tier, ks: list[str], data: list[torch.Tensor]) -> list[bool]:
    return tier.put_pages(ks, [[d] for d in data])


def file_states(directory) -> dict:
    return {name: (st.st_size, st.st_mtime_ns, st.st_ino)
            for name in sorted(os.listdir(directory))
            for st in [os.stat(os.path.join(directory, name))]}


@pytest.fixture
def store_dir(tmp_path):
    d = tmp_path / "store"
    d.mkdir()
    return d


def test_follower_sees_commits_after_it_opened(store_dir):
    with Tier(LAYOUT, config(store_dir), device="cpu") as writer:
        old = pages(3, seed=1)
        assert all(put(writer, keys("old", 3), old))
        with Tier(LAYOUT, config(store_dir, read_only=True), device="cpu") as follower:
            assert follower.stats()["read_only"] is True
            hits, got = read(follower, keys("old", 3))  # recovered at open
            assert hits == [True] * 3 and all(torch.equal(a, b) for a, b in zip(got, old))
            new = pages(5, seed=2)
            assert all(put(writer, keys("new", 5), new))
            # No explicit refresh: the next read after FOLLOW_INTERVAL catches up by itself.
            time.sleep(follower.FOLLOW_INTERVAL * 1.5)
            assert follower.match_prefix(keys("new", 5)) == 5
            assert follower.contains("new-4")
            hits, got = read(follower, keys("new", 5))
            assert hits == [True] * 5 and all(torch.equal(a, b) for a, b in zip(got, new))
            assert follower.stats()["hits"] == 8


def test_follower_sees_evictions(store_dir):
    with Tier(LAYOUT, config(store_dir), device="cpu") as writer, \
            Tier(LAYOUT, config(store_dir, read_only=True), device="cpu") as follower:
        data = pages(4, seed=3)
        assert all(put(writer, keys("p", 4), data))
        follower.refresh()
        assert follower.match_prefix(keys("p", 4)) == 4
        assert writer.evict(["p-1", "p-2"]) == 2
        follower.refresh()
        assert [follower.contains(k) for k in keys("p", 4)] == [True, False, False, True]
        hits, got = read(follower, keys("p", 4))
        assert hits == [True, False, False, True]
        assert torch.equal(got[0], data[0]) and torch.equal(got[3], data[3])
        assert not got[1].any() and not got[2].any()  # a miss leaves the target untouched


def test_follower_survives_writer_compaction(store_dir):
    writer = Tier(LAYOUT, config(store_dir), device="cpu")
    follower = Tier(LAYOUT, config(store_dir, read_only=True), device="cpu")
    try:
        data = pages(6, seed=4)
        assert all(put(writer, keys("c", 6), data))
        writer.evict(["c-0"])
        follower.refresh()
        journal = writer.journal.path
        ino_before = os.stat(journal).st_ino
        writer.journal.records_written = 10 ** 6  # forces compaction at close
        writer.close()
        assert os.stat(journal).st_ino != ino_before, "the writer did not compact its journal"
        resets = follower.journal.resets
        follower.refresh()
        assert follower.journal.resets == resets + 1  # re-read from the start
        hits, got = read(follower, keys("c", 6))
        assert hits == [False] + [True] * 5
        assert all(torch.equal(a, b) for a, b in zip(got[1:], data[1:]))
        # The writer comes back and goes on appending to the compacted journal.
        writer = Tier(LAYOUT, config(store_dir), device="cpu")
        more = pages(3, seed=5)
        assert all(put(writer, keys("m", 3), more))
        writer.evict(["c-5"])
        follower.refresh()
        hits, got = read(follower, keys("m", 3) + ["c-5", "c-4"])
        assert hits == [True, True, True, False, True]
        assert all(torch.equal(a, b) for a, b in zip(got[:3], more))
        assert torch.equal(got[4], data[4])
    finally:
        writer.close()
        follower.close()


def test_follower_put_and_evict_write_nothing(store_dir, caplog):
    with Tier(LAYOUT, config(store_dir), device="cpu") as writer:
        assert all(put(writer, keys("w", 2), pages(2, seed=6)))
    before = file_states(store_dir)
    time.sleep(0.01)  # a write now would show in mtime_ns
    with Tier(LAYOUT, config(store_dir, read_only=True), device="cpu") as follower:
        with caplog.at_level("WARNING", logger="gdskv.tier"):
            assert put(follower, keys("f", 3), pages(3, seed=7)) == [False] * 3
            assert put(follower, keys("f", 1), pages(1, seed=7)) == [False]
        assert sum("read-only tier" in r.getMessage() for r in caplog.records) == 1  # once
        pool = torch.zeros(LAYOUT.kv_count, LAYOUT.num_layers, 8, LAYOUT.kv_heads,
                           LAYOUT.head_dim, dtype=LAYOUT.torch_dtype)
        slots = torch.arange(8)
        assert follower.put(["a", "b"], (pool[0], pool[1]), slots) == [False, False]
        assert follower.put_async(["a", "b"], (pool[0], pool[1]), slots).result() == [False] * 2
        assert not follower.contains("f-0") and not follower.contains("a")
        assert follower.evict(["w-0"]) == 1  # forgotten here only
        assert not follower.contains("w-0")
        follower.clear()
        assert follower.match_prefix(["w-1"]) == 0
    assert file_states(store_dir) == before
    with Tier(LAYOUT, config(store_dir), device="cpu") as writer:  # the writer still has both
        assert writer.match_prefix(keys("w", 2)) == 2


@pytest.mark.parametrize("in_place", [False, True])
def test_reused_slot_is_a_miss_never_wrong_bytes(store_dir, in_place):
    cfg = config(store_dir, capacity=4 * LAYOUT.slot_bytes, files_per_dir=1, in_place=in_place)
    with Tier(LAYOUT, cfg, device="cpu") as writer, \
            Tier(LAYOUT, cfg.replace(read_only=True), device="cpu") as follower:
        assert all(put(writer, keys("a", 4), pages(4, seed=8)))
        follower.refresh()
        assert follower.match_prefix(keys("a", 4)) == 4
        follower.FOLLOW_INTERVAL = 1e9  # the follower keeps its old directory for now
        b = pages(4, seed=9)
        assert all(put(writer, keys("b", 4), b))  # LRU evicts every a-page, reuses its slot
        assert writer.match_prefix(keys("a", 4)) == 0
        assert follower.match_prefix(keys("a", 4)) == 4  # stale entries
        hits, got = read(follower, keys("a", 4))
        assert hits == [False] * 4
        if not in_place:  # staged: a miss never reaches the caller's buffer
            assert not any(g.any() for g in got)
        # In place (where the buffers allow it: under O_DIRECT only 4 KiB-aligned ones, which
        # the allocator hands out at random) the bytes land before they are verified, so a
        # missed page's buffer is undefined (Tier.get_pages); the miss is what is guaranteed.
        assert follower.stats()["corrupt_pages"] == 4
        follower.refresh()
        hits, got = read(follower, keys("b", 4))
        assert hits == [True] * 4 and all(torch.equal(x, y) for x, y in zip(got, b))


def test_read_only_on_missing_store(store_dir):
    with pytest.raises(StoreError, match="writer has not created the store yet"):
        Tier(LAYOUT, config(store_dir, read_only=True), device="cpu")
    assert os.listdir(store_dir) == []  # no lock file, manifest or slab file made


def test_read_only_needs_verify(store_dir):
    with pytest.raises(ConfigError, match="verify"):
        config(store_dir, read_only=True, verify=False)
    with pytest.raises(ConfigError, match="verify"):
        TierConfig.from_env({"GDSKV_READ_ONLY": "1", "GDSKV_VERIFY": "0"})
    assert TierConfig.from_env({"GDSKV_READ_ONLY": "true"}).read_only is True


def _child_writer(directory: str, ready, go_on, done) -> None:
    with Tier(LAYOUT, config(directory), device="cpu") as writer:
        assert all(put(writer, keys("x", 6), pages(6, seed=10)))
        ready.set()
        go_on.wait(60)
        assert all(put(writer, keys("y", 3), pages(3, seed=11)))
        writer.evict(["x-0"])
        writer.journal.records_written = 10 ** 6  # compacts at close
    done.set()


def test_follower_of_a_writer_in_another_process(store_dir):
    ctx = mp.get_context("spawn")
    ready, go_on, done = ctx.Event(), ctx.Event(), ctx.Event()
    child = ctx.Process(target=_child_writer, args=(str(store_dir), ready, go_on, done))
    child.start()
    try:
        assert ready.wait(120), "child writer did not start"
        with pytest.raises(StoreLockedError):  # the child owns the store...
            Tier(LAYOUT, config(store_dir), device="cpu")
        # ...and a follower opens beside it.
        with Tier(LAYOUT, config(store_dir, read_only=True), device="cpu") as follower:
            hits, got = read(follower, keys("x", 6))
            assert hits == [True] * 6
            assert all(torch.equal(a, b) for a, b in zip(got, pages(6, seed=10)))
            go_on.set()
            assert done.wait(120), "child writer did not finish"
            child.join(60)
            assert child.exitcode == 0
            follower.refresh()
            hits, got = read(follower, keys("y", 3) + keys("x", 2))
            assert hits == [True, True, True, False, True]
            want = pages(3, seed=11) + pages(6, seed=10)[:2]
            assert all(torch.equal(got[i], want[i]) for i in (0, 1, 2, 4))
    finally:
        go_on.set()
        child.join(60)
        if child.is_alive():
            child.kill()


def test_journal_follower_tails_and_notices_a_rewritten_tail(tmp_path):
    from gdskv.journal import Journal, JournalFollower, Record, RecordKind, encode

    path = str(tmp_path / "j.log")
    fol = JournalFollower(path)
    assert fol.poll() == (True, [])  # no journal yet: empty
    j = Journal(path, sync=False)
    recs = [Record(RecordKind.COMMIT, i + 1, i, 7, 1, f"k{i}") for i in range(3)]
    j.append(recs[:2])
    reset, got = fol.poll()
    assert reset and got == recs[:2]
    assert fol.poll() == (False, [])
    # Half a record (an append in progress) waits for the next poll.
    raw = encode(recs[2])
    with open(path, "ab") as fh:
        fh.write(raw[:5])
    assert fol.poll() == (False, [])
    with open(path, "ab") as fh:
        fh.write(raw[5:])
    assert fol.poll() == (False, [recs[2]])
    # The writer cuts its tail (a failed append) and writes other records over it: the bytes
    # the follower last read changed, so it starts over instead of decoding mid-record.
    other = [Record(RecordKind.EVICT, 9, 0, 0, 0, "k0"),
             Record(RecordKind.COMMIT, 10, 5, 8, 1, "a-much-longer-key-than-before")]
    os.truncate(path, len(encode(recs[0])))
    with open(path, "ab") as fh:
        fh.write(b"".join(encode(r) for r in other))
    reset, got = fol.poll()
    assert reset and got == [recs[0]] + other
    j.close()
    fol.close()


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device (none here)")
@pytest.mark.parametrize("backend", ["kvikio", pytest.param("nixl", marks=NEEDS_NIXL), "posix"])
def test_follower_on_gpu_backends(store_dir, backend):
    """A writer and a follower staging on the GPU, on each backend: the follower reads the
    writer's pages bit-exact into GPU memory, and a slot the writer reused is a miss."""
    cfg = config(store_dir, backend=backend, capacity=4 * LAYOUT.slot_bytes, files_per_dir=1)
    a, b = [p.cuda() for p in pages(4, seed=21)], [p.cuda() for p in pages(4, seed=22)]

    def read_gpu(tier, ks):
        out = [torch.zeros(PB, dtype=torch.uint8, device="cuda") for _ in ks]
        return tier.get_pages(ks, [[o] for o in out]), out

    with Tier(LAYOUT, cfg, device="cuda") as writer, \
            Tier(LAYOUT, cfg.replace(read_only=True), device="cuda") as follower:
        assert follower.backend.name == backend
        assert all(put(writer, keys("a", 4), a))
        follower.refresh()
        hits, got = read_gpu(follower, keys("a", 4))
        assert hits == [True] * 4 and all(torch.equal(x, y) for x, y in zip(got, a))
        follower.FOLLOW_INTERVAL = 1e9  # keep the stale directory: the writer reuses slots
        assert all(put(writer, keys("b", 4), b))
        hits, got = read_gpu(follower, keys("a", 4))
        assert hits == [False] * 4 and not any(g.any() for g in got)
        follower.refresh()
        hits, got = read_gpu(follower, keys("b", 4))
        assert hits == [True] * 4 and all(torch.equal(x, y) for x, y in zip(got, b))
