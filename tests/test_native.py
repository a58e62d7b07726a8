"""The page engine (gdskv/native): the C extension against its Python oracle.

The extension must be built (pip install); its CRC-32C equals the crc32c package's, and its
page checksums, reads, writes, per-segment results and per-page statuses equal the Python
path's for the same calls, failures included. Tiers on the two paths write byte-identical
slabs (trailers included) and read each other's. A call releases the GIL while it works.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import shutil
import tempfile
import sys
import threading
import time

import crc32c
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gdskv import checksum, native
from gdskv import store as store_mod
from gdskv.config import TierConfig
from gdskv.layout import BytePageLayout, KVLayout
from gdskv.memory import alloc_host
from gdskv.tier import Tier

from conftest import empty_like_pool, random_pool

NATIVE, PYTHON = native.NATIVE, native.PYTHON_BY_CHOICE
NATIVE_MODULE = native._pages
needs_native = pytest.mark.skipif(NATIVE is None, reason="the extension did not load: "
                                  "test_the_extension_is_built says why")


@pytest.fixture
def both_paths(data_path):
    """For a test that picks the paths itself through native.engine()."""
    if data_path == "python":
        pytest.skip("compares the native and Python paths itself: it runs in the default "
                    "(native) pass, not under --data-path python")


def test_the_extension_is_built(both_paths):
    """Not a skip: a broken build must fail CI, not quietly test the Python path twice."""
    assert NATIVE is not None, f"gdskv.native._pages did not load: {native.LOAD_ERROR}"
    assert native.engine() is NATIVE and native.engine(False).path == "python"
    if os.uname().machine == "x86_64" and "sse4_2" in open("/proc/cpuinfo").read():
        assert NATIVE.checksum == "sse4.2"


def test_a_failed_load_is_logged_once_and_named(monkeypatch, caplog, both_paths):
    monkeypatch.setattr(native, "NATIVE", None)
    monkeypatch.setattr(native, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="gdskv.native"):
        first, second = native.engine(), native.engine()
    assert first.path == second.path == "python" and "did not load" in first.reason
    assert len([r for r in caplog.records if "did not load" in r.getMessage()]) == 1


# -- CRC-32C ------------------------------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 767, 768, 769, 4096, 24575, 24576, 24577,
                               65536 + 3, 1 << 20])
def test_crc32c_equals_the_package(n):
    data = np.random.default_rng(n).integers(0, 256, n + 5, dtype=np.uint8)
    for skew in range(0, 5):  # every alignment of the start
        want = crc32c.crc32c(data[skew:skew + n])
        assert NATIVE.crc32c(data[skew:skew + n]) == want
        assert native._pages.crc32c_table(data[skew:skew + n]) == want
    assert NATIVE.crc32c(b"123456789") == 0xE3069283  # the check value of CRC-32C


@needs_native
@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=30_000), st.integers(0, 30_000), st.integers(0, 2**32 - 1))
def test_crc32c_continues_a_value(data, cut, value):
    cut = min(cut, len(data))
    whole = crc32c.crc32c(data, value)
    assert NATIVE.crc32c(data[cut:], NATIVE.crc32c(data[:cut], value)) == whole
    assert native._pages.crc32c_table(data, value) == whole


def _frame(rng, pages: int, slot: int, cuts: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """``pages`` slots of random bytes, and the same bytes as buffers cut at random places."""
    raw = rng.integers(0, 256, pages * slot, dtype=np.uint8)
    at = sorted(rng.integers(0, len(raw) + 1, cuts).tolist())
    return raw, [raw[a:b] for a, b in zip([0] + at, at + [len(raw)])]


@needs_native
@settings(max_examples=40, deadline=None)
@given(st.integers(0, 9), st.integers(1, 9000), st.integers(0, 9000), st.integers(0, 12),
       st.integers(0, 2**32))
def test_page_sums_equal_the_oracle(pages, slot, page, cuts, seed):
    page = min(page, slot)
    raw, memory = _frame(np.random.default_rng(seed), pages, slot, cuts)
    got, want = np.zeros(pages, np.uint64), np.zeros(pages, np.uint64)
    NATIVE.page_sums(memory, slot, page, got)
    PYTHON.page_sums(memory, slot, page, want)
    assert list(got) == list(want) == [crc32c.crc32c(raw[k * slot:k * slot + page])
                                       for k in range(pages)]


@needs_native
@pytest.mark.parametrize("engine", [NATIVE, PYTHON], ids=["native", "python"])
def test_bad_arguments_are_value_errors(engine):
    buf = np.zeros(100, np.uint8)
    with pytest.raises(ValueError, match="whole number"):
        engine.page_sums([buf], 30, 30, np.zeros(4, np.uint64))
    with pytest.raises(ValueError, match="page_bytes"):
        engine.page_sums([buf], 50, 60, np.zeros(2, np.uint64))
    with pytest.raises(ValueError, match="segment 0"):  # a length that is not the buffer's
        engine.write_pages(np.array([[1, 0, 99]], np.int64), [buf], np.zeros((1, 2), np.int64))
    with pytest.raises(ValueError, match="2 buffers for 1 segments"):
        engine.write_pages(np.array([[1, 0, 100]], np.int64), [buf, buf],
                           np.zeros((1, 2), np.int64))
    if engine is NATIVE:  # (the Python path takes any array the numpy calls take)
        with pytest.raises(ValueError, match="sums"):
            engine.page_sums([buf], 50, 50, np.zeros(1, np.uint64))
    # memory as (address, length) rows: int64 pairs of real memory only
    for rows, match in ((np.zeros((1, 2), np.int32), "int64"), (np.zeros(3, np.int64), "int64"),
                        (np.array([[buf.ctypes.data, 100]], ">i8"), "int64"),  # byte-swapped
                        (np.array([[buf.ctypes.data, -1]], np.int64), "row 0"),
                        (np.array([[0, 0], [0, 100]], np.int64), "row 1")):
        with pytest.raises(ValueError, match=match):
            engine.page_sums(rows, 100, 100, np.zeros(1, np.uint64))


def _rows(buffers) -> np.ndarray:
    """The page engine's (address, length) rows of numpy buffers."""
    return np.array([(b.ctypes.data, b.nbytes) for b in buffers], np.int64).reshape(-1, 2)


