"""Resource errors for real: ENOSPC on a small tmpfs, EFBIG under RLIMIT_FSIZE, and slab files
that are unreadable, deleted or truncated. The affected pages fail (put False / get miss),
earlier pages stay readable, the store stays usable, nothing crashes."""

from __future__ import annotations

import errno
import json
import os

import pytest

from gdskv.store import StoreError
from gdskv.tier import Tier
from reliability_helpers import (LAYOUT, SLOT, check_pages, file_size_limit_child, forkserver, put,
                                 ready_keys, slot_location, small_config)


def _fill(path, leave: int) -> None:
    """Take all free space of the file system holding ``path`` but ``leave`` bytes."""
    st = os.statvfs(os.path.dirname(path))
    free = st.f_bavail * st.f_frsize - leave
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(free, 4096))
    finally:
        os.close(fd)


def test_enospc_at_creation(small_fs):
    """A capacity over the free space is refused before anything is written (issue 19 #2): the
    error names the capacity and the free bytes, the directory stays empty, and a retry with a
    capacity that fits creates the store."""
    with pytest.raises(StoreError, match=r"capacity 16777216 B needs .* which has \d+ B free") \
            as info:
        Tier(LAYOUT, small_config(small_fs, capacity=16 << 20), device="cpu")
    assert info.value.errno == errno.ENOSPC
    assert os.listdir(small_fs) == []
    with Tier(LAYOUT, small_config(small_fs, capacity=4 << 20), device="cpu") as tier:
        assert all(put(tier, ["a", "b"]))


def test_enospc_journal_full(small_fs):
    """Preallocated slabs never run out; the journal does. Puts fail while the disk is full,
    the pages committed before stay, and a half-written journal append must not hide the
    records appended after space comes back."""
    cfg = small_config(small_fs, capacity=256 * SLOT)
    filler = os.path.join(small_fs, "filler")
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        before = [f"e{i}" for i in range(8)]
        assert all(put(tier, before))
        _fill(filler, leave=0)
        ok, n = [], 0
        while len(ok) < 200 and (not ok or any(ok[-8:])):  # until the journal cannot grow
            ok += put(tier, [f"x{n + i}" for i in range(8)])
            n += 8
        assert not all(ok), "the tmpfs never filled up"
        stored = before + [f"x{i}" for i, good in enumerate(ok) if good]
        res = check_pages(tier, stored)
        assert res["hits"] == len(stored) and not res["wrong"]
        assert tier.stats()["write_failed"] > 0
        os.unlink(filler)
        assert all(put(tier, ["after1", "after2"]))  # usable again
        stored += ["after1", "after2"]
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        # every acknowledged page; also pages whose bytes landed before their journal append
        # failed, which recovery finds past the journal's end (their own bytes, verified)
        ready = set(ready_keys(tier))
        assert set(stored) <= ready and ready - set(stored) <= {f"x{i}" for i in range(n)}
        res = check_pages(tier, ready)
        assert res["hits"] == len(ready) and not res["wrong"]


def test_enospc_lazy_slabs(small_fs):
    """preallocate=False: the store is larger than the disk; writes past the free space fail
    for those pages only, and evicting makes room again (freed slots already have blocks)."""
    cfg = small_config(small_fs, capacity=4096 * SLOT, preallocate=False, io_chunk_size=16 * SLOT)
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        assert all(os.path.getsize(f.path) == 0 for f in tier.store.files)
        ok, n = [], 0
        while n < 4096 and (not ok or any(ok[-32:])):
            ok += put(tier, [f"z{n + i}" for i in range(32)])
            n += 32
        stored = [f"z{i}" for i, good in enumerate(ok) if good]
        assert 0 < len(stored) < n, "expected the disk to fill before the store"
        res = check_pages(tier, stored)
        assert res["hits"] == len(stored) and not res["wrong"]
        tier.evict(stored[:64])
        again = put(tier, [f"y{i}" for i in range(32)])
        assert all(again), "freed slots must be reusable after ENOSPC"
        stored = stored[64:] + [f"y{i}" for i in range(32)]
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        res = check_pages(tier, stored)
        assert res["hits"] == len(stored) and not res["wrong"]


def test_efbig_rlimit_fsize(tmp_path):
    ctx = forkserver()
    result = tmp_path / "result.json"
    limit = 16 * SLOT  # 64 KiB per file; the store asks for 2 files of 32 slots
    child = ctx.Process(target=file_size_limit_child, args=(str(tmp_path), str(result), limit))
    (tmp_path / "prealloc").mkdir(mode=0o700)
    (tmp_path / "lazy").mkdir(mode=0o700)
    child.start()
    child.join(60)
    assert child.exitcode == 0, f"child exit {child.exitcode}"
    out = json.loads(result.read_text())
    print(out)
    assert out["prealloc"].startswith(f"StoreError errno={errno.EFBIG}")
    # the failed creation removed what it made (issue 19 #2): a retry is a fresh creation,
    # not "another geometry"
    assert os.listdir(tmp_path / "prealloc") == []
    with Tier(LAYOUT, small_config(tmp_path / "prealloc", capacity=8 * SLOT), device="cpu") as t:
        assert all(put(t, ["retry"]))
    assert out["stored"] == 32 and out["failed"] == 32  # 16 slots fit under the limit per file
    assert out["stored_hits"] == 32 and out["stored_wrong"] == 0 and out["sizes_ok"]
    assert out["after_evict_stored"] == 16 and out["final_hits"] == 32 and out["final_wrong"] == 0
    assert out["write_failed"] >= 32


