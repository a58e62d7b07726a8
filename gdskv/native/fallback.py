"""The page engine in Python: what ``_pages.c`` does, with the same signatures and results.

The path that runs where the extension is missing or switched off (``native=false``), and the
oracle the native engine is tested against. I/O is ``os.preadv``/``os.pwritev`` (which release
the GIL during the system call), checksums are the ``crc32c`` package's. See
:mod:`gdskv.native` for the arguments.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

import crc32c as _crc32c
import numpy as np

PATH = "python"
#: most buffers one pwritev/preadv takes (Linux: 1024)
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


def crc32c(data, value: int = 0) -> int:
    return _crc32c.crc32c(data, value)


def implementation() -> str:
    return "crc32c package"


def _bytes(memory: Sequence | np.ndarray) -> list[memoryview]:
    if isinstance(memory, np.ndarray):  # (address, length) rows: the memory itself
        rows = memory.reshape(-1)
        if memory.dtype != np.int64 or len(rows) % 2:
            raise ValueError(f"memory: expected int64 (address, length) rows, got "
                             f"{memory.nbytes} bytes of items of {memory.itemsize} bytes")
        views = []
        for i, (address, length) in enumerate(rows.reshape(-1, 2).tolist()):
            if length < 0 or (address == 0 and length > 0):
                raise ValueError(f"memory row {i}: ({address}, {length}) is no memory")
            views.append(memoryview((ctypes.c_ubyte * length).from_address(address)).cast("B")
                         if length else memoryview(bytearray()))
        return views
    return [memoryview(b).cast("B") for b in memory]


def _frame_crc(views: list[memoryview], starts: list[int], at: int, n: int) -> int:
    crc, k = 0, 0
    while n > 0:
        while starts[k] + len(views[k]) <= at:
            k += 1
        off = at - starts[k]
        take = min(len(views[k]) - off, n)
        crc = _crc32c.crc32c(views[k][off:off + take], crc)
        at, n = at + take, n - take
    return crc


def _starts(views: list[memoryview]) -> list[int]:
    return np.concatenate(([0], np.cumsum([len(v) for v in views]))).tolist()


def _pages(total: int, slot_bytes: int, page_bytes: int) -> int:
    if slot_bytes <= 0 or not 0 <= page_bytes <= slot_bytes:
        raise ValueError(f"slot_bytes must be > 0 and page_bytes in 0..slot_bytes, got "
                         f"{slot_bytes} and {page_bytes}")
    if total % slot_bytes:
        raise ValueError(f"the buffers hold {total} bytes, not a whole number of "
                         f"{slot_bytes}-byte slots")
    return total // slot_bytes


def page_sums(memory: Sequence, slot_bytes: int, page_bytes: int, sums: np.ndarray) -> None:
    views = _bytes(memory)
    starts = _starts(views)
    for k in range(_pages(starts[-1], slot_bytes, page_bytes)):
        sums[k] = _frame_crc(views, starts, k * slot_bytes, page_bytes)


def _move(call, segments: np.ndarray, views: list[memoryview], result: np.ndarray,
          readahead: int) -> int:
    segs = np.asarray(segments).reshape(-1, 3).tolist()
    if len(segs) != len(views):
        raise ValueError(f"memory: {len(views)} buffers for {len(segs)} segments")
    for k, ((fd, offset, length), v) in enumerate(zip(segs, views)):
        if fd < 0 or offset < 0 or length != len(v):
            raise ValueError(f"segment {k}: (fd {fd}, offset {offset}, length {length}) for a "
                             f"buffer of {len(v)} bytes")
    result[:] = 0
    moved, first = 0, 0
    for k in range(1, len(segs) + 1):
        if k < len(segs) and segs[k][0] == segs[k - 1][0] and \
                segs[k][1] == segs[k - 1][1] + segs[k - 1][2]:
            continue
        moved += _move_run(call, segs, views, result, first, k, readahead)
        first = k
    return moved


def _move_run(call, segs: list, views: list[memoryview], result: np.ndarray, first: int,
              end: int, readahead: int) -> int:
    fd, offset = segs[first][0], segs[first][1]
    if call is os.preadv and readahead > 0:
        total = segs[end - 1][1] + segs[end - 1][2] - offset
        if total > readahead:
            try:  # only a hint
                os.posix_fadvise(fd, offset, total, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
    todo = [(k, views[k]) for k in range(first, end) if len(views[k])]
    moved = 0
    while todo:
        try:
            n = call(fd, [v for _, v in todo[:IOV_MAX]], offset)
        except InterruptedError:
            continue
        except OSError as exc:
            n, error = 0, exc.errno
        else:
            error = -1
        if n <= 0:
            result[[k for k, _ in todo], 1] = error
            break
        offset += n
        moved += n
        while n:
            k, v = todo[0]
            take = min(len(v), n)
            result[k, 0] += take
            n -= take
            if take == len(v):
                todo.pop(0)
            else:
                todo[0] = (k, v[take:])
    return moved


def read_pages(segments: np.ndarray, memory: Sequence, result: np.ndarray, slot_bytes: int,
               page_bytes: int, want: np.ndarray | None, sums: np.ndarray | None,
               status: np.ndarray | None, readahead: int) -> int:
    views = _bytes(memory)
    pages = _pages(sum(len(v) for v in views), slot_bytes, page_bytes) if page_bytes > 0 else 0
    result = result.reshape(-1, 2)
    moved = _move(os.preadv, segments, views, result, readahead)
    _check_pages(views, result, pages, slot_bytes, page_bytes, want, sums, status)
    return moved


def copy_pages(sources: Sequence, segments: np.ndarray, memory: Sequence, result: np.ndarray,
               slot_bytes: int, page_bytes: int, want: np.ndarray | None,
               sums: np.ndarray | None, status: np.ndarray | None) -> int:
    views = _bytes(memory)
    maps = []
    for i, pair in enumerate(sources):  # (the extension's checks and messages)
        fd, m = pair if len(pair) == 2 else (-1, None)
        if not isinstance(fd, int) or not 0 <= fd <= 0x7FFFFFFF or m is None:
            raise ValueError(f"sources[{i}]: expected (fd, mapping)")
        maps.append((fd, memoryview(m).cast("B")))
    pages = _pages(sum(len(v) for v in views), slot_bytes, page_bytes) if page_bytes > 0 else 0
    segs = np.asarray(segments).reshape(-1, 3).tolist()
    if len(segs) != len(views):
        raise ValueError(f"memory: {len(views)} buffers for {len(segs)} segments")
    for k, ((source, offset, length), v) in enumerate(zip(segs, views)):
        if not 0 <= source < len(maps) or offset < 0 or length != len(v):
            raise ValueError(f"segment {k}: (source {source}, offset {offset}, length {length})"
                             f" for a buffer of {len(v)} bytes and {len(maps)} sources")
    limits = []
    for fd, m in maps:  # bytes past a file's end are not touched: the mapping would fault
        try:
            limits.append(min(os.fstat(fd).st_size, len(m)))
        except OSError as exc:
            limits.append(-exc.errno)
    result = result.reshape(-1, 2)
    moved = 0
    for k, ((source, offset, length), v) in enumerate(zip(segs, views)):
        limit = limits[source]
        n = 0 if limit < 0 else max(0, min(length, limit - offset))
        v[:n] = maps[source][1][offset:offset + n]
        result[k] = (n, 0 if n == length else -limit if limit < 0 else -1)
        moved += n
    _check_pages(views, result, pages, slot_bytes, page_bytes, want, sums, status)
    return moved


def _check_pages(views: list[memoryview], result: np.ndarray, pages: int, slot_bytes: int,
                 page_bytes: int, want: np.ndarray | None, sums: np.ndarray | None,
                 status: np.ndarray | None) -> None:
    """Each page's checksum and status once its bytes moved (see :func:`read_pages`)."""
    if not pages:
        return
    starts = _starts(views)
    gaps = [(starts[k] + int(result[k, 0]), starts[k + 1]) for k in range(len(views))
            if result[k, 0] < len(views[k])]
    for k in range(pages):
        start, end = k * slot_bytes, (k + 1) * slot_bytes
        if any(a < end and b > start for a, b in gaps):
            sums[k], status[k] = 0, 2
            continue
        sums[k] = _frame_crc(views, starts, start, page_bytes)
        status[k] = want is not None and int(sums[k]) != int(want[k])