@needs_native
@pytest.mark.parametrize("engine", [NATIVE, PYTHON], ids=["native", "python"])
def test_memory_given_as_address_rows(tmp_path, engine):
    """Every call takes its memory as buffers or as (address, length) rows of the same memory,
    with the same results: writes, sums, checked reads and copies from a mapping (a
    zero-length row included)."""
    rng = np.random.default_rng(11)
    slot, page = 5000, 4000
    src = [rng.integers(0, 256, n, dtype=np.uint8) for n in (page, slot - page, 0)] * 2
    fd = _files(tmp_path, 1, 0, engine.path)[0]
    segs = np.array([[fd, 0, page], [fd, page, slot - page], [fd, slot, 0],
                     [fd, slot, page], [fd, slot + page, slot - page], [fd, 2 * slot, 0]],
                    np.int64)
    res = np.zeros((6, 2), np.int64)
    assert engine.write_pages(segs, _rows(src), res) == 2 * slot
    assert os.pread(fd, 2 * slot, 0) == b"".join(b.tobytes() for b in src)
    by_buffers, by_rows = np.zeros(2, np.uint64), np.zeros(2, np.uint64)
    engine.page_sums(src, slot, page, by_buffers)
    engine.page_sums(_rows(src), slot, page, by_rows)
    assert by_rows.tolist() == by_buffers.tolist() == [
        crc32c.crc32c(src[0].tobytes()), crc32c.crc32c(src[3].tobytes())]
    mapping = mmap.mmap(fd, 2 * slot, mmap.MAP_SHARED, mmap.PROT_READ)
    try:
        for read in ("read", "copy"):
            dst = [np.zeros_like(b) for b in src]
            sums, status = np.zeros(2, np.uint64), np.full(2, 9, np.uint8)
            if read == "read":
                engine.read_pages(segs, _rows(dst), res, slot, page, by_buffers, sums, status, 0)
            else:
                rows = segs.copy()
                rows[:, 0] = 0
                engine.copy_pages([(fd, mapping)], rows, _rows(dst), res, slot, page,
                                  by_buffers, sums, status)
            assert [d.tobytes() for d in dst] == [b.tobytes() for b in src], read
            assert status.tolist() == [0, 0] and sums.tolist() == by_buffers.tolist(), read
    finally:
        mapping.close()
        os.close(fd)


# -- I/O ----------------------------------------------------------------------------------------
def _files(tmp_path, n: int, size: int, tag: str) -> list[int]:
    fds = []
    for i in range(n):
        fd = os.open(str(tmp_path / f"{tag}{i}"), os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, size)
        fds.append(fd)
    return fds


def _segments(rng, memory, fds_count: int) -> list[tuple[int, int, int]]:
    """(file index, offset, length) per buffer, never overlapping: runs of buffers that
    continue each other, and new runs (in another file, or after a gap)."""
    ends, f = [0] * fds_count, 0
    out = []
    for b in memory:
        if rng.random() < 0.3:  # a new run
            f = int(rng.integers(0, fds_count))
            ends[f] += int(rng.integers(0, 3000))
        out.append((f, ends[f], len(b)))
        ends[f] += len(b)
    return out


