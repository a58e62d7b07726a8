"""Round trips through the tier on every backend this machine runs, plus the tier's contract:
re-put no-op, misses, prefix match, eviction at capacity, bad input leaves the store unchanged."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time

import pytest
import torch

from gdskv.backends.base import WaitingFuture
from gdskv.config import ConfigError
from gdskv.layout import KVLayout
from gdskv.store import StoreError, StoreMismatchError
from gdskv.tier import Tier

from conftest import assert_same_rows, empty_like_pool, random_pool
from reliability_helpers import wait_for

LAYOUTS = {
    "mha-bf16-p16": KVLayout(num_layers=3, page_size=16, head_dim=32, kv_heads=2, dtype="bf16"),
    "mha-fp16-p1": KVLayout(num_layers=2, page_size=1, head_dim=64, kv_heads=4, dtype="fp16"),
    "mha-fp32-p64": KVLayout(num_layers=2, page_size=64, head_dim=16, kv_heads=1, dtype="fp32"),
    "mha-fp8e4m3-p16": KVLayout(num_layers=2, page_size=16, head_dim=48, kv_heads=2,
                                dtype="float8_e4m3fn"),
    "mha-fp8e5m2-p1": KVLayout(num_layers=3, page_size=1, head_dim=40, kv_heads=3,
                               dtype="float8_e5m2"),
    "mla-bf16-p64": KVLayout(num_layers=3, page_size=64, head_dim=72, mla=True, dtype="bf16"),
    "mla-fp8-p1": KVLayout(num_layers=2, page_size=1, head_dim=576, mla=True, dtype="fp8"),
    "mla-fp32-p16": KVLayout(num_layers=2, page_size=16, head_dim=36, mla=True, dtype="fp32"),
}


def scattered(num_pages: int, layout: KVLayout, num_slots: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(num_slots, generator=g)[:num_pages * layout.page_size]


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "per-layer"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_round_trip_bit_exact(name, stacked, make_config, device):
    layout = LAYOUTS[name]
    pages = 13
    slots = pages * layout.page_size + 37
    src_pool = random_pool(layout, slots, stacked=stacked, device=device, seed=1)
    dst_pool = empty_like_pool(src_pool)
    src = scattered(pages, layout, slots, seed=2)
    dst = scattered(pages, layout, slots, seed=3).to(torch.int32)
    keys = [f"page-{i}" for i in range(pages)]
    # staging holds ~2 pages per half: the batch goes through in many chunks
    config = make_config(staging_size=max(4 * layout.slot_bytes, 8192))
    with Tier(layout, config, device=device) as tier:
        assert tier.put(keys, src_pool, src) == [True] * pages
        assert tier.match_prefix(keys) == pages
        assert tier.get(keys, dst_pool, dst) == [True] * pages
        assert_same_rows(src_pool, src, dst_pool, dst)
        s = tier.stats()
        assert s["hits"] == pages and s["pages_stored"] == pages and s["corrupt_pages"] == 0


@pytest.mark.parametrize("refused", [1, 2], ids=["first-io", "second-io"])
def test_an_exception_inside_a_call_reaches_the_caller_and_leaks_nothing(make_config, device,
                                                                         monkeypatch, refused):
    """A failure raised while a call runs (the backend refusing to start its first I/O, or its
    second while the first is in flight) reaches the caller as itself, not as an error of the
    cleanup; the call's reserved slots and staging parts are given back, so the same calls
    then succeed."""
    layout = LAYOUTS["mha-bf16-p16"]
    pages = 4
    src_pool = random_pool(layout, pages * layout.page_size, device=device, seed=5)
    dst_pool = empty_like_pool(src_pool)
    slots = torch.arange(pages * layout.page_size)
    keys = [f"e{i}" for i in range(pages)]

    class Refused(RuntimeError):
        pass

    def refusing(start):
        calls = []

        def io(*args, **kwargs):
            calls.append(1)
            if len(calls) == refused:
                raise Refused("backend refused the I/O")
            return start(*args, **kwargs)
        return io

    # one page per staging part: a 4-page call is 4 chunks, 4 I/Os
    with Tier(layout, make_config(staging_size=4 * layout.slot_bytes), device=device) as tier:
        with monkeypatch.context() as m:
            m.setattr(tier.backend, "write", refusing(tier.backend.write))
            with pytest.raises(Refused):
                tier.put(keys, src_pool, slots)
        assert tier.stats()["pages_stored"] == 0  # nothing of the failed call was kept
        assert tier.put(keys, src_pool, slots) == [True] * pages
        with monkeypatch.context() as m:
            m.setattr(tier.backend, "read", refusing(tier.backend.read))
            with pytest.raises(Refused):
                tier.get(keys, dst_pool, slots)
        assert tier._staging._free.qsize() == len(tier._staging)
        assert tier.get(keys, dst_pool, slots) == [True] * pages
        assert_same_rows(src_pool, slots, dst_pool, slots)


def test_async_and_partial_hits(make_config, device):
    layout = LAYOUTS["mha-bf16-p16"]
    pool = random_pool(layout, 256, device=device)
    out = empty_like_pool(pool)
    slots = scattered(8, layout, 256, seed=5)
    keys = [f"k{i}" for i in range(8)]
    with Tier(layout, make_config(), device=device) as tier:
        assert tier.put_async(keys[:5], pool, slots[:5 * 16]).result() == [True] * 5
        got = tier.get_async(keys, out, slots).result()
        assert got == [True] * 5 + [False] * 3
        assert_same_rows(pool, slots[:80], out, slots[:80])
        # misses leave the engine's slots untouched
        assert not out[0][:, slots[80:].long()].view(torch.uint8).any()
        assert tier.match_prefix(keys) == 5 and tier.match_prefix(["x"] + keys) == 0
        assert tier.contains("k0") and not tier.contains("k7")
        s = tier.stats()
        assert (s["hits"], s["misses"]) == (5, 3)


def test_reput_is_noop(make_config, device):
    layout = LAYOUTS["mla-bf16-p64"]
    pool = random_pool(layout, 512, device=device)
    slots = scattered(4, layout, 512, seed=1)
    with Tier(layout, make_config(), device=device) as tier:
        tier.put(["a", "b", "c", "d"], pool, slots)
        written = tier.stats()["bytes_written"]
        other = random_pool(layout, 512, device=device, seed=9)
        assert tier.put(["a", "b", "c", "d"], other, slots) == [True] * 4
        assert tier.stats()["bytes_written"] == written  # nothing written again
        out = empty_like_pool(pool)
        tier.get(["a", "b", "c", "d"], out, slots)
        assert_same_rows(pool, slots, out, slots)  # the first version stays


def test_calls_with_nothing_to_move_start_no_io(make_config, device):
    """A restore of keys none of which is stored, and a spill of keys all stored already,
    start no read or write (not even an empty one) and take no staging part."""
    layout = LAYOUTS["mla-bf16-p64"]
    pool = random_pool(layout, 512, device=device)
    slots = scattered(4, layout, 512, seed=1)
    with Tier(layout, make_config(), device=device) as tier:
        assert tier.put(["a", "b", "c", "d"], pool, slots) == [True] * 4
        started, start = [], tier.backend.start
        tier.backend.start = lambda op, *args: started.append(op) or start(op, *args)
        taken, take = [], tier._staging.try_take
        tier._staging.try_take = lambda: taken.append(1) or take()
        assert tier.get(["w", "x", "y", "z"], empty_like_pool(pool), slots) == [False] * 4
        assert tier.put(["a", "b", "c", "d"], pool, slots) == [True] * 4
        assert started == [] and taken == []


def test_lru_eviction_at_capacity(make_config, device):
    layout = LAYOUTS["mha-fp16-p1"]  # slot = 4 KiB
    pool = random_pool(layout, 64, device=device)
    config = make_config(capacity=8 * layout.slot_bytes, io_chunk_size=4096, files_per_dir=1)
    with Tier(layout, config, device=device) as tier:
        assert tier.store.num_slots == 8
        keys = [f"k{i}" for i in range(12)]
        for i in range(8):
            tier.put([keys[i]], pool, torch.tensor([i]))
        tier.get([keys[0]], empty_like_pool(pool), torch.tensor([0]))  # k0 becomes most recent
        assert tier.put(keys[8:10], pool, torch.tensor([8, 9])) == [True, True]
        assert tier.contains("k0") and not tier.contains("k1") and not tier.contains("k2")
        assert tier.stats()["evictions"] == 2 and tier.stats()["pages_stored"] == 8
        assert tier.evict(["k0", "nope"]) == 1 and not tier.contains("k0")


def test_no_eviction_policy_fails_pages(make_config, device):
    layout = LAYOUTS["mha-fp16-p1"]
    pool = random_pool(layout, 64, device=device)
    config = make_config(capacity=4 * layout.slot_bytes, io_chunk_size=4096, files_per_dir=1,
                         eviction="none")
    with Tier(layout, config, device=device) as tier:
        res = tier.put([f"k{i}" for i in range(6)], pool, torch.arange(6))
        assert res == [True] * 4 + [False] * 2
        assert tier.match_prefix([f"k{i}" for i in range(6)]) == 4


def test_put_pages_get_pages(make_config, device):
    layout = LAYOUTS["mha-bf16-p16"]
    n = 5
    g = torch.Generator().manual_seed(3)
    pages = torch.randint(0, 256, (n, layout.page_bytes), dtype=torch.uint8, generator=g)
    half = layout.page_bytes // 2  # K region then V region, as SGLang's page_first_direct
    with Tier(layout, make_config(), device="cpu") as tier:
        regions = [[pages[i, :half], pages[i, half:]] for i in range(n)]
        assert tier.put_pages([f"p{i}" for i in range(n)], regions) == [True] * n
        out = torch.zeros_like(pages)
        got = tier.get_pages([f"p{i}" for i in range(n)] + ["zz"],
                             [[out[i]] for i in range(n)] + [[torch.zeros(layout.page_bytes,
                                                                          dtype=torch.uint8)]])
        assert got == [True] * n + [False]
        assert torch.equal(out, pages)


def test_put_pages_match_pool_format(make_config):
    """Pages stored from a pool read back as page-format bytes equal to the reference gather."""
    from gdskv.kernels import gather_pages_reference
    from gdskv.pool import KVPool
    layout = LAYOUTS["mla-fp32-p16"]
    pool = random_pool(layout, 100)
    slots = scattered(3, layout, 100, seed=4)
    expect = torch.zeros(3 * layout.slot_bytes, dtype=torch.uint8)
    gather_pages_reference(KVPool(layout, pool).rows, layout, slots, expect)
    with Tier(layout, make_config(), device="cpu") as tier:
        tier.put(["a", "b", "c"], pool, slots)
        out = torch.zeros(3, layout.page_bytes, dtype=torch.uint8)
        assert tier.get_pages(["a", "b", "c"], [[out[i]] for i in range(3)]) == [True] * 3
    assert torch.equal(out, expect.view(3, layout.slot_bytes)[:, :layout.page_bytes])


BAD_CALLS = {
    "wrong dtype": (TypeError, lambda pool, t: t.put(["a"], tuple(p.float() for p in pool),
                                                     torch.arange(16))),
    "wrong shape": (ValueError, lambda pool, t: t.put(["a"], tuple(p[:, :, :1] for p in pool),
                                                      torch.arange(16))),
    "slot count != pages*page_size": (ValueError, lambda pool, t: t.put(["a", "b"], pool,
                                                                        torch.arange(16))),
    "slot out of range": (ValueError, lambda pool, t: t.put(["a"], pool, torch.arange(16) + 999)),
    "float slots": (TypeError, lambda pool, t: t.put(["a"], pool, torch.arange(16.0))),
    "duplicate keys": (ValueError, lambda pool, t: t.put(["a", "a"], pool, torch.arange(32))),
    "non-str key": (TypeError, lambda pool, t: t.put([1], pool, torch.arange(16))),
    "single str as keys": (TypeError, lambda pool, t: t.put("a", pool, torch.arange(16))),
    "MHA pool without V": (TypeError, lambda pool, t: t.put(["a"], pool[0], torch.arange(16))),
    "wrong layer count": (ValueError, lambda pool, t: t.put(["a"], (pool[0][:2], pool[1][:2]),
                                                            torch.arange(16))),
    "region size": (ValueError, lambda pool, t: t.put_pages(["a"], [[torch.zeros(5,
                                                                     dtype=torch.uint8)]])),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_input_raises_and_leaves_store_unchanged(case, make_config):
    exc_type, call = BAD_CALLS[case]
    layout = LAYOUTS["mha-bf16-p16"]
    pool = random_pool(layout, 100)
    with Tier(layout, make_config(), device="cpu") as tier:
        tier.put(["keep"], pool, torch.arange(16))
        before = (tier.stats()["pages_stored"], tier.directory.free_slots)
        with pytest.raises(exc_type):
            call(pool, tier)
        assert (tier.stats()["pages_stored"], tier.directory.free_slots) == before
        assert not tier.contains("a") and tier.contains("keep")


def test_layout_mismatch_refused(make_config):
    layout = LAYOUTS["mha-bf16-p16"]
    config = make_config()
    Tier(layout, config, device="cpu").close()
    with pytest.raises(StoreMismatchError, match="written for layout"):
        Tier(layout.replace(page_size=32), config, device="cpu")
    with pytest.raises(StoreMismatchError, match="written for layout"):
        Tier(layout.replace(tp_rank=1, tp_size=2), config, device="cpu")
    with pytest.raises(StoreMismatchError, match="geometry"):
        Tier(layout, config.replace(capacity="128MiB"), device="cpu")
    Tier(layout, config, device="cpu").close()  # the original still opens


def test_directory_errors(tmp_path):
    layout = LAYOUTS["mha-bf16-p16"]
    with pytest.raises(StoreError, match="does not exist"):
        Tier(layout, _cfg(tmp_path / "missing"), device="cpu")
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as root: a 0500 directory is still writable")
        with pytest.raises(StoreError, match="not writable"):
            Tier(layout, _cfg(ro), device="cpu")
    finally:
        os.chmod(ro, 0o700)
    with pytest.raises(StoreError, match="no store directory"):
        Tier(layout, _cfg(None), device="cpu")
    with pytest.raises(ConfigError, match="staging_size"):
        Tier(layout, _cfg(tmp_path).replace(staging_size=layout.slot_bytes), device="cpu")


def test_unknown_backend_rejected():
    with pytest.raises(ConfigError, match="backend"):
        from gdskv.config import TierConfig
        TierConfig(backend="floppy")


def test_reopen_recovers_pages(make_config, device):
    layout = LAYOUTS["mha-bf16-p16"]
    pool = random_pool(layout, 200, device=device)
    slots = scattered(6, layout, 200, seed=8)
    keys = [f"r{i}" for i in range(6)]
    config = make_config()
    with Tier(layout, config, device=device) as tier:
        tier.put(keys, pool, slots)
        tier.evict(["r2"])
    with Tier(layout, config, device=device) as tier:
        assert tier.stats()["recovered_pages"] == 5
        out = empty_like_pool(pool)
        assert tier.get(keys, out, slots) == [True, True, False, True, True, True]
        keep = torch.cat([slots[:32], slots[48:]])
        assert_same_rows(pool, keep, out, keep)


def test_stats_report_io_and_backend(make_config, device):
    layout = LAYOUTS["mha-bf16-p16"]
    pool = random_pool(layout, 64, device=device)
    with Tier(layout, make_config(), device=device) as tier:
        tier.put(["a", "b"], pool, torch.arange(32))
        tier.get(["a", "b"], empty_like_pool(pool), torch.arange(32))
        s = tier.stats()
    assert s["bytes_written"] == s["bytes_read"] == 2 * layout.page_bytes
    assert s["write_gbps"] > 0 and s["read_gbps"] > 0
    assert s["backend"] in ("posix", "nixl", "kvikio") and isinstance(s["gpu_direct"], bool)
    assert isinstance(s["o_direct"], bool) and s["o_direct_reason"]


def _cfg(d):
    from gdskv.config import TierConfig
    return TierConfig(directories=() if d is None else (str(d),), capacity="16MiB",
                      staging_size="1MiB", io_chunk_size="64KiB", backend="posix")


def test_staging_parts_hold_whole_pages_of_payload(make_config, device):
    # staging_size counts payload: 4 parts of 8 pages each, whatever the trailers add
    # (128 KiB pages: 8 slots overshoot a part's 1 MiB by 32 KiB, inside the 1/16 slack).
    layout = KVLayout(num_layers=4, page_size=16, head_dim=128, kv_heads=4, dtype="bf16")
    config = make_config(staging_size=4 * 8 * layout.page_bytes, pipeline_depth=4,
                         capacity=f"{64 * layout.slot_bytes}")
    with Tier(layout, config, device=device) as tier:
        assert len(tier._staging) == 4
        assert all(part.numel() == 8 * layout.slot_bytes for part in tier._staging.parts)
        pool = random_pool(layout, 32 * layout.page_size, device=device, seed=3)
        slots = torch.arange(32 * layout.page_size, device=device)
        keys = [f"p{i}" for i in range(32)]
        assert all(tier.put(keys, pool, slots))
        out = empty_like_pool(pool)
        assert all(tier.get(keys, out, slots))
        assert_same_rows(pool, slots, out, slots)


class LateCallbacks(concurrent.futures.Future):
    """A future whose done-callbacks run 0.2 s after it is done and its waiters are woken."""

    def _invoke_callbacks(self) -> None:
        time.sleep(0.2)
        super()._invoke_callbacks()


class GatedWrites:
    """A tier's backend whose writes end only when the test opens their gates (the bytes are
    written at once; the future completes later), and a log of the writes and journal commits
    in the order the call made them. ``kind``: the future the tier gets, ``"thread"`` a
    ``concurrent.futures.Future`` a thread of its own completes (posix, NIXL), ``"late"`` the
    same whose done-callbacks run 0.2 s after it has woken its waiters (a busy host can delay
    them so), or ``"asker"`` one the caller completes when it asks (kvikio's
    ``WaitingFuture``). ``opened``: every gate open from the start."""

    def __init__(self, tier: Tier, kind: str, opened: bool = False) -> None:
        self.log: list[str] = []
        self.gates: list[threading.Event] = []
        self.kind, self.opened = kind, opened
        self._write, self._commit = tier.backend.write, tier._persist.journal_commits
        tier.backend.write, tier._persist.journal_commits = self.write, self.commit

    def write(self, buffer, extents):
        inner = self._write(buffer, extents)
        gate = threading.Event()
        if self.opened:
            gate.set()
        self.gates.append(gate)
        self.log.append(f"write{len(self.gates)}")
        if self.kind == "asker":
            return WaitingFuture(lambda: (gate.wait(), inner.result())[1])
        outer = LateCallbacks() if self.kind == "late" else concurrent.futures.Future()

        def end() -> None:
            gate.wait()
            exc = inner.exception()
            outer.set_exception(exc) if exc is not None else outer.set_result(inner.result())
        threading.Thread(target=end, daemon=True).start()
        return outer

    def commit(self, pages) -> None:
        self.log.append("commit")
        self._commit(pages)


def _one_page_chunks(make_config, device, depth: int, pages: int):
    layout = LAYOUTS["mha-bf16-p16"]
    config = make_config(staging_size=depth * layout.slot_bytes, pipeline_depth=depth)
    pool = random_pool(layout, pages * layout.page_size, device=device, seed=5)
    slots = torch.arange(pages * layout.page_size, device=device)
    return layout, config, pool, slots, [f"c{i}" for i in range(pages)]


def _read_back(tier, keys, pool, slots) -> None:
    back = empty_like_pool(pool)
    assert tier.get(keys, back, slots) == [True] * len(keys)
    assert_same_rows(pool, slots, back, slots)


@pytest.mark.parametrize("kind", ["thread", "late", "asker"])
def test_a_spill_failing_after_a_write_was_submitted_gives_every_part_back(make_config, device,
                                                                           kind):
    # The second chunk's COMMIT records fail to encode after its write was submitted: the call
    # raises, and the parts of both writes are back, whoever completes their futures.
    layout, config, pool, slots, keys = _one_page_chunks(make_config, device, 4, 3)
    with Tier(layout, config, device=device) as tier:
        GatedWrites(tier, kind, opened=True)
        encode, calls = tier._persist.encode_commits, []

        def failing(*columns):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("encoding failed")
            return encode(*columns)
        tier._persist.encode_commits = failing
        with pytest.raises(RuntimeError, match="encoding failed"):
            tier.put(keys, pool, slots)
        assert tier._staging._free.qsize() == len(tier._staging)
        assert tier.stats()["pages_stored"] == 0
        tier._persist.encode_commits = encode
        assert tier.put(keys, pool, slots) == [True] * 3
        _read_back(tier, keys, pool, slots)


@pytest.mark.parametrize("kind", ["thread", "late", "asker"])
def test_a_spill_submits_its_next_write_before_committing_the_one_that_ended(make_config,
                                                                            device, kind):
    # Two one-page staging parts, four pages: the third chunk needs the part of the first.
    # The call waits for that write, submits the third, and only then commits the first
    # (fdatasync, journal), so the commit runs while the third write does.
    layout, config, pool, slots, keys = _one_page_chunks(make_config, device, 2, 4)
    with Tier(layout, config, device=device) as tier:
        assert tier._chunk_pages == 1 and len(tier._staging) == 2
        gated = GatedWrites(tier, kind)
        out: list = []
        call = threading.Thread(target=lambda: out.append(tier.put(keys, pool, slots)))
        call.start()
        try:
            wait_for(lambda: len(gated.gates) == 2, 30, "two writes")
            time.sleep(0.1)  # both parts are busy: nothing else starts
            assert gated.log == ["write1", "write2"]
            gated.gates[0].set()
            wait_for(lambda: "commit" in gated.log, 30, "the first commit")
            assert gated.log[:4] == ["write1", "write2", "write3", "commit"]
        finally:
            while call.is_alive():  # open every gate, the fourth write's too
                for gate in list(gated.gates):
                    gate.set()
                call.join(0.05)
        assert out == [[True] * 4]
        assert gated.log.count("commit") == 4
        _read_back(tier, keys, pool, slots)


@pytest.mark.parametrize("kind", ["thread", "asker"])
def test_a_spill_with_parts_free_submits_every_write_before_any_commit(make_config, device,
                                                                       kind):
    # Four parts, three one-page chunks, writes that end at once: no part is waited for, so
    # no commit (an fdatasync on a disk) comes between two submits.
    layout, config, pool, slots, keys = _one_page_chunks(make_config, device, 4, 3)
    with Tier(layout, config, device=device) as tier:
        gated = GatedWrites(tier, kind, opened=True)
        assert tier.put(keys, pool, slots) == [True] * 3
        assert gated.log == ["write1", "write2", "write3", "commit", "commit", "commit"]
        _read_back(tier, keys, pool, slots)


BAD_GETS = {
    "wrong dtype": (TypeError, lambda pool: (tuple(p.float() for p in pool), torch.arange(16))),
    "wrong shape": (ValueError, lambda pool: (tuple(p[:, :, :1] for p in pool), torch.arange(16))),
    "slot count != pages*page_size": (ValueError, lambda pool: (pool, torch.arange(32))),
    "slot out of range": (ValueError, lambda pool: (pool, torch.arange(16) + 999)),
    "float slots": (TypeError, lambda pool: (pool, torch.arange(16.0))),
    "MHA pool without V": (TypeError, lambda pool: (pool[0], torch.arange(16))),
}


@pytest.mark.parametrize("stored", [True, False], ids=["hit", "miss"])
@pytest.mark.parametrize("case", list(BAD_GETS))
def test_bad_get_raises_whether_or_not_the_page_is_stored(case, stored, make_config):
    # A restore checks its pool and slots while its first read runs: a bad argument still
    # raises, for a hit (after that read) as for a miss (nothing read), and nothing reaches
    # the pool; the page stays stored and restorable.
    exc_type, args = BAD_GETS[case]
    layout = LAYOUTS["mha-bf16-p16"]
    pool = random_pool(layout, 100)
    with Tier(layout, make_config(), device="cpu") as tier:
        tier.put(["keep"], pool, torch.arange(16))
        target = empty_like_pool(pool)
        bad_pool, bad_slots = args(target)
        with pytest.raises(exc_type):
            tier.get(["keep" if stored else "absent"], bad_pool, bad_slots)
        assert all(torch.count_nonzero(p) == 0 for p in target)
        assert tier.stats()["pages_stored"] == 1
        assert tier.get(["keep"], target, torch.arange(16)) == [True]
        assert_same_rows(pool, torch.arange(16), target, torch.arange(16))


def test_a_long_restore_prepares_once_every_free_part_reads(make_config, monkeypatch):
    # A restore of more chunks than staging parts starts a read in every free part before its
    # host work (stream, argument checks, slot indices: milliseconds for a long prompt), then
    # finishes and reads the rest: every page back, bit-exact. A bad argument of such a
    # restore still raises with nothing in the pool.
    from gdskv import restore_call
    layout = LAYOUTS["mha-bf16-p16"]
    pages, depth = 12, 4
    pool = random_pool(layout, pages * 16)
    cfg = make_config(staging_size=2 * depth * layout.page_bytes, pipeline_depth=depth)
    seen = []
    prepare = restore_call.RestoreCall._prepare

    def noting(self, todo, chunks):
        seen.append((len(self.pending), len(chunks)))
        return prepare(self, todo, chunks)
    monkeypatch.setattr(restore_call.RestoreCall, "_prepare", noting)
    keys = [f"p{i}" for i in range(pages)]
    slots = torch.arange(pages * 16)
    with Tier(layout, cfg, device="cpu") as tier:
        assert tier.put(keys, pool, slots) == [True] * pages
        target = empty_like_pool(pool)
        with pytest.raises(ValueError, match="slot index out of range"):
            tier.get(keys, target, slots + 999)
        assert all(torch.count_nonzero(p) == 0 for p in target)
        assert not tier.directory._pins.any()  # every pin it took was given back
        assert tier.get(keys, target, slots) == [True] * pages
        assert_same_rows(pool, slots, target, slots)
    # both restores (the bad one too) had a read in each of the 4 parts, of more chunks
    assert [p for p, _ in seen] == [depth, depth] and all(c > depth for _, c in seen)


def test_a_long_restore_pins_the_rest_once_its_first_reads_are_under_way(make_config, device,
                                                                          monkeypatch):
    # The pages the free staging parts read first are pinned, their reads started, then the
    # rest pinned. Misses among the first pages leave a short chunk there: every later chunk
    # still lands at its own pages, bit-exact, and the misses are misses.
    layout = LAYOUTS["mha-bf16-p16"]
    pages, depth = 14, 2
    pool = random_pool(layout, pages * 16, device=device)
    cfg = make_config(staging_size=3 * depth * layout.slot_bytes, pipeline_depth=depth)
    keys = [f"p{i}" for i in range(pages)]
    absent = {1, 8}  # one in the first parts' pages (2 parts x 3 pages), one after
    asked = [k if i not in absent else f"absent{i}" for i, k in enumerate(keys)]
    slots = torch.arange(pages * 16, device=device)
    pins = []
    with Tier(layout, cfg, device=device) as tier:
        assert tier.put(keys, pool, slots) == [True] * pages
        directory = tier.directory
        pin_for_read = directory.pin_for_read

        def noting(part, first=0):
            pins.append((len(part), first))
            return pin_for_read(part, first)
        monkeypatch.setattr(directory, "pin_for_read", noting)
        started = []
        start = tier.backend.start

        def starting(*a, **k):
            started.append(len(pins))
            return start(*a, **k)
        monkeypatch.setattr(tier.backend, "start", starting)
        target = empty_like_pool(pool)
        got = tier.get(asked, target, slots)
        head = len(tier._calls.staging) * tier._calls.chunk_pages
        assert not tier.directory._pins.any()
    assert head == depth * 3
    assert got == [i not in absent for i in range(pages)]
    hit = torch.tensor([i not in absent for i in range(pages)], device=device).repeat_interleave(16)
    assert_same_rows(pool, slots[hit], target, slots[hit])
    assert pins == [(head, 0), (pages - head, head)]
    # both parts' reads were under way before the rest was pinned
    assert started[:depth] == [1] * depth and started[depth:] and set(started[depth:]) == {2}


def test_a_page_replaced_before_the_rest_is_pinned_is_a_miss(make_config, device, monkeypatch):
    # Between the first parts' pins and the rest's, another caller evicts a page of the rest
    # and a new page takes its slot (as another caller's put reserves and commits it; done on
    # the directory here, as a put from inside the restore would wait for its staging parts):
    # the restore answers miss for the old key and writes nothing of that slot into the pool;
    # the other pages are bit-exact.
    layout = LAYOUTS["mha-bf16-p16"]
    pages, depth = 12, 2
    pool = random_pool(layout, pages * 16, device=device)
    # a full store that never evicts: the new page can only take the slot the victim frees
    cfg = make_config(staging_size=2 * depth * layout.slot_bytes, pipeline_depth=depth,
                      capacity=pages * layout.slot_bytes + 2 * (64 << 10), eviction="none")
    keys = [f"p{i}" for i in range(pages)]
    slots = torch.arange(pages * 16, device=device)
    with Tier(layout, cfg, device=device) as tier:
        assert tier.put(keys, pool, slots) == [True] * pages
        for i in range(tier.store.num_slots - pages):  # (slots the store's rounding adds)
            assert tier.put([f"filler{i}"], pool, slots[:16]) == [True]
        assert tier.put(["one too many"], pool, slots[:16]) == [False]
        victim = pages - 1  # in the rest (the head is 2 parts x 2 pages)
        directory = tier.directory
        pin_for_read = directory.pin_for_read
        replaced = []

        def replacing(part, first=0):
            if first and not replaced:  # the rest: replace the victim first
                slot = directory._index[keys[victim]]
                assert tier.evict([keys[victim]]) == 1
                taken = directory.reserve(["newcomer"]).slots
                assert taken == [slot]  # (the store is full: only the freed slot is left)
                directory.commit(taken, [12345])
                replaced.append(slot)
            return pin_for_read(part, first)
        monkeypatch.setattr(directory, "pin_for_read", replacing)
        target = empty_like_pool(pool)
        got = tier.get(keys, target, slots)
    assert replaced, "the restore pinned all its pages at once"
    assert got == [i != victim for i in range(pages)]
    kept = slots[:victim * 16]
    assert_same_rows(pool, kept, target, kept)
    # the victim's rows were not written with the newcomer's (or any) bytes
    assert all(torch.count_nonzero(p[..., victim * 16:, :, :] if p.dim() == 4 else
                                   p[victim * 16:]) == 0 for p in target)


def test_calls_leave_no_reference_cycles(make_config, device):
    # Garbage only the cycle collector can free fills its youngest generation: with ~40 such
    # objects per call it ran every ~16 small calls, a pause in their tail latency.
    import gc
    layout = LAYOUTS["mha-bf16-p16"]
    pool = random_pool(layout, 64, device=device)
    with Tier(layout, make_config(), device=device) as tier:
        slots = torch.arange(16, device=device)
        for k in ("w", "x"):  # first calls warm caches (kernels, pool view, buffers)
            tier.put([k], pool, slots)
            tier.get([k], pool, slots)
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            tier.put(["a"], pool, slots)
            assert tier.get(["a", "absent"], pool, torch.arange(32, device=device)) == [True, False]
            tier.get_async(["a"], pool, slots).result()
            tier.put_pages(["b"], [[torch.zeros(layout.page_bytes, dtype=torch.uint8)]])
            tier.get_pages(["b"], [[torch.zeros(layout.page_bytes, dtype=torch.uint8)]])
            gc.collect()
            cyclic = [type(o).__name__ for o in gc.garbage]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        assert cyclic == []
