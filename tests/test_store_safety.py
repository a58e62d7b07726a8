"""Two processes, keys and file safety, layout mismatch, checksum algorithm ids."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import time

import numpy as np
import pytest
import torch
import xxhash

from gdskv import checksum
from gdskv.journal import MAX_KEY_BYTES
from gdskv.layout import KVLayout
from gdskv.store import JOURNAL, LOCK, MANIFEST, MANIFEST_COPY, StoreError, StoreLockedError, StoreMismatchError
from gdskv.tier import Tier
from ack_helpers import ack_writer, read_log, wait_for_acks
from reliability_helpers import (LAYOUT, PAGE, SLOT, check_pages, flip_byte, forkserver,
                                 hold_store, page_content, put, read_back, ready_keys,
                                 slot_location, small_config, try_open)

STORE_FILES = {LOCK, MANIFEST, MANIFEST_COPY, JOURNAL, "slab-000.bin", "slab-001.bin"}


# -- two processes ---------------------------------------------------------------------------------
def _wait_for(path, child, timeout=60.0):
    t0 = time.monotonic()
    while not os.path.exists(path):
        assert child.is_alive(), f"child exited early ({child.exitcode})"
        assert time.monotonic() - t0 < timeout, "child never opened the store"
        time.sleep(0.02)


def test_second_process_is_locked_out_until_owner_dies(tmp_path):
    ctx = forkserver()
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    ready = tmp_path / "ready"
    child = ctx.Process(target=hold_store, args=(str(store), str(ready), {}))
    child.start()
    try:
        _wait_for(ready, child)
        with pytest.raises(StoreLockedError, match="open in another process"):
            Tier(LAYOUT, small_config(store), device="cpu")
    finally:
        child.kill()  # SIGKILL: the kernel drops the flock with the process
        child.join()
    with Tier(LAYOUT, small_config(store), device="cpu") as tier:
        assert not check_pages(tier, ["held"])["missed"]


def test_other_process_cannot_open_while_we_hold_it(tmp_path):
    ctx = forkserver()
    result = tmp_path / "result"
    tier = Tier(LAYOUT, small_config(tmp_path / "."), device="cpu")
    try:
        child = ctx.Process(target=try_open, args=(str(tmp_path), str(result), {}))
        child.start()
        child.join(60)
        assert result.read_text().startswith("StoreLockedError")
    finally:
        tier.close()
    child = ctx.Process(target=try_open, args=(str(tmp_path), str(result), {}))
    child.start()
    child.join(60)
    assert result.read_text() == "opened"


def test_a_second_tier_in_this_process_is_told_so(tmp_path):
    """The same store opened twice in one process: the message says where the owner is."""
    with Tier(LAYOUT, small_config(tmp_path), device="cpu"):
        with pytest.raises(StoreLockedError, match="open in this process"):
            Tier(LAYOUT, small_config(tmp_path), device="cpu")
    with Tier(LAYOUT, small_config(tmp_path), device="cpu") as tier:  # released at close
        assert all(put(tier, ["after"]))


def _wait_for_log(path, child, done, timeout=120.0):
    t0 = time.monotonic()
    while not done(read_log(path)):
        assert child.is_alive() or done(read_log(path)), f"child exited ({child.exitcode})"
        assert time.monotonic() - t0 < timeout, f"timed out: {read_log(path)}"
        time.sleep(0.02)


def test_removed_lock_file_lets_no_second_writer_in(tmp_path):
    """gdskv.lock removed under a running writer (issue 46, item 3): a second writer must still
    be refused (the first also holds its slab files' locks), the first stops acknowledging puts
    (stats' state says why), and every page either acknowledged reads back after a restart."""
    ctx = forkserver()
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    overrides = dict(capacity=256 * SLOT)
    logs = [str(tmp_path / "first.log"), str(tmp_path / "second.log")]
    children = [ctx.Process(target=ack_writer, args=(str(store), logs[0], "a", overrides))]
    children[0].start()
    try:
        wait_for_acks(logs[0], children[0], 40)
        os.unlink(store / LOCK)
        children.append(ctx.Process(target=ack_writer, args=(str(store), logs[1], "b", overrides)))
        children[1].start()
        _wait_for_log(logs[1], children[1], lambda log: log["opened"] or log["error"])
        if read_log(logs[1])["opened"]:  # (the old behaviour) both write for a while
            wait_for_acks(logs[1], children[1], 40)
            time.sleep(2)
        _wait_for_log(logs[0], children[0], lambda log: log["states"], timeout=30)
    finally:
        for child in children:
            child.kill()
            child.join()
    first, second = read_log(logs[0]), read_log(logs[1])
    acked = first["acked"] + second["acked"]
    with Tier(LAYOUT, small_config(store, **overrides), device="cpu") as tier:
        res = check_pages(tier, acked)
    print(f"acknowledged {len(acked)} pages ({len(first['acked'])} + {len(second['acked'])}), "
          f"lost {len(res['missed'])}, wrong {len(res['wrong'])}; second writer: "
          f"{second['error'] or 'opened'}")
    assert not res["wrong"]
    assert not second["opened"] and second["error"].startswith("StoreLockedError"), second
    assert "open in another process" in second["error"]
    assert first["states"][0].startswith("puts refused: store files removed while open") and \
        "gdskv.lock" in first["states"][0], first["states"]
    assert not res["missed"], f"acknowledged pages lost: {res['missed'][:10]}"


def test_lock_file_replaced_under_a_writer_stops_puts(tmp_path):
    """A lock file renamed away and made again (another inode at the path): a second opener
    would lock the new file, so the writer stops acknowledging puts as for a removed one."""
    with Tier(LAYOUT, small_config(tmp_path), device="cpu") as tier:
        assert all(put(tier, ["a"]))
        os.rename(tmp_path / LOCK, tmp_path / "elsewhere")
        (tmp_path / LOCK).write_bytes(b"")
        assert put(tier, ["b"]) == [False]
        assert "gdskv.lock" in tier.stats()["state"]
        with pytest.raises(StoreLockedError, match="open in this process"):
            Tier(LAYOUT, small_config(tmp_path), device="cpu")
        assert check_pages(tier, ["a"])["hits"] == 1


# -- keys ------------------------------------------------------------------------------------------
def test_keys_are_never_paths(tmp_path):
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    keys = ["../../etc/passwd", "/etc/shadow", "a/b/../c", ".", "..", "", "nul\x00inside",
            "ключ", "x" * 10_000, b"../../raw", b"\x00\xff/\x00", b""]
    with Tier(LAYOUT, small_config(store), device="cpu") as tier:
        assert all(put(tier, keys))
        res = check_pages(tier, keys)
        assert res["hits"] == len(keys) and not res["wrong"]
    assert set(os.listdir(store)) == STORE_FILES
    assert os.listdir(tmp_path) == ["store"]
    with Tier(LAYOUT, small_config(store), device="cpu") as tier:
        assert set(ready_keys(tier)) == set(keys)
        assert check_pages(tier, keys)["hits"] == len(keys)


def test_unjournalable_keys_fail_before_io(tmp_path):
    with Tier(LAYOUT, small_config(tmp_path), device="cpu") as tier:
        with pytest.raises(ValueError, match="longer than"):
            put(tier, ["ok1", "k" * (MAX_KEY_BYTES + 1)])
        with pytest.raises(ValueError, match="UTF-8"):
            put(tier, ["ok2", "bad\ud800"])
        assert not tier.contains("ok1") and not tier.contains("ok2")
        assert all(put(tier, ["ok3"]))
    with Tier(LAYOUT, small_config(tmp_path), device="cpu") as tier:
        assert ready_keys(tier) == ["ok3"]


# -- files -----------------------------------------------------------------------------------------
def test_store_files_are_private(tmp_path):
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    old = os.umask(0o022)  # a usual umask: the store must not depend on it
    try:
        with Tier(LAYOUT, small_config(store), device="cpu") as tier:
            assert all(put(tier, ["a", "b"]))
            tier.journal.records_written = 10_000  # force compaction at close (journal rewritten)
    finally:
        os.umask(old)
    for name in os.listdir(store):
        mode = stat.S_IMODE(os.lstat(store / name).st_mode)
        assert mode == 0o600, f"{name} has mode {mode:o}"
    with Tier(LAYOUT, small_config(store), device="cpu") as tier:
        assert set(ready_keys(tier)) == {"a", "b"}


def test_world_writable_directory_warns(tmp_path, caplog):
    os.chmod(tmp_path, 0o777)
    with caplog.at_level(logging.WARNING, logger="gdskv.store"):
        Tier(LAYOUT, small_config(tmp_path), device="cpu").close()
    assert "writable by other users" in caplog.text


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory owned by another user needs root")
def test_foreign_directory_and_symlinks(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o755)
    os.chown(foreign, 65534, 65534)
    with pytest.raises(StoreError, match="belongs to uid 65534"):
        Tier(LAYOUT, small_config(foreign), device="cpu")
    link = tmp_path / "link"
    link.symlink_to(foreign)
    with pytest.raises(StoreError, match="belongs to uid 65534"):
        Tier(LAYOUT, small_config(link), device="cpu")


def test_symlinked_directory_to_own_directory_is_followed(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "mnt"
    link.symlink_to(real)
    with Tier(LAYOUT, small_config(link), device="cpu") as tier:
        assert tier.store.directories == [str(real)]
        assert all(put(tier, ["p"]))
    with Tier(LAYOUT, small_config(real), device="cpu") as tier:
        assert tier.contains("p")


@pytest.mark.parametrize("name", ["slab-001.bin", JOURNAL, MANIFEST, LOCK])
def test_store_file_replaced_by_symlink_is_refused(tmp_path, name):
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    Tier(LAYOUT, small_config(store), device="cpu").close()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.unlink(store / name)
    (store / name).symlink_to(victim)
    with pytest.raises(StoreError, match="symlink"):
        Tier(LAYOUT, small_config(store), device="cpu")
    assert victim.read_bytes() == b"precious"


@pytest.mark.parametrize("content", ["copy", "zeros"])
def test_slab_file_replaced_by_other_file(tmp_path, caplog, content):
    """A slab file swapped for another regular file is detected by its inode; its pages are
    kept only where its slot trailers prove them: a byte-identical copy (a restore) keeps them
    all, a file of zeros none; the other file's pages stay either way."""
    cfg = small_config(tmp_path)
    keys = [f"i{i}" for i in range(24)]
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        assert all(put(tier, keys))
        where = {k: slot_location(tier, k)[0] for k in keys}
    path = str(tmp_path / "slab-000.bin")
    if content == "copy":
        shutil.copyfile(path, path + ".new")
    else:
        with open(path + ".new", "wb") as f:
            f.truncate(os.path.getsize(path))
    os.chmod(path + ".new", 0o600)
    os.replace(path + ".new", path)
    with caplog.at_level(logging.WARNING, logger="gdskv.store"):
        with Tier(LAYOUT, cfg, device="cpu") as tier:
            assert tier.store.replaced_files == {0}
            kept = set(keys) if content == "copy" else {k for k in keys if where[k] != path}
            assert set(ready_keys(tier)) == kept
            assert check_pages(tier, keys)["hits"] == len(kept)
            assert all(put(tier, keys))
    assert "were replaced" in caplog.text
    with Tier(LAYOUT, cfg, device="cpu") as tier:  # the new identity was recorded
        assert tier.store.replaced_files == set() and set(ready_keys(tier)) == set(keys)


def test_other_layout_or_geometry_is_refused(tmp_path):
    with Tier(LAYOUT, small_config(tmp_path), device="cpu") as tier:
        assert all(put(tier, ["a"]))
    with pytest.raises(StoreMismatchError, match="written for layout"):
        Tier(KVLayout(num_layers=4, page_size=4, head_dim=48, dtype="float16"),
             small_config(tmp_path), device="cpu")
    with pytest.raises(StoreMismatchError, match="another geometry"):
        Tier(LAYOUT, small_config(tmp_path, capacity=128 * 4096), device="cpu")
    with Tier(LAYOUT, small_config(tmp_path), device="cpu") as tier:  # still intact
        assert not check_pages(tier, ["a"])["missed"]


# -- checksum algorithms ---------------------------------------------------------------------------
class _Xxh64:
    """A stand-in second algorithm (xxh64), to show pages are verified with their own."""
    algorithm = 200

    def __init__(self, layout):
        self.page_bytes, self.slot_bytes = layout.page_bytes, layout.slot_bytes

    def compute(self, staging, num_pages):
        view = staging.numpy()
        return np.array([xxhash.xxh64_intdigest(view[p * self.slot_bytes:
                                                     p * self.slot_bytes + self.page_bytes])
                         for p in range(num_pages)], dtype=np.uint64)


def test_pages_are_verified_with_their_recorded_algorithm(tmp_path):
    checksum.register(_Xxh64.algorithm, _Xxh64)
    try:
        cfg = small_config(tmp_path)
        with Tier(LAYOUT, cfg, device="cpu") as tier:
            tier._checksums = _Xxh64(LAYOUT)  # a tier writing with another algorithm
            tier._verifiers[_Xxh64.algorithm] = tier._checksums
            assert all(put(tier, ["old1", "old2", "old3"]))
        with Tier(LAYOUT, cfg, device="cpu") as tier:  # writes CRC32C, still reads the old ones
            assert all(put(tier, ["new1"]))
            assert list(tier.directory.algorithms([tier.directory._index[k] for k in
                                                   ("old1", "new1")])) == [200, checksum.CRC32C]
            path, off = slot_location(tier, "old2")
            fd = os.open(path, os.O_RDWR)
            os.pwrite(fd, bytes([os.pread(fd, 1, off + PAGE - 1)[0] ^ 1]), off + PAGE - 1)
            os.close(fd)
            res = check_pages(tier, ["old1", "old2", "old3", "new1"])
            assert res["missed"] == ["old2"] and not res["wrong"]
            tier.journal.records_written = 10_000  # compaction must keep each page's algorithm
        with Tier(LAYOUT, cfg, device="cpu") as tier:
            assert check_pages(tier, ["old1", "old3", "new1"])["hits"] == 3
    finally:
        checksum._FACTORIES.pop(_Xxh64.algorithm, None)
    with Tier(LAYOUT, small_config(tmp_path), device="cpu") as tier:  # algorithm unknown here
        assert set(ready_keys(tier)) == {"new1"}


@pytest.mark.parametrize("aligned", [True, False], ids=["in-place", "staged"])
def test_xxh3_pages_of_older_host_tiers_stay_readable(tmp_path, aligned):
    """Host tiers wrote xxh3 (algorithm 1) before CRC-32C: a tier now writing CRC-32C reads
    them, verified with xxh3 (in place into the caller's memory, or through staging), and a
    flipped bit in one is still a miss; its own new pages are CRC-32C."""
    cfg = small_config(tmp_path)
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        tier._checksums = checksum.PageChecksummer(LAYOUT)  # what a host tier wrote before
        tier._verifiers[checksum.XXH3] = tier._checksums
        tier._host_pages.why_not = "xxh3 pages go through staging (as before CRC-32C)"
        assert all(put(tier, ["x1", "x2", "x3"]))
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        assert tier.stats()["in_place"]["enabled"]
        assert all(put(tier, ["c1"]))
        slots = [tier.directory._index[k] for k in ("x1", "x2", "x3", "c1")]
        assert list(tier.directory.algorithms(slots)) == [checksum.XXH3] * 3 + [checksum.CRC32C]
        flip_byte(tier, "x2", PAGE // 2)
        hits, out = read_back(tier, ["x1", "x2", "x3", "c1"], aligned=aligned)
        assert hits == [True, False, True, True]
        assert all(torch.equal(o, page_content(k)) for k, o, h in
                   zip(["x1", "x2", "x3", "c1"], out, hits) if h)


# -- admission -------------------------------------------------------------------------------------
def test_admission_filter_writes_only_repeated_pages(tmp_path):
    with Tier(LAYOUT, small_config(tmp_path, admit_after=2), device="cpu") as tier:
        assert put(tier, ["once", "twice"]) == [False, False]  # first offer: not written
        assert put(tier, ["twice"]) == [True]
        assert tier.contains("twice") and not tier.contains("once")
        assert tier.stats()["not_admitted"] == 2 and tier.stats()["put_stored"] == 1
        assert check_pages(tier, ["twice"])["hits"] == 1


def test_gpu_page_checksums_verify_on_the_host(tmp_path):
    """Pages a GPU tier wrote (algorithm GPU_PAGE) are verified with that algorithm by a host
    tier (torch reference of the kernel): intact pages hit, a flipped bit is a miss."""
    cfg = small_config(tmp_path)
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        tier._checksums = checksum.GpuPageChecksummer(LAYOUT)  # as a CUDA tier writes
        assert all(put(tier, ["g1", "g2"]))
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        assert list(tier.directory.algorithms([tier.directory._index[k] for k in ("g1", "g2")])) \
            == [checksum.GPU_PAGE] * 2
        path, off = slot_location(tier, "g2")
        fd = os.open(path, os.O_RDWR)
        os.pwrite(fd, bytes([os.pread(fd, 1, off + 5)[0] ^ 0x10]), off + 5)
        os.close(fd)
        res = check_pages(tier, ["g1", "g2"])
        assert res["hits"] == 1 and res["missed"] == ["g2"] and not res["wrong"]