@needs_native
@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5000), st.integers(0, 10), st.integers(0, 2**32))
def test_reads_and_writes_equal_the_oracle(tmp_path_factory, pages, slot, cuts, seed):
    tmp = tmp_path_factory.mktemp("io")
    rng = np.random.default_rng(seed)
    size = 1 << 17  # larger than any frame and its gaps
    raw, memory = _frame(rng, pages, slot, cuts)
    layout = _segments(rng, memory, 2)
    fds = {name: _files(tmp, 2, size, name) for name in ("n", "p")}
    try:
        results = {}
        for name, engine in (("n", NATIVE), ("p", PYTHON)):
            segs = np.array([(fds[name][f], o, n) for f, o, n in layout], np.int64).reshape(-1, 3)
            res = np.full((len(memory), 2), 7, np.int64)
            assert engine.write_pages(segs, memory, res) == len(raw)
            assert not res[:, 1].any() and list(res[:, 0]) == [len(b) for b in memory]
            back = [np.zeros(len(b), np.uint8) for b in memory]
            want = np.array([crc32c.crc32c(raw[k * slot:k * slot + slot // 2])
                             for k in range(pages)], np.uint64)
            want[0] ^= 1  # page 0: a stored checksum that does not match
            sums, status = np.zeros(pages, np.uint64), np.full(pages, 9, np.uint8)
            assert engine.read_pages(segs, back, res, slot, slot // 2, want, sums, status,
                                     0) == len(raw)
            assert np.array_equal(np.concatenate(back + [np.zeros(0, np.uint8)]), raw)
            results[name] = (res.copy(), sums, status)
            if slot // 2:
                assert list(status) == [1] + [0] * (pages - 1)
        for a, b in zip(fds["n"], fds["p"]):  # the same bytes in the same places
            assert os.pread(a, size, 0) == os.pread(b, size, 0)
        for x, y in zip(results["n"], results["p"]):
            assert np.array_equal(x, y)
    finally:
        for fd in fds["n"] + fds["p"]:
            os.close(fd)


@needs_native
@pytest.mark.parametrize("engine", [NATIVE, PYTHON], ids=["native", "python"])
def test_failures_are_reported_per_segment_and_page(tmp_path, engine):
    fd = _files(tmp_path, 1, 3 * 1000, "f")[0]
    ro = os.open(str(tmp_path / "f0"), os.O_RDONLY)
    try:
        mem = [np.full(1000, i + 1, np.uint8) for i in range(4)]
        res = np.zeros((4, 2), np.int64)
        # segments 0-1: one run in the writable fd; 2-3: a run in the read-only one
        segs = np.array([[fd, 0, 1000], [fd, 1000, 1000], [ro, 2000, 1000], [ro, 3000, 1000]],
                        np.int64)
        assert engine.write_pages(segs, mem, res) == 2000
        assert res.tolist() == [[1000, 0], [1000, 0], [0, errno.EBADF], [0, errno.EBADF]]
        # reading 4 slots from a 3000-byte file: the last slot is past its end
        back = [np.zeros(1000, np.uint8) for _ in range(4)]
        segs = np.array([[fd, i * 1000, 1000] for i in range(4)], np.int64)
        sums, status = np.zeros(4, np.uint64), np.zeros(4, np.uint8)
        want = np.array([crc32c.crc32c(bytes([i + 1]) * 1000) for i in range(4)], np.uint64)
        assert engine.read_pages(segs, back, res, 1000, 1000, want, sums, status, 0) == 3000
        assert res.tolist() == [[1000, 0], [1000, 0], [1000, 0], [0, -1]]
        assert list(status) == [0, 0, 1, 2]  # page 2 holds zeros (never written), 3 not read
        assert list(sums[:2]) == list(want[:2]) and sums[3] == 0
        # a run that stops part way: its first segment partly moved, the rest not at all
        segs = np.array([[fd, 2500, 1000], [fd, 3500, 1000]], np.int64)
        part = [np.zeros(1000, np.uint8), np.zeros(1000, np.uint8)]
        assert engine.read_pages(segs, part, res[:2], 1, 0, None, None, None, 0) == 500
        assert res[:2].tolist() == [[500, -1], [0, -1]]
    finally:
        os.close(fd)
        os.close(ro)


def _mapped(path: str, size: int) -> tuple[int, mmap.mmap]:
    """(fd, read-only shared mapping of its first ``size`` bytes), as the posix backend maps a
    slab file held in memory."""
    fd = os.open(path, os.O_RDONLY)
    return fd, mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)


@needs_native
@settings(max_examples=25, deadline=None)
@given(st.integers(1, 5), st.sampled_from([1, 777, 4096, 30000, 3 * 8192 * 2 + 40]),
       st.integers(0, 8), st.integers(0, 2**32))
def test_copies_from_mappings_equal_reads(tmp_path_factory, pages, slot, cuts, seed):
    """copy_pages from two mapped files against read_pages of the same segments: the same
    bytes, results, checksums and statuses, on both paths (slots long enough for the
    interleaved streams of the fused copy, 3 x 8 KiB, and payloads cut anywhere)."""
    tmp = tmp_path_factory.mktemp("map")
    rng = np.random.default_rng(seed)
    raw, memory = _frame(rng, pages, slot, cuts)
    layout = _segments(rng, memory, 2)
    size = max(o + n for _, o, n in layout) + 4096
    fds = _files(tmp, 2, size, "m")
    page = slot - slot // 3
    try:
        segs = np.array([(fds[f], o, n) for f, o, n in layout], np.int64).reshape(-1, 3)
        assert NATIVE.write_pages(segs, memory, np.zeros((len(memory), 2), np.int64)) == len(raw)
        sources = [_mapped(str(tmp / f"m{i}"), size) for i in range(2)]
        want = np.array([crc32c.crc32c(raw[k * slot:k * slot + page]) for k in range(pages)],
                        np.uint64)
        want[-1] ^= 4  # the last page: a stored checksum that does not match
        rows = np.array([(f, o, n) for f, o, n in layout], np.int64).reshape(-1, 3)

        def outcomes(expect):
            got = []
            for engine, call in ((NATIVE, "read"), (NATIVE, "copy"), (PYTHON, "copy")):
                back = [np.zeros(len(b), np.uint8) for b in memory]
                res = np.full((len(memory), 2), 7, np.int64)
                sums, status = np.zeros(pages, np.uint64), np.full(pages, 9, np.uint8)
                if call == "read":
                    n = engine.read_pages(segs, back, res, slot, page, expect, sums, status, 0)
                else:
                    n = engine.copy_pages(sources, rows, back, res, slot, page, expect, sums,
                                          status)
                got.append((n, np.concatenate(back + [np.zeros(0, np.uint8)]), res, sums,
                            status))
            for other in got[1:]:
                for x, y in zip(got[0], other):
                    assert np.array_equal(x, y)
            return got[0]

        n, back, _res, _sums, status = outcomes(want)
        assert n == len(raw) and np.array_equal(back, raw)
        assert list(status) == [0] * (pages - 1) + [1]
        outcomes(None)  # no stored checksums: every page read whole is 0
        # file 1 cut at a random place (mid-page, mid-segment, or before its first byte): the
        # same bytes moved, end-of-file rows and not-read pages on all three
        os.truncate(str(tmp / "m1"), int(rng.integers(0, size)))
        n, _back, res, _sums, status = outcomes(want)
        assert n <= len(raw) and set(res[:, 1].tolist()) <= {0, -1}
    finally:
        for fd, mapping in locals().get("sources", []):
            mapping.close()
            os.close(fd)
        for fd in fds:
            os.close(fd)


@needs_native
@pytest.mark.parametrize("engine", [NATIVE, PYTHON], ids=["native", "python"])
def test_copies_stop_at_the_files_end(tmp_path, engine):
    """A file cut shorter than its mapping: bytes past its end are not touched (they would
    fault) and report the end, per segment and page, as read_pages reports them; a source
    whose fd is closed reports EBADF; a bad source index is a ValueError."""
    path = str(tmp_path / "f")
    with open(path, "wb") as fh:
        fh.write(bytes(range(250)) * 16)  # 4000 bytes
    fd, mapping = _mapped(path, 4000)
    try:
        os.truncate(path, 2500)
        back = [np.full(1000, 9, np.uint8) for _ in range(4)]
        rows = np.array([[0, i * 1000, 1000] for i in range(4)], np.int64)
        res = np.zeros((4, 2), np.int64)
        sums, status = np.zeros(4, np.uint64), np.zeros(4, np.uint8)
        assert engine.copy_pages([(fd, mapping)], rows, back, res, 1000, 1000, None, sums,
                                 status) == 2500
        assert res.tolist() == [[1000, 0], [1000, 0], [500, -1], [0, -1]]
        assert list(status) == [0, 0, 2, 2] and list(sums[2:]) == [0, 0]
        assert back[0].tobytes() == (bytes(range(250)) * 4) and set(back[3]) == {9}
        closed = os.dup(fd)
        os.close(closed)
        res[:] = 0
        assert engine.copy_pages([(closed, mapping)], rows[:1], back[:1], res[:1], 1, 0, None,
                                 None, None) == 0
        assert res[0].tolist() == [0, errno.EBADF]
        with pytest.raises(ValueError, match="segment 0"):
            engine.copy_pages([(fd, mapping)], np.array([[1, 0, 1000]], np.int64), back[:1],
                              res[:1], 1, 0, None, None, None)
        for bad in ((-1, mapping), (fd,), (1 << 40, mapping)):
            with pytest.raises(ValueError, match=r"sources\[0\]: expected \(fd, mapping\)"):
                engine.copy_pages([bad], rows[:1], back[:1], res[:1], 1, 0, None, None, None)
    finally:
        mapping.close()
        os.close(fd)


@needs_native
def test_a_file_cut_during_a_copy_reports_its_end(tmp_path):
    """A file cut shorter after copy_pages took its size (here: with the size not taken, the
    test hook) faults the copy (SIGBUS); the copying thread comes back out, the segment reports
    the file's end (-1, nothing of it counted) and so does the rest of that file, its pages are
    not read whole (2), the other file's are; and the process goes on (a second call too)."""
    page = 65536
    paths = [str(tmp_path / f"f{i}") for i in range(2)]
    for path in paths:
        with open(path, "wb") as fh:
            fh.write(os.urandom(4 * page))
    sources = [_mapped(path, 4 * page) for path in paths]
    try:
        os.truncate(paths[0], page + 30000)  # faults past the 4 KiB page holding byte 95,535
        rows = np.array([[0, i * page, page] for i in range(4)] + [[1, 0, page]], np.int64)
        native._pages._take_sizes(False)
        for _ in range(2):
            back = [np.zeros(page, np.uint8) for _ in range(5)]
            res = np.zeros((5, 2), np.int64)
            sums, status = np.zeros(5, np.uint64), np.full(5, 9, np.uint8)
            n = NATIVE.copy_pages(sources, rows, back, res, page, page, None, sums, status)
            assert n == 2 * page
            assert res.tolist() == [[page, 0], [0, -1], [0, -1], [0, -1], [page, 0]]
            assert status.tolist() == [0, 2, 2, 2, 0]
            with open(paths[1], "rb") as fh:
                assert back[4].tobytes() == fh.read(page)
    finally:
        native._pages._take_sizes(True)
        for fd, mapping in sources:
            mapping.close()
            os.close(fd)


@needs_native
@pytest.mark.parametrize("faulthandler_on", [False, True], ids=["default", "faulthandler"])
def test_a_bus_error_outside_a_copy_goes_to_the_previous_handler(tmp_path, faulthandler_on):
    """Once copy_pages installed its SIGBUS handler, a fault elsewhere (Python reading a cut
    file's mapping) is not swallowed: the process dies of SIGBUS, through faulthandler where it
    was on before (its report on stderr), else by the default action (under the sanitizers:
    through AddressSanitizer's handler, which reports it and aborts)."""
    import signal
    import subprocess
    import sys

    script = f"""
import faulthandler, mmap, os, numpy as np
if {faulthandler_on}:
    faulthandler.enable()
from gdskv import native
path = {str(tmp_path / "f")!r}
with open(path, "wb") as fh:
    fh.write(bytes(3 * 65536))
fd = os.open(path, os.O_RDONLY)
m = mmap.mmap(fd, 3 * 65536, mmap.MAP_SHARED, mmap.PROT_READ)
res = np.zeros((1, 2), np.int64)
native.NATIVE.copy_pages([(fd, m)], np.array([[0, 0, 4096]], np.int64),
                         [np.zeros(4096, np.uint8)], res, 1, 0, None, None, None)
assert res.tolist() == [[4096, 0]]
os.truncate(path, 4096)
print("copied", flush=True)
m[65536 + 7]
print("not reached", flush=True)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert run.stdout == "copied\n"
    if "libasan" in os.environ.get("LD_PRELOAD", ""):  # (tests/sanitize_native.sh) ASan's own
        assert run.returncode == -signal.SIGABRT and "AddressSanitizer: BUS" in run.stderr
    else:
        assert run.returncode == -signal.SIGBUS
        assert ("Bus error" in run.stderr) == faulthandler_on


@needs_native
def test_runs_longer_than_iov_max(tmp_path):
    """3000 buffers of one run: several preadv/pwritev calls, the same bytes on both paths."""
    rng = np.random.default_rng(3)
    memory = [rng.integers(0, 256, 17, dtype=np.uint8) for _ in range(3000)]
    for engine in (NATIVE, PYTHON):
        fd = _files(tmp_path, 1, 0, engine.path)[0]
        segs = np.array([[fd, 17 * i, 17] for i in range(3000)], np.int64)
        res = np.zeros((3000, 2), np.int64)
        assert engine.write_pages(segs, memory, res) == 51000
        assert os.pread(fd, 51000, 0) == b"".join(m.tobytes() for m in memory)
        os.close(fd)


@needs_native
def test_calls_release_the_gil(tmp_path):
    """While one thread is inside a call, another runs Python: checksums of 1 GiB (one 64 MiB
    buffer 16 times), then a read of 64 MiB 8 times, then 8 checked copies of it from its
    mapping."""
    buf = np.ones(64 << 20, np.uint8)
    path = str(tmp_path / "big")
    with open(path, "wb") as fh:
        fh.write(buf.tobytes())
    fd = os.open(path, os.O_RDONLY)
    sums = np.zeros(16, np.uint64)
    res = np.zeros((8, 2), np.int64)
    segs = np.array([[fd, 0, 64 << 20]] * 8, np.int64)
    mapping = mmap.mmap(fd, 64 << 20, mmap.MAP_SHARED, mmap.PROT_READ)
    rows = np.array([[0, 0, 64 << 20]] * 8, np.int64)
    calls = [lambda: NATIVE.page_sums([buf] * 16, 64 << 20, 64 << 20, sums),
             lambda: NATIVE.read_pages(segs, [buf] * 8, res, 1, 0, None, None, None, 0),
             lambda: NATIVE.copy_pages([(fd, mapping)], rows, [buf] * 8, res, 64 << 20,
                                       64 << 20, None, sums, np.zeros(8, np.uint8))]
    try:
        for call in calls:
            for _attempt in range(3):  # a loaded machine may not run the other thread at once
                span, ticks = [], []
                worker = threading.Thread(target=lambda: (span.append(time.perf_counter()),
                                                          call(),
                                                          span.append(time.perf_counter())))
                worker.start()
                while worker.is_alive():
                    ticks.append(time.perf_counter())
                worker.join()
                if sum(span[0] < t < span[1] for t in ticks) > 100:
                    break
            else:
                pytest.fail(f"no Python ran while {call} ran: the GIL was held")
    finally:
        mapping.close()
        os.close(fd)


@needs_native
def test_small_calls_keep_the_gil(tmp_path):
    """Below ``hold_gil_below`` bytes, checksums and copies from a mapping keep the GIL (a
    thread switch each way costs more than such a call); reads, which may wait on a disk,
    release it at any size. Shown with the bound raised over a 64 MiB call: no Python runs
    in another thread while the call runs."""
    buf = np.ones(64 << 20, np.uint8)
    path = str(tmp_path / "big")
    with open(path, "wb") as fh:
        fh.write(buf.tobytes())
    fd = os.open(path, os.O_RDONLY)
    mapping = mmap.mmap(fd, 64 << 20, mmap.MAP_SHARED, mmap.PROT_READ)
    sums, res = np.zeros(4, np.uint64), np.zeros((4, 2), np.int64)
    calls = {"page_sums": lambda: NATIVE.page_sums([buf] * 4, 64 << 20, 64 << 20, sums),
             "copy_pages": lambda: NATIVE.copy_pages(
                 [(fd, mapping)], np.array([[0, 0, 64 << 20]] * 4, np.int64), [buf] * 4, res,
                 64 << 20, 64 << 20, None, sums, np.zeros(4, np.uint8))}
    default = NATIVE_MODULE.hold_gil_below()
    assert default == 1 << 20
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.5)  # (the worker is not made to hand the GIL over mid-test)
    try:
        assert NATIVE_MODULE.hold_gil_below(1 << 40) == default
        for name, call in calls.items():
            span, ticks = [], []
            worker = threading.Thread(target=lambda: (span.append(time.perf_counter()),
                                                      call(), span.append(time.perf_counter())))
            worker.start()
            while worker.is_alive():
                ticks.append(time.perf_counter())
            worker.join()
            assert sum(span[0] < t < span[1] for t in ticks) <= 1, name
    finally:
        sys.setswitchinterval(interval)
        NATIVE_MODULE.hold_gil_below(default)
        mapping.close()
        os.close(fd)
    assert NATIVE_MODULE.hold_gil_below() == default


@pytest.mark.parametrize("engine", [NATIVE, PYTHON], ids=["native", "python"])
@pytest.mark.parametrize("in_memory", [False, True], ids=["disk", "in-memory"])
def test_append_file_appends_all_and_raises_errors(tmp_path, engine, in_memory):
    """append_file writes all of its data at the end (a journal's append), syncs, takes empty
    data (a sync alone), and raises the system's error as OSError, on both paths."""
    path = str(tmp_path / "j")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, b"head")
        data = bytes(range(256)) * 4097  # (over a megabyte: the GIL is given up there)
        assert engine.append_file(fd, data, True, in_memory) is None
        assert engine.append_file(fd, b"", True, in_memory) is None
        assert engine.append_file(fd, memoryview(b"tail"), False, in_memory) is None
        with open(path, "rb") as fh:
            assert fh.read() == b"head" + data + b"tail"
    finally:
        os.close(fd)
    ro = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as err:
            engine.append_file(ro, b"x", False, in_memory)
        assert err.value.errno == errno.EBADF
    finally:
        os.close(ro)
    with pytest.raises(OSError) as err:
        engine.append_file(ro, b"", True, in_memory)  # (closed now: the sync fails)
    assert err.value.errno == errno.EBADF


@pytest.mark.parametrize("engine", [NATIVE, PYTHON], ids=["native", "python"])
@pytest.mark.parametrize("in_memory", [False, True], ids=["disk", "in-memory"])
def test_unlinked_names_files_removed_while_open(tmp_path, engine, in_memory):
    """unlinked: descriptors whose file was removed (or that are not open), then paths that no
    longer name the inode they had (removed, or another file put there), by index."""
    paths = [str(tmp_path / n) for n in ("a", "b", "c")]
    fds = [os.open(p, os.O_RDWR | os.O_CREAT, 0o600) for p in paths]
    inodes = [os.fstat(fd).st_ino for fd in fds]
    try:
        assert engine.unlinked(fds, paths, inodes, in_memory) == []
        os.unlink(paths[1])
        os.replace(paths[0], str(tmp_path / "moved"))  # (still linked, elsewhere)
        with open(paths[0], "wb"):
            pass  # another file at a's path
        assert engine.unlinked(fds, paths, inodes, in_memory) == [1, 3, 4]
        assert engine.unlinked([fds[2], 1 << 40, -1], [], [], in_memory) == [1, 2]
        assert engine.unlinked([], [paths[2]], [inodes[2]], in_memory) == []
        with pytest.raises(ValueError):
            engine.unlinked([], paths, inodes[:1], in_memory)
    finally:
        for fd in fds:
            os.close(fd)


@needs_native
@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=600))
def test_the_key_digest_is_hashlibs_blake2b(data):
    """trailer.c's BLAKE2b-128 (RFC 7693, unkeyed) equals hashlib's, across block ends."""
    import hashlib
    assert NATIVE_MODULE.blake2b_128(data) == hashlib.blake2b(data, digest_size=16).digest()
    block = bytes(range(256)) * 3
    for n in (0, 1, 127, 128, 129, 255, 256, 257, 384, 768):
        assert NATIVE_MODULE.blake2b_128(block[:n]) == \
            hashlib.blake2b(block[:n], digest_size=16).digest(), n


