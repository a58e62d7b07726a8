"""POSIX backend: ``preadv``/``pwritev`` from aligned host memory in a thread pool.

The backend that runs anywhere (CI has no GPU). GPU buffers go through a pinned host mirror.
Each call's extents are cut into pieces (at most ``io_chunk_size``, smaller for small calls) so
all threads keep the drive's queue full; O_DIRECT (when the store got it) needs the 4 KiB-aligned
buffers the tier allocates. An extent carrying its own host memory (the caller's page regions,
moved in place) is one ``pwritev``/``preadv`` of its I/O vector per piece.

A piece is one call of the page engine (:mod:`gdskv.native`): the C extension moves all its
buffers with the GIL released (``native``), or ``os.preadv``/``os.pwritev`` do (``python``,
``native=false`` or no extension). ``describe()`` says which.

Slab files held in memory (tmpfs, ramfs: ``/dev/shm``) are also mapped (``MAP_SHARED``,
read-only; ``map_memory_files``), and reads copy from the mappings (the engine's
``copy_pages``): a file's pages are its storage, so a ``preadv`` is a kernel copy of them, and
a checked read then reads its bytes again for the checksum. From the mapping each byte is
copied and checksummed in one pass, with no system call but one ``fstat`` per file and call
(bytes past a file's end are never touched: a mapping there faults; a file cut during a copy
faults it, and the engine reports the file's end). Only files the tier owns and preallocated
are mapped. Writes stay ``pwritev``; the mapping is the file's page cache, so a copy sees every
write before it.

A read whose extents carry a page-checking hint (``Extent.moved`` with ``slot_bytes`` and
``page_bytes``: the tier's in-place pages) is cut into pieces of whole slots, and the same
engine call checksums each page it read.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
import torch

from .. import native
from ..config import TierConfig
from ..memory import host_numpy
from ..yielding_lock import YieldingLock
from .base import (Backend, CompletedIO, CompletionPoller, Extent, IOOutcome, ShortIOError,
                   SlabFile, combine, io_pieces, split_extents)
from .bounce import HostMirrors
from .memory_files import why_not_file as why_not_mapped

log = logging.getLogger("gdskv.posix")


#: buffered reads larger than this announce their range first (POSIX_FADV_WILLNEED)
READAHEAD_HINT_BYTES = 256 * 1024
#: smallest piece a call is cut into: each piece is a hand-off to a pool thread, and the copy
#: it buys is short (page cache to memory: about 0.1 ms per MiB), so a short call uses fewer
#: threads rather than more hand-offs (bench/RESULTS.md, "Hybrid models")
MIN_PIECE_BYTES = 4 << 20
#: most buffers one pwritev/preadv takes (Linux: 1024; the page engine splits longer vectors)
IOV_MAX = native.fallback.IOV_MAX


class PosixBackend(Backend):
    name = "posix"
    in_place_host_memory = True
    #: slots moved on the caller are one engine call of at most what the pool would move as
    #: one piece anyway
    caller_io_bytes = MIN_PIECE_BYTES

    def __init__(self, config: TierConfig, device: torch.device | str = "cpu") -> None:
        self._threads = config.io_threads
        self._chunk = config.io_chunk_size
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            self._threads, thread_name_prefix="gdskv-posix")
        self._files: list[SlabFile] = []
        # a follower's files are another process's, which may recreate or cut them
        self._map_memory_files = config.map_memory_files and not config.read_only
        self._maps_why = "map_memory_files=false" if not config.map_memory_files else \
            "a read-only follower (the slab files are another process's)"
        #: per slab file, its (fd, read-only mapping) where reads copy from it, else None
        self._maps: list[tuple[int, mmap.mmap] | None] = []
        self._maps_off = "no store attached"
        self._mirrors = HostMirrors()
        #: pieces handed to the pool and not finished: a call is cut for the threads left idle
        self._in_pool = 0
        #: callers in :meth:`run_split` now (each one a thread at work beside the pool's)
        self._splitting = 0
        self._in_pool_lock = YieldingLock()
        self._poller = CompletionPoller(config.io_poll_us)
        self._engine = native.engine(config.native)

    @property
    def gpu_direct(self) -> bool:
        return False

    def attach(self, files: Sequence[SlabFile]) -> None:
        self._files = list(files)
        self._maps = [None] * len(self._files)
        if not self._map_memory_files:
            self._maps_off = self._maps_why
            return
        for i, f in enumerate(self._files):
            why = why_not_mapped(f)
            if why is not None:
                self._maps_off = why
                continue
            try:
                self._maps[i] = (f.fd, mmap.mmap(f.fd, f.size, mmap.MAP_SHARED,
                                                       mmap.PROT_READ))
            except (OSError, ValueError) as exc:  # e.g. a ramfs without mmap: preadv reads it
                self._maps_off = f"mapping {f.path} failed: {exc}"
                log.warning("posix: %s is read by preadv (%s)", f.path, exc)

    def describe(self) -> dict:
        mapped = sum(m is not None for m in self._maps)
        state = ("mapped: reads copy from the files' pages" if mapped == len(self._maps)
                 else f"partly mapped ({mapped} of {len(self._maps)} files): {self._maps_off}"
                 ) if mapped else f"off: {self._maps_off}"
        return {**super().describe(), "threads": self._threads, "io_chunk_size": self._chunk,
                "gpu_buffers": "staged through a pinned host mirror",
                "io_poll_us": self._poller.budget_us, "engine": self._engine.path,
                "memory_files": {"state": state, "files_mapped": mapped,
                                 "files": len(self._maps)}}

    def write(self, buffer: torch.Tensor | None, extents: Sequence[Extent]) -> Future:
        host = None if buffer is None else self._mirrors.to_host(buffer, extents)
        return self._submit("write", host, extents)

    def read(self, buffer: torch.Tensor | None, extents: Sequence[Extent]) -> Future:
        host = None if buffer is None else self._mirrors.host_buffer(buffer)
        after = None if host is buffer else (lambda: self._mirrors.from_host(host, buffer, extents))
        return self._submit("read", host, extents, after)

    def move_on_caller(self, op: str, buffer: torch.Tensor | None,
                       extents: Sequence[Extent]) -> CompletedIO | None:
        """A call of at most one piece's bytes (:data:`MIN_PIECE_BYTES`; the pool would move
        it as one piece, or a few small ones after a hand-off to each) moves on this thread:
        the same ``pwritev``/``preadv`` per piece (the GIL released), through the GPU
        buffer's host mirror. (Several pieces: a few pages of a combined call,
        :mod:`gdskv.call_combiner`, whose extents are not adjacent.)"""
        if self._pool is None:
            return None
        pieces = self._pieces(op, extents)
        if len(pieces) != 1 and sum(p.length for _, p in pieces) > MIN_PIECE_BYTES:
            return None
        outcome = IOOutcome()
        host = None
        try:
            if buffer is not None:
                host = self._mirrors.to_host(buffer, extents) if op == "write" \
                    else self._mirrors.host_buffer(buffer)
        except Exception as exc:  # noqa: BLE001 - every extent failed, as combine() says
            for idx, piece in pieces:
                outcome.fail(idx, exc, piece)
            return CompletedIO(outcome)
        view = None if host is None else host_numpy(host)
        for idx, piece in pieces:
            try:
                iov = piece.memory or (view[piece.buffer_offset:
                                            piece.buffer_offset + piece.length],)
                outcome.nbytes += _move_piece(self._engine, op, self._files[piece.file], iov,
                                              piece, self._mapped(op, piece.file))
            except Exception as exc:  # noqa: BLE001 - recorded against the extent, as a pool I/O
                outcome.fail(idx, exc, piece)
        if op == "read" and host is not None and host is not buffer:
            try:  # what moved reaches the GPU buffer, as after a pool read
                self._mirrors.from_host(host, buffer, extents)
            except Exception as exc:  # noqa: BLE001 - every extent failed, as combine() says
                for idx, piece in pieces:
                    outcome.fail(idx, exc, piece)
        return CompletedIO(outcome)

    def read_checked_on_caller(self, places: Sequence[tuple[int, int]], memory: Sequence,
                               slot_bytes: int, page_bytes: int, want: np.ndarray
                               ) -> np.ndarray:
        """One call of the page engine on this thread (the GIL released, but for a copy of less
        than 1 MiB: ``docs/native.md``, "The GIL"): consecutive slots of a file in one
        ``preadv`` (or one copy from the files' mappings, where they are mapped),
        each page's CRC-32C compared with ``want`` (see
        :meth:`Backend.read_checked_on_caller`)."""
        order = dict.fromkeys(f for f, _ in places)  # the call's files, each once
        sources = [self._maps[f] for f in order]
        mapped = None not in sources
        column = dict(zip(order, range(len(order)))) if mapped else self._fds(order)
        segments, result = self._slot_segments(places, slot_bytes, page_bytes, column)
        sums = np.empty(len(places), dtype=np.uint64)
        status = np.empty(len(places), dtype=np.uint8)
        if mapped:
            self._engine.copy_pages(sources, segments, memory, result, slot_bytes, page_bytes,
                                    want, sums, status)
        else:
            readahead = 0 if self._files[places[0][0]].direct else READAHEAD_HINT_BYTES
            self._engine.read_pages(segments, memory, result, slot_bytes, page_bytes, want,
                                    sums, status, readahead)
        return status

    def make_native_reader(self, directory, stripe_slots: int, slot_bytes: int,
                           page_bytes: int, algorithm: int, release_evicting) -> None:
        """The native engine's ``QuickReader`` over this backend's files: each read copies
        from the files' mappings where every file it reads is mapped (``self._maps``, looked
        up at each read: close() drops them), else reads them with ``preadv``, as
        :meth:`read_checked_on_caller` does."""
        make = self._engine.quick_reader
        if make is None or not self._files:
            return
        direct = any(f.direct for f in self._files)
        self.native_reader = make(
            directory, *directory.slot_arrays(), self,
            np.array([f.fd for f in self._files], dtype=np.int64), stripe_slots, slot_bytes,
            page_bytes, 0 if direct else READAHEAD_HINT_BYTES, algorithm, release_evicting)

    def write_on_caller(self, places: Sequence[tuple[int, int]], memory: Sequence,
                        slot_bytes: int, page_bytes: int) -> bool:
        """One call of the page engine on this thread (the GIL released): consecutive slots of
        a file in one ``pwritev`` (see :meth:`Backend.write_on_caller`)."""
        segments, result = self._slot_segments(places, slot_bytes, page_bytes,
                                               self._fds(f for f, _ in places))
        self._engine.write_pages(segments, memory, result)
        return not np.count_nonzero(result[:, 1])

    def run_split(self, fn, count: int, nbytes: int) -> list:
        """Parts of at least :data:`MIN_PIECE_BYTES` for the pool's idle threads and this one
        (see :meth:`Backend.run_split`): a call alone spreads over every thread, as its pieces
        would; one that finds the pool busy, or other callers splitting (vLLM's jobs, many at
        once, each on a thread of its own), runs on its caller. (Each caller splitting counts
        as a busy thread: 16 vLLM jobs at once, each cut for the pool's idle threads, would
        put twice as many threads as cores to copying.)"""
        if self._pool is None:
            raise RuntimeError("posix backend is closed")
        with self._in_pool_lock:
            idle = max(0, self._threads - self._in_pool - self._splitting)
            parts = max(1, min(count, idle + 1, nbytes // MIN_PIECE_BYTES))
            self._in_pool += parts - 1
            self._splitting += 1
        try:
            return self._run_parts(fn, count, parts)
        finally:
            with self._in_pool_lock:
                self._splitting -= 1

    def _run_parts(self, fn, count: int, parts: int) -> list:
        """:meth:`run_split`'s ``parts`` parts (their pool threads counted in ``_in_pool``)."""
        bounds = [count * i // parts for i in range(parts + 1)]
        futures = []
        try:
            for i in range(1, parts):
                future = self._pool.submit(fn, bounds[i], bounds[i + 1])
                future.add_done_callback(self._piece_done)
                futures.append(future)
        except BaseException:  # (no thread could start): the parts not handed over
            with self._in_pool_lock:
                self._in_pool -= parts - 1 - len(futures)
            wait(futures)  # (their memory is the caller's)
            raise
        out = []
        try:
            out.append(fn(bounds[0], bounds[1]))
        except Exception as exc:  # noqa: BLE001 - reported as the part's result
            out.append(exc)
        for future in futures:  # every part ends before the call returns: it moves its memory
            try:
                out.append(future.result())
            except Exception as exc:  # noqa: BLE001 - as above
                out.append(exc)
        return out

    def _fds(self, files) -> dict[int, int]:
        """Each of these slab files' descriptor, by file index."""
        return {f: self._files[f].fd for f in files}

    def _slot_segments(self, places: Sequence[tuple[int, int]], slot_bytes: int,
                       page_bytes: int, column: dict[int, int]
                       ) -> tuple[np.ndarray, np.ndarray]:
        """The engine's segments for whole slots at ``places`` (each slot's payload, then its
        rest), and the result rows for them; a row's first field is ``column[file]``: the file's
        descriptor, or the index of its mapping among the call's sources."""
        if self._pool is None:
            raise RuntimeError("posix backend is closed")
        rest = slot_bytes - page_bytes
        flat = []  # (one array from a list: a row assigned at a time costs a 1-page call ~1 µs)
        for f, offset in places:
            fd = column[f]
            flat += (fd, offset, page_bytes, fd, offset + page_bytes, rest)
        return (np.array(flat, dtype=np.int64).reshape(-1, 3),
                np.empty((2 * len(places), 2), dtype=np.int64))

    def _submit(self, op: str, host: torch.Tensor | None, extents: Sequence[Extent],
                after=None) -> Future:
        if self._pool is None:
            raise RuntimeError("posix backend is closed")
        view = None if host is None else host_numpy(host)
        # Cut for the threads that are idle now: pieces beyond them only wait in the queue,
        # each one more hand-off and more Python under the GIL. 16 jobs at once of 16 blocks
        # of 2 MiB (vLLM's secondary tier) read 2x as fast from /dev/shm in 16 MiB pieces as
        # in 4 MiB ones (H100 host, bench/RESULTS.md, "Reads from the files' mappings"); a
        # call alone is cut for every thread, as before.
        with self._in_pool_lock:
            pieces = self._pieces(op, extents, max(1, self._threads - self._in_pool))
            self._in_pool += len(pieces)
        futures = []
        try:
            for idx, piece in pieces:
                f = self._files[piece.file]
                iov = piece.memory or (view[piece.buffer_offset:
                                            piece.buffer_offset + piece.length],)
                future = self._pool.submit(_move_piece, self._engine, op, f, iov, piece,
                                           self._mapped(op, piece.file))
                future.add_done_callback(self._piece_done)
                futures.append((idx, piece, future))
        except BaseException:  # (e.g. no thread could start): the pieces not handed over
            with self._in_pool_lock:
                self._in_pool -= len(pieces) - len(futures)
            raise
        return self._poller.wrap(combine(futures, after=after))

    def _piece_done(self, _future) -> None:
        with self._in_pool_lock:
            self._in_pool -= 1

    def _pieces(self, op: str, extents: Sequence[Extent],
                threads: int | None = None) -> list[tuple[int, Extent]]:
        """The call's pieces for ``threads`` threads (default: all of them; :func:`io_pieces`);
        reads whose pages are checksummed as they are read (a ``moved`` hint with
        ``slot_bytes``) in pieces of whole slots."""
        threads = threads or self._threads
        slot = _page_geometry(op, extents[0].moved)[0] if extents else 0
        if not slot:
            return io_pieces(extents, threads, self._chunk, MIN_PIECE_BYTES)
        total = sum(e.length for e in extents)
        size = min(self._chunk, max(MIN_PIECE_BYTES, -(-total // threads)))
        return split_extents(extents, max(slot, size // slot * slot))

    def _mapped(self, op: str, file: int) -> tuple[int, mmap.mmap] | None:
        """The file's (fd, mapping) where a read copies from it, else None."""
        return self._maps[file] if op == "read" else None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._mirrors.clear()
        maps, self._maps = self._maps, [None] * len(self._maps)
        self._maps_off = "the backend is closed"
        for m in maps:
            if m is not None:
                try:
                    m[1].close()
                except BufferError:  # a call still holds a view of it: unmapped when freed
                    pass


def _page_geometry(op: str, hint) -> tuple[int, int]:
    """(slot_bytes, page_bytes) where a read's ``moved`` hint takes each page's checksum, else
    (0, 0)."""
    if op != "read" or hint is None:
        return 0, 0
    return getattr(hint, "slot_bytes", 0), getattr(hint, "page_bytes", 0)


def _move_piece(engine: native.Engine, op: str, f: SlabFile, iov: Sequence,
                piece: Extent, mapped: tuple[int, mmap.mmap] | None = None) -> int:
    """One piece moved with :func:`_vector_io`, then its ``moved`` hint called in this thread
    (with the pages' checksums where it takes them)."""
    slot, page = _page_geometry(op, piece.moved)
    n, sums = _vector_io(engine, op, f, iov, piece.file_offset, slot, page, mapped)
    if piece.moved is not None:
        try:
            piece.moved(piece) if sums is None else piece.moved(piece, sums)
        except Exception:  # noqa: BLE001 - a hint: the piece moved whatever it does
            log.debug("moved hint failed for %s", piece, exc_info=True)
    return n


def _vector_io(engine: native.Engine, op: str, f: SlabFile, iov: Sequence, offset: int,
               slot_bytes: int = 0, page_bytes: int = 0,
               mapped: tuple[int, mmap.mmap] | None = None) -> tuple[int, np.ndarray | None]:
    """All of ``iov`` to or from ``f`` at ``offset``: one call of the page engine, which goes
    on after partial transfers (a read copies from ``mapped``, the file's mapping, where
    given); with ``page_bytes``, a read also checksums each
    ``slot_bytes`` slot of the piece (the first ``page_bytes`` of it). Returns the bytes moved
    and the checksums (or None). ShortIOError when the file gives no more, or when an error
    (e.g. ENOSPC) stops it after some bytes moved: those bytes count (a full disk fails only
    the pages past the point where it filled); the OSError of a call that moved nothing."""
    rows, at, column = [], offset, f.fd if mapped is None else 0
    for b in iov:
        rows.append((column, at, len(b)))
        at += len(b)
    segments = np.array(rows, dtype=np.int64)
    result = np.empty((len(iov), 2), dtype=np.int64)
    sums = None
    if op == "write":
        done = engine.write_pages(segments, iov, result)
    else:
        status = None
        if page_bytes:
            pages = (at - offset) // slot_bytes
            sums, status = np.empty(pages, dtype=np.uint64), np.empty(pages, dtype=np.uint8)
        # A cold buffered read reaches the drive a readahead window (128 KiB by default) at a
        # time; announcing the whole piece (POSIX_FADV_WILLNEED, a hint the engine ignores
        # failing) lets the kernel queue it at once. On the H100's virtio disk it measured the
        # same as no hint, within noise (bench/RESULTS.md, "Hybrid models").
        if mapped is not None:
            done = engine.copy_pages((mapped,), segments, iov, result, slot_bytes or 1,
                                     page_bytes, None, sums, status)
        else:
            done = engine.read_pages(segments, iov, result, slot_bytes or 1, page_bytes, None,
                                     sums, status, 0 if f.direct else READAHEAD_HINT_BYTES)
    errors = result[:, 1]
    if np.count_nonzero(errors):  # (a C-level count: ndarray.any() goes through Python)
        error = int(errors[errors != 0][0])
        if error == -1:
            raise ShortIOError(op, f.path, offset, at - offset, done)
        exc = OSError(error, f"{os.strerror(error)} ({op} on {f.path} at offset {offset})")
        if done:
            raise ShortIOError(op, f.path, offset, at - offset, done, exc) from exc
        raise exc
    return done, sums
