"""Small in-place restores and spills of host regions in one page-engine call each
(gdskv/quick_calls.py): which calls take the quick paths, that they answer, count and journal
as the general path does, and that every failure is handed to the general path, which settles
it as before. On the page engine's native and Python paths (``--data-path python``)."""

from __future__ import annotations

import dataclasses
import errno
import os
import threading

import pytest
import torch

from conftest import fail_first_reads, fail_io
from gdskv import checksum, quick_calls
from gdskv.config import TierConfig
from gdskv.layout import BytePageLayout
from gdskv.memory import alloc_host
from gdskv.tier import Tier
from reliability_helpers import run_in_threads

#: whole 4 KiB blocks: a page moves in place under O_DIRECT too
LAYOUT = BytePageLayout(page_bytes=8192, kind="test/quick-restore")
PAGE = LAYOUT.page_bytes
SLOT = LAYOUT.slot_bytes


def config(tmp_path, **overrides) -> TierConfig:
    base = dict(directories=(str(tmp_path),), capacity=64 * SLOT, files_per_dir=1,
                io_threads=2, staging_size=32 * SLOT)  # 8-page chunks
    base.update(overrides)
    return TierConfig(**base)


def content(key: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(key.encode()) * 7919 + len(key))
    return torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=gen)


def region() -> torch.Tensor:
    return alloc_host(PAGE, pin=False).zero_()


def put(tier, keys) -> list[bool]:
    pages = []
    for k in keys:
        r = region()
        r.copy_(content(k))
        pages.append([r])
    return tier.put_pages(list(keys), pages)


def get(tier, keys) -> tuple[list[bool], list[torch.Tensor]]:
    out = [region() for _ in keys]
    return tier.get_pages(list(keys), [[o] for o in out]), out


def quick_counts(tier, what: str = "quick_restores") -> tuple[int, int]:
    s = tier.stats()
    return s.get(what, 0), s.get("quick_calls_handed_on", 0)


def test_small_restores_take_the_quick_path_bit_exact(tmp_path):
    keys = [f"q{i}" for i in range(8)]
    with Tier(LAYOUT, config(tmp_path), device="cpu") as tier:
        assert tier.stats()["quick_restore"]["enabled"] and tier._quick["get"].max_pages == 8
        assert all(put(tier, keys))
        for n in (1, 3, 8):
            hits, out = get(tier, keys[:n])
            assert hits == [True] * n
            assert all(torch.equal(o, content(k)) for k, o in zip(keys, out))
        # misses among hits: the pages found are read, the others are misses
        hits, out = get(tier, ["nope", keys[5], "gone", keys[2]])
        assert hits == [False, True, False, True]
        assert torch.equal(out[1], content(keys[5])) and torch.equal(out[3], content(keys[2]))
        assert get(tier, ["absent"])[0] == [False]
        assert quick_counts(tier) == (5, 0)


def test_async_restores_take_the_quick_path(tmp_path):
    keys = ["y0", "y1", "y2"]
    with Tier(LAYOUT, config(tmp_path), device="cpu") as tier:
        assert all(put(tier, keys))
        out = [region() for _ in keys]
        fut = tier.get_pages_async(["y2", "none", "y0"], [[o] for o in out])
        assert fut.result() == [True, False, True]
        assert torch.equal(out[0], content("y2")) and torch.equal(out[2], content("y0"))
        assert quick_counts(tier) == (1, 0)
        with pytest.raises(ValueError, match="duplicate key"):  # checked in the caller, now
            tier.get_pages_async(["y0", "y0"], [[out[0]], [out[1]]])