KEYS = st.one_of(st.text(max_size=300), st.binary(max_size=300),
                 st.sampled_from(["k" * 256, "k" * 257, "é" * 128, "é" * 129]))


@needs_native
@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(KEYS, st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1),
                          st.integers(0, 2**64 - 1)), max_size=6),
       st.sampled_from([320, 321, 4096 - 320]), st.integers(0, 2**64 - 1),
       st.integers(0, 0xFFFF), st.integers(0, 255))
def test_sealed_slots_equal_the_oracle(pages, tail, store_id, version, algorithm):
    """seal_slots writes the bytes gdskv.slot_trailer.encode makes (the Python path's
    seal_slots), zeroing the rest of each row, and decode reads them back."""
    from gdskv import slot_trailer
    keys = [k for k, *_ in pages]
    slots, seqs = [p[1] for p in pages], [p[2] for p in pages]
    sums = np.array([p[3] for p in pages], np.uint64)
    rows = [np.full((len(pages), tail), 0xAB, np.uint8) for _ in range(2)]
    NATIVE.seal_slots(rows[0], version, algorithm, store_id, keys, slots, seqs, sums)
    PYTHON.seal_slots(rows[1], version, algorithm, store_id, keys, slots, seqs, sums)
    assert np.array_equal(rows[0], rows[1])
    for i, (key, slot, seq, csum) in enumerate(pages):
        assert not rows[0][i, :tail - slot_trailer.TRAILER_BYTES].any()
        t = slot_trailer.decode(rows[0][i, tail - slot_trailer.TRAILER_BYTES:].tobytes())
        whole = len(key.encode() if isinstance(key, str) else key) <= slot_trailer.KEY_BYTES
        assert t == slot_trailer.Trailer(slot, key if whole else None, seq, csum, algorithm,
                                         store_id, version)