def _stored_tier(tmp_path, n=32, **overrides):
    cfg = small_config(tmp_path, **overrides)
    tier = Tier(LAYOUT, cfg, device="cpu")
    keys = [f"r{i}" for i in range(n)]
    assert all(put(tier, keys))
    return cfg, tier, keys


def test_truncated_slab_file(tmp_path):
    cfg, tier, keys = _stored_tier(tmp_path)
    where = {k: slot_location(tier, k) for k in keys}
    path = tier.store.files[0].path
    tier.close()
    os.truncate(path, 3 * SLOT + 100)  # cuts through the 4th slot of file 0
    cut = {k for k, (p, off) in where.items() if p == path and off + SLOT > 3 * SLOT + 100}
    assert cut
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        res = check_pages(tier, keys)
        # a short read fails its whole I/O extent: whole pages before the cut that shared
        # the extent miss too (conservative); pages in the other file are untouched
        in_file0 = {k for k, (p, _) in where.items() if p == path}
        assert cut <= set(res["missed"]) <= in_file0 and not res["wrong"]
        assert all(put(tier, ["new1", "new2"]))  # still usable
        assert check_pages(tier, ["new1", "new2"])["hits"] == 2


def test_deleted_slab_file(tmp_path):
    cfg, tier, keys = _stored_tier(tmp_path)
    where = {k: slot_location(tier, k) for k in keys}
    path = tier.store.files[1].path
    os.unlink(path)  # the open descriptor still reads the old inode
    assert check_pages(tier, keys)["hits"] == len(keys)
    tier.close()
    gone = {k for k, (p, _) in where.items() if p == path}
    with Tier(LAYOUT, cfg, device="cpu") as tier:  # the file comes back empty
        res = check_pages(tier, keys)
        assert set(res["missed"]) == gone and not res["wrong"]
        assert set(ready_keys(tier)) == set(keys) - gone
        assert all(put(tier, sorted(gone)))
        assert check_pages(tier, keys)["hits"] == len(keys)


def test_unreadable_slab_file(tmp_path):
    """Reads failing with an OS error (here EBADF: the slab descriptor swapped for a
    write-only one) are misses, and the store keeps working. (Reads by preadv: a store on
    tmpfs is otherwise read from its files' mappings, which a new descriptor does not touch.)"""
    cfg, tier, keys = _stored_tier(tmp_path, map_memory_files=False)
    f = tier.store.files[0]
    wfd = os.open(f.path, os.O_WRONLY)
    os.dup2(wfd, f.fd)
    os.close(wfd)
    in_file0 = {k for k in keys if slot_location(tier, k)[0] == f.path}
    res = check_pages(tier, keys)
    assert set(res["missed"]) == in_file0 and not res["wrong"]
    assert tier.stats()["read_failed"] >= len(in_file0)
    # a read error that outlasts the retries drops the pages (issue 46 #1), for good
    assert {k for k in keys if not tier.contains(k)} == in_file0
    tier.close()
    with Tier(LAYOUT, cfg, device="cpu") as tier:  # a fresh descriptor: the store works again
        assert set(check_pages(tier, keys)["missed"]) == in_file0
        assert all(put(tier, sorted(in_file0)))
        assert check_pages(tier, keys)["hits"] == len(keys)


def test_journal_that_cannot_cut_a_failed_append_stops_committing(tmp_path, monkeypatch):
    """If a failed append cannot even be cut off again, later records would sit behind garbage
    and be lost on replay: the journal refuses further appends, so puts fail instead of
    reporting pages that a restart would not find. Reads go on."""
    cfg = small_config(tmp_path)
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        assert all(put(tier, ["a"]))
        real_truncate = os.ftruncate
        jfd = tier.journal._fd

        def half_append(fd, data, sync, in_memory=False):  # (the page engine's append_file)
            os.write(fd, bytes(data)[: len(data) // 2])
            raise OSError(errno.EIO, "injected write error")

        def no_truncate(fd, size):
            if fd == jfd:
                raise OSError(errno.EIO, "injected truncate error")
            return real_truncate(fd, size)

        monkeypatch.setattr(tier.journal, "_append_file", half_append)
        monkeypatch.setattr(os, "ftruncate", no_truncate)
        assert put(tier, ["b"]) == [False]
        monkeypatch.undo()
        assert put(tier, ["c"]) == [False]  # refused: would be unreachable after the garbage
        assert check_pages(tier, ["a"])["hits"] == 1
    with Tier(LAYOUT, cfg, device="cpu") as tier:  # the torn tail is cut at open
        # ... and the header scan it sets off may also take "b"/"c": their bytes and slot
        # trailers reached the slab before the journal refused them; they read back exact
        back = set(ready_keys(tier))
        assert "a" in back and back <= {"a", "b", "c"}
        res = check_pages(tier, sorted(back))
        assert res["hits"] == len(back) and not res["wrong"]
        assert put(tier, ["d"]) == [True]
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        assert set(ready_keys(tier)) == back | {"d"}