def test_counters_are_the_general_paths(tmp_path):
    """The same calls on two stores, one tier with the quick path and one without: the same
    results and the same counters (but the quick path's own). The spills fill a small store,
    then evict, and put keys already stored."""
    keys = [f"c{i}" for i in range(6)]
    calls = [keys[:1], keys[1:4], ["missing", keys[4]], keys]
    stats = []
    for quick in (True, False):
        (tmp_path / str(quick)).mkdir()
        cfg = config(tmp_path / str(quick), capacity=16 * SLOT)
        with Tier(LAYOUT, cfg, device="cpu") as tier:
            if not quick:
                tier._quick = {}  # the general path for every call (white box)
            room = tier.store.num_slots
            fill = [f"e{i}" for i in range(room + 3)]  # 3 evictions
            for i in range(0, room, 4):
                assert all(put(tier, fill[i:i + 4]))
            assert put(tier, fill[room:] + fill[room - 2:room]) == [True] * 5
            assert all(put(tier, keys))
            for c in calls:
                hits, out = get(tier, c)
                assert hits == [k in keys for k in c]
                assert all(torch.equal(o, content(k)) for k, o, h in zip(c, out, hits) if h)
            s = tier.stats()
            stats.append({k: v for k, v in s.items() if k in (
                "get_pages", "hits", "misses", "bytes_read", "pages_read_in_place",
                "read_failed", "corrupt_pages", "unreadable_pages", "read_calls", "put_pages",
                "put_stored", "bytes_written", "pages_written_in_place", "evictions",
                "not_admitted", "write_failed")})
            assert s.get("quick_restores", 0) == (len(calls) if quick else 0)
            assert s.get("quick_spills", 0) == ((room + 3) // 4 + 2 if quick else 0)
    assert stats[0] == stats[1] and stats[0]["hits"] == 11 and stats[0]["misses"] == 1
    room = stats[0]["put_pages"] - 11
    assert stats[0]["put_stored"] == room + 11 and stats[0]["evictions"] == 9
    assert stats[0]["pages_written_in_place"] == room + 9


def test_calls_that_do_not_qualify_go_the_general_way(tmp_path, monkeypatch):
    keys = ["a", "b"]
    with Tier(LAYOUT, config(tmp_path), device="cpu") as tier:
        assert all(put(tier, keys))
        # a page in two regions
        halves = [region()[:PAGE // 2], region()[:PAGE // 2]]
        assert tier.get_pages(["a"], [halves]) == [True]
        assert torch.equal(torch.cat(halves), content("a"))
        # more pages than the quick path takes (the Python steps: one on-caller read; the
        # native reader: NATIVE_MOST_PAGES, made small here)
        monkeypatch.setattr(quick_calls, "NATIVE_MOST_PAGES", 5)
        many = [f"m{i}" for i in range(tier._quick["get"].most_pages() + 1)]
        assert all(put(tier, many))
        hits, out = get(tier, many)
        assert all(hits) and torch.equal(out[-1], content(many[-1]))
        assert quick_counts(tier) == (0, 0)
        # bad arguments get the general path's errors
        shared = region()
        with pytest.raises(ValueError, match="overlap|share"):
            tier.get_pages(keys, [[shared], [shared]])
        with pytest.raises(ValueError, match="page 0: regions hold"):
            tier.get_pages(["a"], [[region()[:100]]])
        with pytest.raises(TypeError, match="1-D uint8"):
            tier.get_pages(["a"], [[torch.zeros(PAGE // 4, dtype=torch.int32)]])
        assert quick_counts(tier) == (0, 0)


def flip_byte(tier, key: str, at: int) -> None:
    """Damage ``key``'s stored page: one bit of its byte ``at`` flipped in the slab file."""
    f, off = tier.store.location(tier.directory._index[key])
    with open(tier.store.files[f].path, "r+b") as fh:
        fh.seek(off + at)
        b = fh.read(1)
        fh.seek(off + at)
        fh.write(bytes([b[0] ^ 0x10]))


def test_a_corrupt_page_is_handed_on_and_dropped(tmp_path):
    keys = ["x0", "x1", "x2"]
    with Tier(LAYOUT, config(tmp_path), device="cpu") as tier:
        assert all(put(tier, keys))
        flip_byte(tier, "x1", 100)
        hits, out = get(tier, keys)
        assert hits == [True, False, True]
        assert torch.equal(out[0], content("x0")) and torch.equal(out[2], content("x2"))
        s = tier.stats()
        assert s["corrupt_pages"] == 1 and not tier.contains("x1")
        assert quick_counts(tier) == (0, 1)
        assert get(tier, ["x0", "x2"])[0] == [True, True]  # the rest: quick again
        assert quick_counts(tier) == (1, 1)


def test_a_truncated_slab_is_handed_on(tmp_path):
    keys = [f"t{i}" for i in range(4)]
    with Tier(LAYOUT, config(tmp_path), device="cpu") as tier:
        assert all(put(tier, keys))
        slots = [tier.directory._index[k] for k in keys]
        f, off = tier.store.location(slots[2])
        assert [tier.store.location(s) for s in slots] == [(f, i * SLOT) for i in range(4)]
        os.truncate(tier.store.files[f].path, off + 100)
        hits, out = get(tier, keys)
        assert hits == [True, True, False, False]
        assert all(torch.equal(o, content(k)) for k, o in zip(keys[:2], out))
        assert [tier.contains(k) for k in keys] == hits
        assert tier.stats()["unreadable_pages"] == 2


@pytest.mark.parametrize("fails", [Tier.READ_RETRIES, Tier.READ_RETRIES + 1])
def test_transient_eio_is_tried_as_often_as_before(tmp_path, monkeypatch, fails):
    """The first ``fails`` reads of the file fail with EIO; the quick read is the first try,
    so a page is read READ_RETRIES more times in all, as on the general path, then dropped."""
    keys = ["e0", "e1"]
    with Tier(LAYOUT, config(tmp_path), device="cpu") as tier:
        assert all(put(tier, keys))
        attempts = fail_first_reads(monkeypatch, tier.backend, tier.store.files[0].fd, fails)
        hits, out = get(tier, keys)
        if fails <= Tier.READ_RETRIES:
            assert hits == [True, True] and all(torch.equal(o, content(k))
                                                for k, o in zip(keys, out))
            assert attempts() == fails + 1
        else:
            assert hits == [False, False] and not any(tier.contains(k) for k in keys)
            assert attempts() == Tier.READ_RETRIES + 1  # bounded, as on the general path
            assert tier.stats()["unreadable_pages"] == 2
        assert quick_counts(tier) == (0, 1)


def test_an_exception_in_the_quick_read_is_handed_on(tmp_path, monkeypatch):
    """Not an answer of the engine (a bug, a closed file): the general path reads again. (The
    quick restore's Python steps: the engine's functions raise.)"""
    with Tier(LAYOUT, config(tmp_path), device="cpu") as tier:
        assert all(put(tier, ["r"]))
        monkeypatch.setattr(tier.backend, "native_reader", None)
        engine = tier.backend._engine
        calls = []

        def once_broken(real):  # (read_pages, or copy_pages where the store is on tmpfs)
            def call(*args):
                calls.append(1)
                if len(calls) == 1:
                    raise RuntimeError("broken once")
                return real(*args)
            return call

        monkeypatch.setattr(tier.backend, "_engine", dataclasses.replace(
            engine, read_pages=once_broken(engine.read_pages),
            copy_pages=once_broken(engine.copy_pages)))
        hits, out = get(tier, ["r"])
        assert hits == [True] and torch.equal(out[0], content("r")) and len(calls) == 2
        assert quick_counts(tier) == (0, 1) and tier.contains("r")


def test_an_exception_in_the_native_reader_is_handed_on(tmp_path, monkeypatch):
    """The native reader raising (a closed mapping, a bug): the general path reads the call
    in full, and nothing stays pinned."""
    with Tier(LAYOUT, config(tmp_path), device="cpu") as tier:
        assert all(put(tier, ["r", "s"]))
        calls = []

        class Broken:
            def read(self, keys, addresses):
                calls.append(list(keys))
                raise RuntimeError("broken")

        monkeypatch.setattr(tier.backend, "native_reader", Broken())
        hits, out = get(tier, ["s", "none", "r"])
        assert hits == [True, False, True] and calls == [["s", "none", "r"]]
        assert torch.equal(out[0], content("s")) and torch.equal(out[2], content("r"))
        assert quick_counts(tier) == (0, 1) and not tier.directory._pins.any()


def test_a_file_gone_is_read_once_more_then_dropped(tmp_path, monkeypatch):
    """ESTALE lasts: the general path reads once (after the quick read) and drops, no retry."""
    with Tier(LAYOUT, config(tmp_path), device="cpu") as tier:
        assert all(put(tier, ["g"]))
        fd = tier.store.files[0].fd
        seen = fail_io(monkeypatch, tier.backend, "read", lambda f, _: f == fd, errno.ESTALE)
        assert get(tier, ["g"])[0] == [False]
        first = seen[0]
        assert seen.count(first) == 2 and not tier.contains("g")


def test_pages_of_another_checksum_go_the_general_way(tmp_path):
    """A store another configuration wrote (xxh3 pages): verified with the algorithm that
    made each page, by the general path."""
    keys = ["old0", "old1"]
    with Tier(LAYOUT, config(tmp_path, in_place=False), device="cpu") as tier:
        tier._checksums = checksum.checksummer(checksum.XXH3, LAYOUT)  # (through staging)
        assert all(put(tier, keys))
    with Tier(LAYOUT, config(tmp_path), device="cpu") as tier:
        assert tier.directory.algorithms([tier.directory._index[k] for k in keys]).tolist() \
            == [checksum.XXH3] * 2
        hits, out = get(tier, keys)
        assert hits == [True, True] and all(torch.equal(o, content(k))
                                            for k, o in zip(keys, out))
        assert quick_counts(tier) == (0, 1)


def test_threads_restore_concurrently_bit_exact(tmp_path):
    keys = [f"p{i}" for i in range(32)]
    with Tier(LAYOUT, config(tmp_path), device="cpu") as tier:
        assert all(put(tier, keys))

        def worker(k: int) -> None:
            for i in range(60):
                key = keys[(k * 7 + i) % len(keys)]
                hits, out = get(tier, [key])
                assert hits == [True] and torch.equal(out[0], content(key)), key

        problems = run_in_threads(worker, 6)
        assert not problems, problems[0]
        s = tier.stats()
        assert s["hits"] == 360 and s["misses"] == 0
        # every call took the quick path: quick restores are not combined (their reads
        # overlap), so none waited for a batch
        assert s["quick_restores"] == 360 and s.get("quick_calls_handed_on", 0) == 0
        assert s["calls_combined"] == 0


@pytest.mark.parametrize("why, overrides", [
    ("verify=false", dict(verify=False)),
    ("io_on_caller=false", dict(io_on_caller=False)),
    ("in_place=false", dict(in_place=False)),
])
def test_tiers_without_the_quick_path_say_why(tmp_path, why, overrides):
    with Tier(LAYOUT, config(tmp_path, **overrides), device="cpu") as tier:
        q = tier.stats()["quick_restore"]
        assert not q["enabled"] and why in q["reason"]
        assert all(put(tier, ["w"])) and get(tier, ["w"])[0] == [True]


# -- spills -------------------------------------------------------------------------------------
def test_small_spills_take_the_quick_path_and_survive_a_restart(tmp_path):
    keys = [f"s{i}" for i in range(8)]
    with Tier(LAYOUT, config(tmp_path), device="cpu") as tier:
        assert tier.stats()["quick_spill"]["enabled"]
        assert put(tier, keys[:1]) == [True]
        assert put(tier, keys[1:4]) == [True] * 3
        assert put(tier, keys[2:8]) == [True] * 6  # two of them stored already: hits
        assert quick_counts(tier, "quick_spills") == (3, 0)
        s = tier.stats()
        assert s["put_stored"] == 10 and s["pages_written_in_place"] == 8
        hits, out = get(tier, keys)
        assert all(hits) and all(torch.equal(o, content(k)) for k, o in zip(keys, out))
    with Tier(LAYOUT, config(tmp_path), device="cpu") as tier:  # the journal has them
        hits, out = get(tier, keys)
        assert all(hits) and all(torch.equal(o, content(k)) for k, o in zip(keys, out))
    with Tier(LAYOUT, config(tmp_path), device="cpu", scan_headers=True) as tier:
        # and so do their slot trailers: a directory rebuilt from them finds every page
        hits, out = get(tier, keys)
        assert all(hits) and all(torch.equal(o, content(k)) for k, o in zip(keys, out))


def test_a_full_store_evicts_and_journals_it(tmp_path):
    cfg = config(tmp_path, capacity=16 * SLOT)
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        n = tier.store.num_slots
        keys = [f"f{i}" for i in range(n + 5)]
        for k in keys:
            assert put(tier, [k]) == [True]
        assert tier.stats()["evictions"] == 5
        assert quick_counts(tier, "quick_spills") == (n + 5, 0)
        assert [tier.contains(k) for k in keys] == [False] * 5 + [True] * n
    with Tier(LAYOUT, cfg, device="cpu") as tier:  # the evictions were journaled
        assert [tier.contains(k) for k in keys] == [False] * 5 + [True] * n
        hits, out = get(tier, keys[5:9])
        assert all(hits) and all(torch.equal(o, content(k)) for k, o in zip(keys[5:9], out))


def test_a_failed_write_is_handed_on_and_not_acknowledged(tmp_path, monkeypatch):
    with Tier(LAYOUT, config(tmp_path), device="cpu") as tier:
        assert put(tier, ["ok"]) == [True]
        failed = fail_io(monkeypatch, tier.backend, "write")  # every write: EIO
        assert put(tier, ["w0", "w1"]) == [False, False]
        assert failed  # the quick write and the general path's both failed
        assert not tier.contains("w0") and not tier.contains("w1")
        s = tier.stats()
        assert s["write_failed"] == 2 and s["quick_calls_handed_on"] == 1
        monkeypatch.undo()
        assert put(tier, ["w0", "w1"]) == [True, True]  # the slots were given back
        hits, out = get(tier, ["ok", "w0", "w1"])
        assert all(hits) and torch.equal(out[1], content("w0"))
    with Tier(LAYOUT, config(tmp_path), device="cpu") as tier:
        assert get(tier, ["ok", "w0", "w1"])[0] == [True] * 3


def test_a_failed_fdatasync_is_handed_on(tmp_path, monkeypatch):
    """The quick spill's fdatasync fails once (EIO): nothing of it was journaled, the general
    path writes and syncs again."""
    with Tier(LAYOUT, config(tmp_path), device="cpu") as tier:
        real = tier.store.sync
        calls = []

        def sync_once_broken(files=None):
            calls.append(files)
            if len(calls) == 1:
                raise OSError(errno.EIO, "fdatasync failed")
            return real(files)

        monkeypatch.setattr(tier.store, "sync", sync_once_broken)
        assert put(tier, ["d"]) == [True] and len(calls) == 2
        assert quick_counts(tier, "quick_spills") == (0, 1)
        assert get(tier, ["d"])[0] == [True]
    with Tier(LAYOUT, config(tmp_path), device="cpu") as tier:
        hits, out = get(tier, ["d"])
        assert hits == [True] and torch.equal(out[0], content("d"))


def test_a_removed_store_file_refuses_quick_spills(tmp_path):
    with Tier(LAYOUT, config(tmp_path), device="cpu") as tier:
        assert put(tier, ["before"]) == [True]
        os.unlink(tier.store.files[0].path)
        assert put(tier, ["after"]) == [False] and not tier.contains("after")
        assert put(tier, ["later"]) == [False]  # refused from now on


def test_async_spills_take_the_quick_path(tmp_path):
    with Tier(LAYOUT, config(tmp_path), device="cpu") as tier:
        pages = []
        for k in ("a0", "a1"):
            r = region()
            r.copy_(content(k))
            pages.append([r])
        assert tier.put_pages_async(["a0", "a1"], pages).result() == [True, True]
        assert quick_counts(tier, "quick_spills") == (1, 0)
        # a spill's regions may be one buffer twice (it only reads them)
        assert tier.put_pages(["b0", "b1"], [pages[0], pages[0]]) == [True, True]
        hits, out = get(tier, ["a1", "b1"])
        assert hits == [True, True] and torch.equal(out[0], content("a1")) \
            and torch.equal(out[1], content("a0"))


def test_admission_keeps_spills_on_the_general_path(tmp_path):
    with Tier(LAYOUT, config(tmp_path, admit_after=2), device="cpu") as tier:
        q = tier.stats()["quick_spill"]
        assert not q["enabled"] and "admit_after=2" in q["reason"]
        assert tier.stats()["quick_restore"]["enabled"]
        assert put(tier, ["x"]) == [False] and put(tier, ["x"]) == [True]


def test_threads_spill_and_restore_concurrently_bit_exact(tmp_path):
    with Tier(LAYOUT, config(tmp_path, capacity=256 * SLOT), device="cpu") as tier:
        def worker(k: int) -> None:
            assert put(tier, [f"c{k}-0"]) == [True]
            for i in range(1, 40):
                key = f"c{k}-{i}"
                assert put(tier, [key]) == [True], key
                hits, out = get(tier, [key, f"c{k}-{i // 2}"])
                assert hits == [True, True], key
                assert torch.equal(out[0], content(key))
                assert torch.equal(out[1], content(f"c{k}-{i // 2}"))

        problems = run_in_threads(worker, 6)
        assert not problems, problems[0]
        s = tier.stats()
        # restores are never combined; spills that find calls_at_once others running wait and
        # are combined (group commit), the others take the quick path
        assert s["quick_restores"] == 234 and s["put_stored"] == 240
        assert 1 <= s["quick_spills"] <= 240 and s.get("quick_calls_handed_on", 0) == 0


# -- the native reader ----------------------------------------------------------------------------
def test_the_native_reader_runs_on_the_native_path(tmp_path, data_path):
    """Quick restores are one call of the native engine's QuickReader; on the Python path (and
    without the extension) their steps are Python."""
    with Tier(LAYOUT, config(tmp_path), device="cpu") as tier:
        steps = tier.stats()["quick_restore"]["steps"]
        if data_path == "native":
            assert type(tier.backend.native_reader).__name__ == "QuickReader"
            assert steps.startswith("one native call")
        else:
            assert tier.backend.native_reader is None and steps.startswith("Python steps")
        assert all(put(tier, ["a", "b"]))
        assert get(tier, ["b", "a"])[0] == [True, True]
        assert not tier.directory._pins.any()


def test_the_readers_pin_and_touch_as_the_directory_does(tmp_path):
    """A quick restore's hits are used (LRU) in the order a restore touches them, so a full
    store evicts the same pages after restores on either path."""
    keys = [f"l{i}" for i in range(8)]
    evicted = []
    for path in ("native", "python"):
        (tmp_path / path).mkdir()
        with Tier(LAYOUT, config(tmp_path / path, capacity=8 * SLOT), device="cpu") as tier:
            if path == "python":
                tier.backend.native_reader = None
            assert all(put(tier, keys))
            assert get(tier, [keys[3], "none", keys[0]])[0] == [True, False, True]
            assert get(tier, [keys[5]])[0] == [True]
            assert not tier.directory._pins.any()
            assert all(put(tier, ["n0", "n1", "n2", "n3", "n4"]))
            evicted.append(sorted(k for k in keys if not tier.contains(k)))
    assert evicted[0] == evicted[1] == ["l1", "l2", "l4", "l6", "l7"]


def test_a_page_evicted_during_a_native_read_goes_at_its_unpin(tmp_path, monkeypatch):
    """A page asked to go while the native reader holds it (EVICTING) goes when the read
    ends: freed and journaled by the directory's own unpin, the read itself whole. Another
    thread evicts the key when it sees the reader's pin (the copy gives the GIL up: a 1 MiB
    page and hold_gil_below(0))."""
    native = pytest.importorskip("gdskv.native._pages")
    layout = BytePageLayout(page_bytes=1 << 20, kind="test/quick-evicting")
    cfg = TierConfig(directories=(str(tmp_path),), capacity=4 * layout.slot_bytes,
                     files_per_dir=1, staging_size=8 * layout.slot_bytes)
    page = torch.arange(layout.page_bytes, dtype=torch.int64).to(torch.uint8)
    caught = 0
    before = native.hold_gil_below(0)
    try:
        with Tier(layout, cfg, device="cpu") as tier:
            if tier.backend.native_reader is None:
                pytest.skip("the page engine's Python path: no native reader")
            directory, pins = tier.directory, tier.directory._pins
            unpinned = []  # the reader's release_evicting: the directory's own unpin
            real_unpin = directory.unpin
            monkeypatch.setattr(directory, "unpin",
                                lambda slots: unpinned.append(list(slots)) or real_unpin(slots))
            for attempt in range(300):
                key = f"e{attempt}"
                src = alloc_host(layout.page_bytes, pin=False)
                src.copy_(page)
                assert tier.put_pages([key], [[src]]) == [True]
                slot = directory._index[key]
                stop = threading.Event()

                def evict_when_pinned():
                    while not stop.is_set():
                        if pins[slot]:
                            tier.evict([key])
                            return

                t = threading.Thread(target=evict_when_pinned)
                t.start()
                out = alloc_host(layout.page_bytes, pin=False).zero_()
                hit = tier.get_pages([key], [[out]])
                stop.set()
                t.join()
                assert hit == [True] and torch.equal(out, page)
                assert not pins.any()
                tier.evict([key])  # (where the thread did not)
                assert not tier.contains(key) and directory.state(key) == 0  # FREE
                if unpinned:
                    assert unpinned == [[slot]]
                    unpinned.clear()
                    caught += 1
                    if caught == 3:
                        break
            assert caught, "no eviction landed during a read in 300 tries"
        with Tier(layout, cfg, device="cpu") as again:  # the journal has every eviction
            assert len(again.directory) == 0
    finally:
        native.hold_gil_below(before)


def test_the_native_reader_called_directly(tmp_path):
    """The reader's own contract (white box): hits, misses and a key twice, its answers for the
    general path, and bad arguments refused before anything is pinned."""
    with Tier(LAYOUT, config(tmp_path), device="cpu") as tier:
        reader = tier.backend.native_reader
        if reader is None:
            pytest.skip("the page engine's Python path: no native reader")
        assert all(put(tier, ["a", "b"]))
        out = [region() for _ in range(3)]
        addresses = [o.data_ptr() for o in out]
        hits, count, seconds = reader.read(["a", "none", "a"], addresses)
        assert hits == [True, False, True] and count == 2 and seconds >= 0
        assert torch.equal(out[0], content("a")) and torch.equal(out[2], content("a"))
        assert reader.read(["none"], addresses[:1]) == ([False], 0, 0.0)
        with pytest.raises(ValueError, match="2 keys and 1 addresses"):
            reader.read(["a", "b"], addresses[:1])
        with pytest.raises(ValueError, match="address 0 is 0"):
            reader.read(["a"], [0])
        with pytest.raises(TypeError):
            reader.read(("a",), addresses[:1])
        # pages of another checksum algorithm: 0, nothing pinned or read
        slot = tier.directory._index["b"]
        tier.directory._algorithm[slot] = checksum.XXH3
        out[1].zero_()
        assert reader.read(["a", "b"], addresses[:2]) == 0 and not out[1].any()
        assert not tier.directory._pins.any()


BIG = BytePageLayout(page_bytes=1 << 20, kind="test/quick-parts")


def big_content(key: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(key.encode()) * 31 + len(key))
    return torch.randint(0, 256, (BIG.page_bytes,), dtype=torch.uint8, generator=gen)


class RecordingReader:
    """The tier's native reader, each call's keys and thread recorded; ``fail`` makes the
    call that reads that key raise instead."""

    def __init__(self, reader, fail: str | None = None) -> None:
        self.reader, self.fail, self.calls = reader, fail, []

    def read(self, keys, addresses):
        self.calls.append((list(keys), threading.current_thread().name))
        if self.fail in keys:
            raise RuntimeError("broken part")
        return self.reader.read(keys, addresses)


@pytest.mark.parametrize("damage", [None, "corrupt", "exception"])
def test_large_native_restores_are_cut_into_parts(tmp_path, monkeypatch, damage):
    """A restore of 24 MiB: parts of at least 4 MiB, one for each idle pool thread and the
    caller, every page exact and misses where keys are missing. A damaged page or a part that
    raises sends the whole call to the general path, which settles it as ever."""
    cfg = TierConfig(directories=(str(tmp_path),), capacity=32 * BIG.slot_bytes,
                     files_per_dir=1, io_threads=4, staging_size=32 * BIG.slot_bytes)
    with Tier(BIG, cfg, device="cpu") as tier:
        if tier.backend.native_reader is None:
            pytest.skip("the page engine's Python path: no native reader")
        keys = [f"b{i}" for i in range(22)]
        srcs = [alloc_host(BIG.page_bytes, pin=False).copy_(big_content(k)) for k in keys]
        assert all(tier.put_pages(keys, [[s] for s in srcs]))
        if damage == "corrupt":
            flip_byte(tier, "b17", 4096)
        recording = RecordingReader(tier.backend.native_reader,
                                    "b9" if damage == "exception" else None)
        monkeypatch.setattr(tier.backend, "native_reader", recording)
        wanted = keys[:10] + ["none0"] + keys[10:] + ["none1"]
        out = [alloc_host(BIG.page_bytes, pin=False).zero_() for _ in wanted]
        hits = tier.get_pages(wanted, [[o] for o in out])
        gone = {"b17"} if damage == "corrupt" else set()
        assert hits == [k in keys and k not in gone for k in wanted]
        assert all(torch.equal(o, big_content(k)) for k, o, h in zip(wanted, out, hits) if h)
        # 24 pages of 1 MiB (and a slot trailer): 5 parts, the first on the caller's thread
        # (the parts run at once: recorded in any order)
        parts = sorted(recording.calls, key=lambda c: wanted.index(c[0][0]))
        assert len(parts) == 5 and [k for c, _ in parts for k in c] == wanted
        assert parts[0][1] == threading.current_thread().name
        assert all(name.startswith("gdskv-posix") for _, name in parts[1:])
        assert quick_counts(tier) == ((0, 1) if damage else (1, 0))
        assert tier.stats()["corrupt_pages"] == (1 if damage == "corrupt" else 0)
        assert not tier.directory._pins.any() and tier.backend._in_pool == 0


@pytest.mark.parametrize("fail_part", [False, True])
def test_large_quick_spills_are_cut_into_parts(tmp_path, monkeypatch, fail_part):
    """A spill of 22 MiB on the native engine: one quick spill, its checksums and its write in
    parts for the pool's idle threads and the caller; every page restorable, also after a
    restart. A part whose write fails sends the whole call to the general path (nothing of it
    acknowledged), which stores it as ever."""
    cfg = TierConfig(directories=(str(tmp_path),), capacity=48 * BIG.slot_bytes,
                     files_per_dir=1, io_threads=4, staging_size=8 * BIG.slot_bytes)
    keys = [f"w{i}" for i in range(22)]
    srcs = [alloc_host(BIG.page_bytes, pin=False).copy_(big_content(k)) for k in keys]
    with Tier(BIG, cfg, device="cpu") as tier:
        if tier.backend._engine.path != "native":
            pytest.skip("the page engine's Python path: quick spills of one on-caller I/O")
        real_write = tier.backend.write_on_caller
        parts = []

        def write(places, memory, slot_bytes, page_bytes):
            parts.append((len(places), threading.current_thread().name))
            if fail_part and len(parts) == 2:
                return False
            return real_write(places, memory, slot_bytes, page_bytes)

        monkeypatch.setattr(tier.backend, "write_on_caller", write)
        assert tier.put_pages(keys, [[s] for s in srcs]) == [True] * len(keys)
        # 22 pages of 1 MiB (and a slot trailer): 5 parts, one on the caller's thread
        assert len(parts) == 5 and sum(n for n, _ in parts) == 22
        names = [name for _, name in parts]
        assert names.count(threading.current_thread().name) == 1
        assert sum(name.startswith("gdskv-posix") for name in names) == 4
        assert quick_counts(tier, "quick_spills") == ((0, 1) if fail_part else (1, 0))
        assert not tier.directory._pins.any() and tier.backend._in_pool == 0
    with Tier(BIG, cfg, device="cpu") as again:  # journaled and durable as any spill
        out = [alloc_host(BIG.page_bytes, pin=False).zero_() for _ in keys]
        assert again.get_pages(keys, [[o] for o in out]) == [True] * len(keys)
        assert all(torch.equal(o, big_content(k)) for k, o in zip(keys, out))


@pytest.mark.parametrize("call", ["put_pages", "get_pages", "put_pages_async",
                                  "get_pages_async"])
def test_pages_and_keys_that_differ_in_number_are_refused(tmp_path, call):
    """Regions that would qualify for the quick path are still counted against the keys: one
    key with two pages, or two keys with one, is a ValueError, never a page stored from the
    wrong region (combined async calls concatenate their pages)."""
    with Tier(LAYOUT, config(tmp_path), device="cpu") as tier:
        assert put(tier, ["x"]) == [True]
        fn = getattr(tier, call)
        for keys, count in ((["a"], 2), (["a", "b"], 1)):
            with pytest.raises(ValueError, match="page buffers for"):
                out = fn(keys, [[region()] for _ in range(count)])
                if call.endswith("_async"):
                    out.result(30)
        assert tier.directory.contains("x") and not tier.directory.contains("a")