@needs_native
@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(KEYS, st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1),
                          st.integers(0, 2**64 - 1)), max_size=6),
       st.sampled_from([1, 2]), st.integers(0, 255), st.booleans())
def test_journal_records_equal_the_oracle_and_replay(pages, kind, algorithm, no_sums):
    """encode_records writes the bytes gdskv.journal.encode_records makes (the Python path's),
    and replay's decoder reads the records back."""
    from gdskv import journal
    keys = [k for k, *_ in pages]
    slots, seqs = [p[1] for p in pages], [p[2] for p in pages]
    sums = None if no_sums else [p[3] for p in pages]
    data = NATIVE.encode_records(kind, keys, slots, sums, algorithm, seqs)
    assert data == PYTHON.encode_records(kind, keys, slots, sums, algorithm, seqs)
    decoded = journal.decode_all(data)
    assert decoded.valid == len(data) and not decoded.skipped
    assert decoded.records == [
        journal.Record(journal.RecordKind(kind), seq, slot, 0 if no_sums else csum, algorithm,
                       key) for key, slot, seq, csum in pages]


@needs_native
def test_journal_records_take_numpy_integers_as_the_oracle_does():
    """Slots, seqs and checksums from numpy arrays (a directory's slot numbers are numpy
    integers) encode as the Python path's struct does: a record that failed here would leave
    an eviction unjournaled."""
    keys = ["a", b"b", "c"]
    slots, seqs = np.array([3, 1, 2], np.int64), np.arange(7, 10, dtype=np.uint64)
    sums = [np.uint64(2**64 - 1), np.int32(5), 0]
    for kind, csums in ((1, sums), (2, None)):
        assert NATIVE.encode_records(kind, keys, list(slots), csums, 3, list(seqs)) == \
            PYTHON.encode_records(kind, keys, list(slots), csums, 3, list(seqs)) == \
            NATIVE.encode_records(kind, keys, slots.tolist(), csums and [int(c) for c in csums],
                                  3, seqs.tolist())


