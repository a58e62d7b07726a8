"""SlabStore: geometry, striping, extent coalescing, O_DIRECT fallback reporting, locking."""

from __future__ import annotations

import errno
import os
import stat
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gdskv import store as store_mod
from gdskv.backends.base import Extent
from gdskv.config import TierConfig
from gdskv.layout import KVLayout
from gdskv.store import SlabStore, StoreError, StoreLockedError

LAYOUT = KVLayout(num_layers=1, page_size=1, head_dim=768, kv_heads=1, dtype="fp16")  # 4 KiB slots


def cfg(*dirs, **kw) -> TierConfig:
    base = dict(directories=tuple(str(d) for d in dirs), capacity=64 * 4096,
                io_chunk_size=4 * 4096, files_per_dir=2)
    base.update(kw)
    return TierConfig(**base)


def test_striping_and_coalescing(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    s = SlabStore(LAYOUT, cfg(a, b))
    try:
        assert s.num_slots == 64 and s.num_files == 4 and s.stripe_slots == 4
        # stripes of 4 slots rotate over 4 files in two directories
        assert [s.location(g)[0] for g in (0, 3, 4, 8, 12, 16)] == [0, 0, 1, 2, 3, 0]
        assert s.location(16) == (0, 4 * 4096)
        assert {os.path.dirname(f.path) for f in s.files} == {str(a), str(b)}
        ext = s.extents([0, 1, 2, 3, 4, 5, 9])
        assert ext == [Extent(0, 0, 4 * 4096, 0), Extent(1, 0, 2 * 4096, 4 * 4096),
                       Extent(2, 4096, 4096, 6 * 4096)]
        assert s.extents([2, 1]) == [Extent(0, 8192, 4096, 0), Extent(0, 4096, 4096, 4096)]
        for f in s.files:
            assert os.fstat(f.fd).st_size == s.file_bytes == 16 * 4096
            assert stat.S_IMODE(os.stat(f.path).st_mode) == 0o600
    finally:
        s.close()


@pytest.fixture(scope="module", params=[1, 3], ids=["one-file", "three-files"])
def striped_store(tmp_path_factory, request):
    """A 4-KiB-slot store of 3-slot stripes over one file or three (a run of slots in one
    file coalesces across stripes only in the first)."""
    d = tmp_path_factory.mktemp("striped")
    s = SlabStore(LAYOUT, cfg(d, io_chunk_size=3 * 4096, files_per_dir=request.param,
                              capacity=60 * 4096))
    yield s
    s.close()


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_extents_put_each_slot_where_it_lives_in_as_few_extents_as_adjacency_allows(
        striped_store, data):
    s = striped_store
    n = s.num_slots
    slots = data.draw(st.one_of(
        st.lists(st.integers(0, n - 1), max_size=40),  # any order, repeats
        st.builds(lambda first, k: [(first + i) % n for i in range(k)],  # runs, wrapping
                  st.integers(0, n - 1), st.integers(0, 40))))
    ext = s.extents(slots)
    sb = s.slot_bytes
    # every position's bytes go to its own slot's place, in buffer order
    covered = [(e.file, e.file_offset + i * sb, e.buffer_offset + i * sb)
               for e in ext for i in range(e.length // sb)]
    assert covered == [(*s.location(slot), pos * sb) for pos, slot in enumerate(slots)]
    # and no two neighbours could have been one extent
    for a, b in zip(ext, ext[1:]):
        assert not (a.file == b.file and a.file_offset + a.length == b.file_offset)


def test_second_open_is_refused_until_close(tmp_path):
    s = SlabStore(LAYOUT, cfg(tmp_path))
    with pytest.raises(StoreLockedError, match="open in this process"):
        SlabStore(LAYOUT, cfg(tmp_path))
    s.close()
    SlabStore(LAYOUT, cfg(tmp_path)).close()


def test_capacity_smaller_than_a_slot(tmp_path):
    with pytest.raises(StoreError, match="smaller than one page slot"):
        SlabStore(LAYOUT, cfg(tmp_path, capacity=100))


def test_odirect_refusal_falls_back_and_says_so(tmp_path, monkeypatch, caplog):
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(store_mod.os, "open", refusing_open)
    with caplog.at_level("WARNING", logger="gdskv.store"):
        s = SlabStore(LAYOUT, cfg(tmp_path))
    try:
        assert s.direct is False and "O_DIRECT" in s.direct_reason
        assert not any(f.direct for f in s.files)
        assert sum("O_DIRECT refused" in r.message for r in caplog.records) == 1  # once, not per file
    finally:
        s.close()


def test_direct_io_on_fails_loudly_when_refused(tmp_path, monkeypatch):
    real_open = os.open
    monkeypatch.setattr(store_mod.os, "open", lambda p, f, *a: (_ for _ in ()).throw(
        OSError(errno.EINVAL, "Invalid argument")) if f & getattr(os, "O_DIRECT", 0)
        else real_open(p, f, *a))
    with pytest.raises(StoreError, match="direct_io=on"):
        SlabStore(LAYOUT, cfg(tmp_path, direct_io="on"))


def test_direct_io_off(tmp_path):
    s = SlabStore(LAYOUT, cfg(tmp_path, direct_io="off"))
    try:
        assert s.direct is False and s.direct_reason == "off by config"
    finally:
        s.close()


def test_file_system_type_is_the_longest_mount_above_the_path(tmp_path):
    """From mountinfo: the deepest mount point above a path (the later of two stacked on one
    point), mount points with escaped spaces, and paths not made yet."""
    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw\n"
        "30 22 0:26 / /dev/shm rw,nosuid shared:3 - tmpfs tmpfs rw\n"
        "31 22 0:27 / /mnt/my\\040disk rw - xfs /dev/nvme0n1 rw\n"
        "32 22 0:28 / /mnt rw - ext4 /dev/vdb rw\n"
        "33 22 0:29 / /mnt rw - ramfs ramfs rw\n")
    fs = store_mod.file_system_type
    assert fs("/dev/shm", str(info)) == "tmpfs"
    assert fs("/dev/shm/gdskv/not-yet/made", str(info)) == "tmpfs"
    assert fs("/dev/shmem", str(info)) == "ext4"       # a name that only starts the same
    assert fs("/mnt/my disk/store", str(info)) == "xfs"
    assert fs("/mnt/other", str(info)) == "ramfs"      # stacked: the later mount is seen
    assert fs("/var/tmp", str(info)) == "ext4"
    assert fs("/x", str(tmp_path / "missing")) is None
    # this machine's own: a tmpfs /dev/shm where it has one is memory-backed, its tmp_path is
    # whatever it is
    if store_mod.file_system_type("/dev/shm") == "tmpfs":
        assert store_mod.memory_backed("/dev/shm/x")
    assert store_mod.memory_backed(str(tmp_path)) == \
        (store_mod.file_system_type(str(tmp_path)) in ("tmpfs", "ramfs"))


def test_io_pieces_spread_a_small_call_over_the_threads():
    from gdskv.backends.base import MIN_PIECE_BYTES, io_pieces

    mib = 1 << 20
    extents = [Extent(f, 0, 16 * mib, f * 16 * mib) for f in range(4)]  # one 64 MiB call
    pieces = io_pieces(extents, threads=16, max_bytes=16 * mib)
    assert len(pieces) == 16 and {p.length for _, p in pieces} == {4 * mib}
    # pieces tile each extent exactly, tagged with the extent they came from
    for i, e in enumerate(extents):
        mine = [p for idx, p in pieces if idx == i]
        assert [p.file_offset for p in mine] == [e.file_offset + k * 4 * mib for k in range(4)]
        assert [p.buffer_offset for p in mine] == [e.buffer_offset + k * 4 * mib for k in range(4)]
    # a large call keeps the io_chunk_size cap; a tiny one never goes below the minimum
    big = io_pieces([Extent(0, 0, 1024 * mib, 0)], threads=16, max_bytes=16 * mib)
    assert len(big) == 64 and max(p.length for _, p in big) == 16 * mib
    small = io_pieces([Extent(0, 0, 3 * mib + 4096, 0)], threads=16, max_bytes=16 * mib)
    assert [p.length for _, p in small] == [MIN_PIECE_BYTES] * 3 + [4096]
    # a larger minimum (the posix backend's) uses fewer threads for a short call
    short = io_pieces([Extent(0, 0, 16 * mib + 4096, 0)], threads=16, max_bytes=16 * mib,
                      min_bytes=4 * mib)
    assert [p.length for _, p in short] == [4 * mib] * 4 + [4096]
    odd = io_pieces([Extent(0, 0, 10 * mib + 4096, 0)], threads=3, max_bytes=16 * mib)
    assert all(p.length % 4096 == 0 for _, p in odd)
    assert sum(p.length for _, p in odd) == 10 * mib + 4096


def test_posix_cuts_a_call_for_the_threads_left_idle(tmp_path):
    """A call alone is cut for every pool thread; one that finds pieces of other calls in the
    pool is cut for the threads left (pieces beyond them would only queue), at most
    io_chunk_size each, and the count of pieces in the pool is back to 0 when all are done."""
    import threading

    from gdskv.backends.base import SlabFile
    from gdskv.backends.posix import PosixBackend

    mib = 1 << 20
    path = tmp_path / "slab"
    with open(path, "wb") as fh:
        fh.truncate(64 * mib)
    fd = os.open(path, os.O_RDWR)
    backend = PosixBackend(TierConfig(directories=(str(tmp_path),), backend="posix",
                                      io_threads=8, io_chunk_size="32MiB"))

    def busy(n: int) -> None:  # pieces of other calls, as the pool's counter sees them
        with backend._in_pool_lock:
            backend._in_pool += n
    try:
        backend.attach([SlabFile(0, str(path), fd, False, 64 * mib)])
        buffer = np.zeros(32 * mib, np.uint8)
        extents = [Extent(0, 0, 32 * mib, 0, (buffer,))]
        seen = []
        real = backend._pieces
        backend._pieces = lambda *a: seen.append(real(*a)) or seen[-1]
        assert backend._submit("read", None, extents).result().nbytes == 32 * mib
        assert [p.length for _, p in seen[-1]] == [4 * mib] * 8      # alone: every thread
        assert backend._in_pool == 0
        gate = threading.Event()
        blockers = [backend._pool.submit(gate.wait) for _ in range(6)]
        busy(6)                                                      # 6 of 8 threads busy
        futures = [backend._submit("read", None, extents)]
        assert [p.length for _, p in seen[-1]] == [16 * mib] * 2    # for the 2 left idle
        busy(1)                                                      # 1 idle: one piece
        futures.append(backend._submit("read", None, extents))
        assert [p.length for _, p in seen[-1]] == [32 * mib]
        busy(-7)
        gate.set()
        for f in blockers + futures:
            f.result()
        backend._pool.shutdown(wait=True)
        assert backend._in_pool == 0
        # a submit that fails gives back the pieces it did not hand over

        class Refusing:
            def submit(self, *args, **kwargs):
                raise RuntimeError("can't start new thread")

        backend._pool = Refusing()
        with pytest.raises(RuntimeError, match="new thread"):
            backend._submit("read", None, extents)
        assert backend._in_pool == 0
    finally:
        backend._pool = None
        os.close(fd)


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 9000), min_size=1, max_size=12),
       piece=st.integers(1, 20000))