def write_pages(segments: np.ndarray, memory: Sequence, result: np.ndarray) -> int:
    return _move(os.pwritev, segments, _bytes(memory), result.reshape(-1, 2), 0)


def append_file(fd: int, data: bytes, sync: bool, in_memory: bool = False) -> None:
    """Write all of ``data`` (may be empty: a sync alone) to ``fd`` (O_APPEND), then fdatasync
    it where ``sync`` (os.write and os.fdatasync, which give up the GIL whatever the file
    system)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    if sync:
        os.fdatasync(fd)


def unlinked(fds: Sequence[int], paths: Sequence[str], inodes: Sequence[int],
             in_memory: bool = False) -> list[int]:
    """The indices of the descriptors whose file has no link left (or fails fstat), then (after
    ``len(fds)``) of the paths that no longer name their inode (or fail lstat)."""
    out = []
    for i, fd in enumerate(fds):
        try:
            gone = os.fstat(fd).st_nlink == 0
        except (OSError, OverflowError):
            gone = True
        if gone:
            out.append(i)
    if len(paths) != len(inodes):
        raise ValueError("unlinked: paths and inodes differ in length")
    for j, (path, inode) in enumerate(zip(paths, inodes)):
        try:
            gone = os.stat(path, follow_symlinks=False).st_ino != inode
        except OSError:
            gone = True
        if gone:
            out.append(len(fds) + j)
    return out


def seal_slots(rows, version: int, algorithm: int, store_id: int, keys: Sequence, slots: Sequence,
               seqs: Sequence, sums) -> None:
    """Zero each row of ``rows`` (the slots' bytes after their payloads, one row a key, laid
    end to end) and put page ``i``'s slot trailer at its end (:func:`gdskv.slot_trailer.encode`,
    the format this is the oracle of)."""
    from ..slot_trailer import TRAILER_BYTES, encode
    n = len(keys)
    view = memoryview(rows)
    view = view.cast("B") if view.nbytes else memoryview(b"")
    tail = len(view) // n if n else 0
    if len(slots) != n or len(seqs) != n or len(sums) != n or \
            (n and (len(view) % n or tail < TRAILER_BYTES)):
        raise ValueError(f"seal_slots: {n} keys, {len(slots)} slots, {len(seqs)} seqs, "
                         f"{len(sums)} sums and {len(view)} bytes of rows (at least "
                         f"{TRAILER_BYTES} a key, the same for each)")
    for i in range(n):
        if not isinstance(keys[i], (str, bytes)):
            raise TypeError(f"page keys must be str or bytes, got {type(keys[i])!r}")
        row = view[i * tail:(i + 1) * tail]
        row[:tail - TRAILER_BYTES] = bytes(tail - TRAILER_BYTES)
        row[tail - TRAILER_BYTES:] = encode(version, store_id, int(slots[i]), keys[i],
                                            int(seqs[i]), int(sums[i]), algorithm)


def encode_records(kind: int, keys: Sequence, slots: Sequence, sums: Sequence | None,
                   algorithm: int, seqs: Sequence) -> bytes:
    """Journal records of one ``kind`` from columns (:func:`gdskv.journal.encode_records`,
    the format this is the oracle of)."""
    from ..journal import encode_records as encode
    return encode(kind, keys, slots, sums, algorithm, seqs)