@pytest.mark.parametrize("engine", [NATIVE, PYTHON], ids=["native", "python"])
def test_encode_records_refuses_bad_arguments(engine):
    from gdskv.journal import MAX_KEY_BYTES
    with pytest.raises(ValueError):
        engine.encode_records(1, ["a", "b"], [0], [1, 2], 1, [1, 2])  # 2 keys, 1 slot
    with pytest.raises(ValueError):
        engine.encode_records(1, ["a"], [0], [1], 1, [])
    with pytest.raises(TypeError):
        engine.encode_records(1, ["a", 7], [0, 1], [1, 2], 1, [1, 2])  # not str or bytes
    with pytest.raises(UnicodeEncodeError):
        engine.encode_records(1, ["a", "\ud800"], [0, 1], [1, 2], 1, [1, 2])
    with pytest.raises(ValueError):
        engine.encode_records(1, [b"k" * (MAX_KEY_BYTES + 1)], [0], [1], 1, [1])
    assert len(engine.encode_records(1, [b"k" * MAX_KEY_BYTES], [0], [1], 1, [1])) == \
        8 + 27 + MAX_KEY_BYTES
    assert engine.encode_records(2, [], [], None, 0, range(5, 5)) == b""


@pytest.mark.parametrize("engine", [NATIVE, PYTHON], ids=["native", "python"])
def test_seal_slots_refuses_bad_arguments(engine):
    rows = np.zeros((2, 320), np.uint8)
    sums = np.zeros(2, np.uint64)
    with pytest.raises(ValueError):
        engine.seal_slots(rows, 1, 3, 0, ["a"], [0, 1], [1, 2], sums)  # 1 key, 2 rows
    with pytest.raises(ValueError):
        engine.seal_slots(np.zeros((2, 319), np.uint8), 1, 3, 0, ["a", "b"], [0, 1], [1, 2],
                          sums)  # rows too short for a trailer
    with pytest.raises(ValueError):
        engine.seal_slots(rows, 1, 3, 0, ["a", "b"], [0, 1], [1, 2], sums[:1])
    with pytest.raises((TypeError, ValueError)):
        engine.seal_slots(rows, 1, 3, 0, ["a", 7], [0, 1], [1, 2], sums)  # not str or bytes
    with pytest.raises(UnicodeEncodeError):
        engine.seal_slots(rows, 1, 3, 0, ["a", "\ud800"], [0, 1], [1, 2], sums)
    engine.seal_slots(np.zeros((0, 320), np.uint8), 1, 3, 0, [], [], [], sums[:0])


@needs_native
def test_calls_on_files_in_memory_keep_the_gil(tmp_path):
    """append_file and unlinked on files held in memory keep the GIL (each brief give-up woke
    a thread waiting for it in vain); on other files they give it up. Shown with the bound
    raised over a 64 MiB append: no Python runs in another thread while it runs."""
    path = str(tmp_path / "j")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    data = np.ones(64 << 20, np.uint8)
    default = NATIVE_MODULE.hold_gil_below()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.5)
    try:
        NATIVE_MODULE.hold_gil_below(1 << 40)
        for in_memory in (True, False):
            for _attempt in range(3):  # (given up: a loaded machine may not run the thread)
                span, ticks = [], []
                worker = threading.Thread(target=lambda: (
                    span.append(time.perf_counter()),
                    NATIVE.append_file(fd, data, False, in_memory),
                    span.append(time.perf_counter())))
                worker.start()
                while worker.is_alive():
                    ticks.append(time.perf_counter())
                worker.join()
                ran = sum(span[0] < t < span[1] for t in ticks)
                if in_memory or ran > 100:
                    break
            assert (ran <= 1) if in_memory else (ran > 100), (in_memory, ran)
            os.ftruncate(fd, 0)
    finally:
        sys.setswitchinterval(interval)
        NATIVE_MODULE.hold_gil_below(default)
        os.close(fd)


# -- tiers on both paths ------------------------------------------------------------------------
LAYOUT = KVLayout(num_layers=2, page_size=4, head_dim=40, kv_heads=2)   # 1280 B pages


def _tier(path, native_on: bool, **overrides) -> Tier:
    d = path
    d.mkdir(exist_ok=True)
    cfg = TierConfig(directories=(str(d),), capacity="1MiB", staging_size=f"{8 * 4096}",
                     io_chunk_size="16KiB", io_threads=3, backend="posix", files_per_dir=2,
                     native=native_on, **overrides)
    return Tier(LAYOUT, cfg, device="cpu")


def _host_regions(pool_bytes: torch.Tensor, page: int, aligned: bool) -> list[torch.Tensor]:
    """A page's payload in a fresh host region (4 KiB aligned or one byte past it)."""
    raw = alloc_host(LAYOUT.page_bytes + 4096, pin=False)
    r = raw[(0 if aligned else 1):][:LAYOUT.page_bytes]
    r.copy_(pool_bytes[page * LAYOUT.page_bytes:(page + 1) * LAYOUT.page_bytes])
    return [r]


def _same_calls(tier: Tier, pool, data: torch.Tensor) -> None:
    slots = torch.arange(40 * LAYOUT.page_size)
    assert all(tier.put([f"p{i}" for i in range(20)], pool, slots[:20 * LAYOUT.page_size]))
    assert all(tier.put(["p3", "q0"], pool, slots[20 * LAYOUT.page_size:22 * LAYOUT.page_size]))
    assert all(tier.put_pages([f"a{i}" for i in range(9)],
                              [_host_regions(data, i, True) for i in range(9)]))
    assert all(tier.put_pages([f"u{i}" for i in range(5)],
                              [_host_regions(data, i, False) for i in range(5)]))
    tier.evict(["p5", "a2"])
    assert all(tier.put(["r0"], pool, slots[30 * LAYOUT.page_size:31 * LAYOUT.page_size]))