def test_split_extents_cuts_an_extents_io_vector_into_its_consecutive_bytes(sizes, piece):
    """Each piece carries exactly its bytes of the extent's I/O vector, in order (the vector's
    buffers are of any size, empty ones included, as pages and scratch rows make them)."""
    from gdskv.backends.base import slice_memory, split_extents

    data = np.arange(sum(sizes), dtype=np.int64).astype(np.uint8)
    bounds = np.cumsum([0] + sizes)
    memory = tuple(data[a:b] for a, b in zip(bounds[:-1], bounds[1:]))
    extent = Extent(0, 4096, len(data), 0, memory)
    pieces = split_extents([extent], piece)
    assert sum(p.length for _, p in pieces) == len(data)
    for _, p in pieces:
        got = np.concatenate([np.asarray(b) for b in p.memory]) if p.memory else data[:0]
        want = np.concatenate(slice_memory(memory, p.buffer_offset, p.length) or (data[:0],))
        assert p.file_offset - 4096 == p.buffer_offset and len(got) == p.length
        assert np.array_equal(got, want)
        assert all(np.shares_memory(b, data) for b in p.memory if len(b))  # views, no copies


def test_run_split_cuts_for_idle_threads_and_callers(tmp_path):
    """Backend.run_split (posix): a call alone takes every idle pool thread and the caller, in
    parts of at least 4 MiB; a call while another caller splits counts that caller as busy;
    a part's exception is its result; every part ends before run_split returns."""
    from gdskv.backends.posix import MIN_PIECE_BYTES, PosixBackend

    backend = PosixBackend(TierConfig(directories=(str(tmp_path),), backend="posix",
                                      io_threads=4))
    try:
        seen, lock = [], threading.Lock()

        def record(a, b):
            with lock:
                seen.append((a, b, threading.current_thread().name))
            return b - a

        # alone: 4 pool threads and the caller; the caller runs the first part
        out = backend.run_split(record, 100, 100 * MIN_PIECE_BYTES)
        assert len(out) == 5 and sum(out) == 100
        assert sorted((a, b) for a, b, _ in seen) == [(0, 20), (20, 40), (40, 60), (60, 80),
                                                      (80, 100)]
        assert [n for a, _, n in seen if a == 0] == [threading.current_thread().name]
        assert backend._in_pool == 0 and backend._splitting == 0
        # small: parts of at least MIN_PIECE_BYTES
        assert len(backend.run_split(record, 100, 3 * MIN_PIECE_BYTES)) == 3
        # while another caller splits (its parts holding the pool), a call runs alone here
        hold, started = threading.Event(), threading.Event()

        def blocked(a, b):
            started.set()
            hold.wait(10)
            return b - a

        first = threading.Thread(target=backend.run_split,
                                 args=(blocked, 100, 100 * MIN_PIECE_BYTES))
        first.start()
        started.wait(10)
        seen.clear()
        assert backend.run_split(record, 100, 100 * MIN_PIECE_BYTES) == [100]
        assert [n for _, _, n in seen] == [threading.current_thread().name]
        hold.set()
        first.join(10)
        assert backend._in_pool == 0 and backend._splitting == 0

        def fails_second(a, b):
            if a:
                raise OSError(errno.EIO, "part failed")
            return b - a

        out = backend.run_split(fails_second, 10, 10 * MIN_PIECE_BYTES)
        assert out[0] == 2 and all(isinstance(o, OSError) for o in out[1:])
        assert backend._in_pool == 0
    finally:
        backend.close()