def test_both_paths_write_identical_slabs_and_read_each_others(tmp_path, monkeypatch,
                                                              both_paths):
    """The same calls on a native and a Python tier, each with the same store id: the slab
    files (payloads, padding and slot trailers) are equal byte for byte. Each path then reads
    the other's store, and a flipped bit is a miss on both."""
    pool = random_pool(LAYOUT, 64 * LAYOUT.page_size, seed=5)
    data = torch.randint(0, 256, (40 * LAYOUT.page_bytes,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(6))
    monkeypatch.setattr(os, "urandom", lambda n: bytes(range(n)))  # the store id
    paths = {"native": tmp_path / "native", "python": tmp_path / "python"}
    for name, path in paths.items():
        with _tier(path, name == "native") as tier:
            assert tier.stats()["page_engine"] == (name if NATIVE is not None else "python")
            _same_calls(tier, pool, data)
    monkeypatch.undo()
    slabs = sorted(f for f in os.listdir(paths["native"]) if f.startswith("slab"))
    assert slabs
    for f in slabs:
        with open(paths["native"] / f, "rb") as a, open(paths["python"] / f, "rb") as b:
            assert a.read() == b.read(), f
    keys = [f"p{i}" for i in range(20) if i != 5] + ["q0", "r0"]
    for reader, store in (("native", "python"), ("python", "native")):
        with _tier(paths[store], reader == "native") as tier:
            assert checksum.CRC32C in set(tier.directory.algorithms(
                [tier.directory._index[k] for k in keys]).tolist())
            out = empty_like_pool(pool)
            slots = torch.arange(len(keys) * LAYOUT.page_size)
            assert all(tier.get(keys, out, slots))
            regions = [[torch.zeros(LAYOUT.page_bytes, dtype=torch.uint8)] for _ in range(8)]
            assert all(tier.get_pages([f"a{i}" for i in range(9) if i != 2], regions))
            assert all(torch.equal(r[0], data[i * LAYOUT.page_bytes:(i + 1) * LAYOUT.page_bytes])
                       for r, i in zip(regions, [0, 1, 3, 4, 5, 6, 7, 8]))
    with _tier(paths["python"], True) as tier:
        f, off = tier.store.location(tier.directory._index["a4"])
        path = tier.store.files[f].path
    with open(path, "r+b") as fh:  # a flipped payload bit: a miss on both paths
        fh.seek(off + 100)
        byte = fh.read(1)[0]
        fh.seek(off + 100)
        fh.write(bytes([byte ^ 4]))
    for native_on in (True, False):
        with _tier(paths["python"], native_on) as tier:
            pages = [[torch.zeros(LAYOUT.page_bytes, dtype=torch.uint8)] for _ in range(2)]
            assert tier.get_pages(["a3", "a4"], pages) == [True, False]


def test_stats_name_the_path_that_runs(tmp_path, data_path):
    with _tier(tmp_path / "s", True) as tier:
        s = tier.stats()
        assert s["page_engine"] == s["page_engine_detail"]["path"] == data_path
        assert s["backend_detail"]["engine"] == data_path
    with _tier(tmp_path / "t", False) as tier:
        assert tier.stats()["page_engine"] == "python"
        assert "native=false" in tier.stats()["page_engine_detail"]["reason"] or \
            data_path == "python"


def test_byte_pages_layout_on_both_paths(tmp_path, both_paths):
    layout = BytePageLayout(page_bytes=5000, kind="test/native")
    data = [torch.randint(0, 256, (5000,), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(i)) for i in range(6)]
    for on in (True, False):
        d = tmp_path / f"b{on}"
        d.mkdir()
        cfg = TierConfig(directories=(str(d),), capacity="1MiB", staging_size="64KiB",
                         backend="posix", native=on)
        with Tier(layout, cfg, device="cpu") as tier:
            assert all(tier.put_pages([f"k{i}" for i in range(6)], [[x] for x in data]))
            out = [[torch.zeros(5000, dtype=torch.uint8)] for _ in data]
            assert all(tier.get_pages([f"k{i}" for i in range(6)], out))
            assert all(torch.equal(x, o[0]) for x, o in zip(data, out))


@pytest.mark.parametrize("page_bytes", [5000, 3 * 65536 + 100], ids=["pages-per-piece",
                                                                     "page-over-chunk"])
def test_in_place_reads_checksum_in_the_call_that_reads(tmp_path, page_bytes):
    """get_pages on posix: each piece (whole slots, even a slot larger than io_chunk_size) is
    one read_pages call that checksums its pages; no page is checksummed in a pass of its own."""
    import dataclasses

    layout = BytePageLayout(page_bytes=page_bytes, kind="test/native")
    cfg = TierConfig(directories=(str(tmp_path),), capacity="16MiB", staging_size="4MiB",
                     io_chunk_size="64KiB", io_threads=3, backend="posix")
    data = [torch.randint(0, 256, (page_bytes,), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(i)) for i in range(12)]
    keys = [f"k{i}" for i in range(12)]
    with Tier(layout, cfg, device="cpu") as tier:
        assert all(tier.put_pages(keys, [[alloc_host(page_bytes, pin=False).copy_(d)]
                                         for d in data]))
        reads, sums = [], []
        engine = tier.backend._engine
        tier.backend._engine = dataclasses.replace(  # (copy_pages: a store on tmpfs)
            engine, read_pages=lambda *a: reads.append(a[4]) or engine.read_pages(*a),
            copy_pages=lambda *a: reads.append(a[5]) or engine.copy_pages(*a))
        tier._host_pages.engine = dataclasses.replace(
            engine, page_sums=lambda *a: sums.append(a) or engine.page_sums(*a))
        out = [[alloc_host(page_bytes, pin=False)] for _ in data]
        assert all(tier.get_pages(keys, out))
        assert all(torch.equal(d, o[0]) for d, o in zip(data, out))
        assert reads and set(reads) == {page_bytes} and not sums


# -- a store held in memory, read from its files' mappings --------------------------------------
SHM = "/dev/shm"
on_tmpfs = pytest.mark.skipif(
    not os.path.isdir(SHM) or store_mod.file_system_type(SHM) not in store_mod.MEMORY_FILE_SYSTEMS,
    reason="/dev/shm is not a file system held in memory here")


@on_tmpfs
@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "map_memory_files=false"])
def test_a_store_in_memory_is_read_from_its_mappings(tmp_path_factory, mapped, data_path):
    """A posix store on /dev/shm maps its slab files and reads by copy_pages (said in
    stats), bit-exact, staged and in place, 1 page and many; a damaged page is a miss. A slab
    file cut shorter under the running tier: the pages past its end are misses, never read
    from the mapping (which would fault), and the rest still hit. With map_memory_files=false
    the same calls go through preadv."""
    import dataclasses

    d = tempfile.mkdtemp(dir=SHM, prefix="gdskv-test-mapped-")
    try:
        layout = BytePageLayout(page_bytes=20000, kind="test/mapped")
        cfg = TierConfig(directories=(d,), capacity="4MiB", staging_size="256KiB",
                         io_chunk_size="64KiB", io_threads=3, backend="posix", files_per_dir=2,
                         map_memory_files=mapped)
        data = [torch.randint(0, 256, (20000,), dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(i)) for i in range(40)]
        keys = [f"m{i}" for i in range(40)]
        with Tier(layout, cfg, device="cpu") as tier:
            state = tier.stats()["backend_detail"]["memory_files"]
            assert state["state"].startswith("mapped" if mapped else "off: map_memory_files")
            assert state["files_mapped"] == (2 if mapped else 0)
            assert all(tier.put_pages(keys, [[alloc_host(20000, pin=False).copy_(x)]
                                             for x in data]))
            calls = {"copy": 0, "read": 0}
            engine = tier.backend._engine
            tier.backend._engine = dataclasses.replace(
                engine,
                copy_pages=lambda *a: calls.__setitem__("copy", calls["copy"] + 1)
                or engine.copy_pages(*a),
                read_pages=lambda *a: calls.__setitem__("read", calls["read"] + 1)
                or engine.read_pages(*a))
            for batch in (keys[:1], keys[1:3], keys):
                out = [[alloc_host(20000, pin=False)] for _ in batch]
                assert all(tier.get_pages(batch, out))
                assert all(torch.equal(data[int(k[1:])], o[0]) for k, o in zip(batch, out))
            assert (calls["copy"] > 0) == mapped and (calls["read"] > 0) != mapped
            # a damaged payload byte: that page is a miss, the others hit
            f, off = tier.store.location(tier.directory._index["m5"])
            fd = os.open(tier.store.files[f].path, os.O_RDWR)
            os.pwrite(fd, bytes([os.pread(fd, 1, off + 7)[0] ^ 1]), off + 7)
            out = [[alloc_host(20000, pin=False)] for _ in keys]
            hits = tier.get_pages(keys, out)
            assert [k for k, h in zip(keys, hits) if not h] == ["m5"]
            # file 0 cut after its third slot, under the running tier
            path0 = tier.store.files[0].path
            os.truncate(path0, 3 * layout.slot_bytes)
            os.close(fd)
            rest = [k for k in keys if k != "m5"]
            where = {k: tier.store.location(tier.directory._index[k]) for k in rest}
            cut = {k for k, (f, off) in where.items()
                   if f == 0 and off + layout.slot_bytes > 3 * layout.slot_bytes}
            assert cut
            out = [[alloc_host(20000, pin=False)] for _ in rest]
            hits = tier.get_pages(rest, out)
            assert {k for k, h in zip(rest, hits) if not h} == cut
            assert all(torch.equal(data[int(k[1:])], o[0])
                       for k, o, h in zip(rest, out, hits) if h)
    finally:
        shutil.rmtree(d, ignore_errors=True)


@on_tmpfs
def test_quick_restores_across_files_copy_from_each_files_mapping(tmp_path_factory, data_path):
    """Quick restores (one engine call on the calling thread) of pages on three slab files,
    in an order that alternates between them: each row names its file's mapping; bit-exact,
    and a damaged page among them is a miss while the others hit."""
    d = tempfile.mkdtemp(dir=SHM, prefix="gdskv-test-mapped-")
    try:
        layout = BytePageLayout(page_bytes=16384, kind="test/mapped")
        cfg = TierConfig(directories=(d,), capacity="4MiB", staging_size="1MiB",
                         io_chunk_size="64KiB", backend="posix", files_per_dir=3)
        data = {f"q{i}": torch.randint(0, 256, (16384,), dtype=torch.uint8,
                                       generator=torch.Generator().manual_seed(i))
                for i in range(60)}
        with Tier(layout, cfg, device="cpu") as tier:
            assert tier.stats()["backend_detail"]["memory_files"]["files_mapped"] == 3
            assert all(tier.put_pages(list(data), [[alloc_host(16384, pin=False).copy_(x)]
                                                   for x in data.values()]))
            by_file: dict[int, list[str]] = {}
            for k in data:
                by_file.setdefault(tier.store.location(tier.directory._index[k])[0], []).append(k)
            assert len(by_file) == 3
            keys = [k for group in zip(*by_file.values()) for k in group][:9]  # f0 f1 f2 f0...
            before = tier.stats().get("quick_restores", 0)
            out = [[alloc_host(16384, pin=False)] for _ in keys]
            assert all(tier.get_pages(keys, out))
            assert tier.stats().get("quick_restores", 0) == before + 1
            assert all(torch.equal(data[k], o[0]) for k, o in zip(keys, out))
            f, off = tier.store.location(tier.directory._index[keys[4]])
            fd = os.open(tier.store.files[f].path, os.O_RDWR)
            os.pwrite(fd, bytes([os.pread(fd, 1, off + 99)[0] ^ 0x10]), off + 99)
            os.close(fd)
            out = [[alloc_host(16384, pin=False)] for _ in keys]
            hits = tier.get_pages(keys, out)
            assert [k for k, h in zip(keys, hits) if not h] == [keys[4]]
            assert all(torch.equal(data[k], o[0]) for k, o, h in zip(keys, out, hits) if h)
    finally:
        shutil.rmtree(d, ignore_errors=True)


@on_tmpfs
def test_files_a_tier_does_not_own_whole_are_not_mapped(tmp_path_factory):
    """Not mapped, and stats say why: files not preallocated (a read of a hole through a
    mapping would allocate it, and fault on a full tmpfs) and a read-only follower's (the
    files are another process's); both still read by preadv, bit-exact."""
    d = tempfile.mkdtemp(dir=SHM, prefix="gdskv-test-mapped-")
    try:
        layout = BytePageLayout(page_bytes=20000, kind="test/mapped")
        base = dict(directories=(d,), capacity="1MiB", backend="posix", files_per_dir=2)
        page = torch.randint(0, 256, (20000,), dtype=torch.uint8)
        with Tier(layout, TierConfig(**base, preallocate=False), device="cpu") as tier:
            state = tier.stats()["backend_detail"]["memory_files"]
            assert state["files_mapped"] == 0 and "not preallocated" in state["state"]
            assert all(tier.put_pages(["a"], [[alloc_host(20000, pin=False).copy_(page)]]))
            with Tier(layout, TierConfig(**base, read_only=True), device="cpu") as follower:
                state = follower.stats()["backend_detail"]["memory_files"]
                assert state["files_mapped"] == 0 and state["state"] == (
                    "off: a read-only follower (the slab files are another process's)")
                out = [[alloc_host(20000, pin=False)]]
                assert follower.get_pages(["a"], out) == [True]
                assert torch.equal(out[0][0], page)
    finally:
        shutil.rmtree(d, ignore_errors=True)
