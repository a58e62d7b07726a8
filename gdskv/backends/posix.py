"""POSIX backend: ``os.pwrite/preadv`` from aligned host memory in a thread pool.

The backend that runs anywhere (CI has no GPU). GPU buffers go through a pinned host mirror.
Each call's extents are cut into pieces (at most ``io_chunk_size``, smaller for small calls) so
all threads keep the drive's queue full; O_DIRECT (when the store got it) needs the 4 KiB-aligned buffers the tier allocates.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..config import TierConfig
from ..memory import host_numpy
from .base import Backend, Extent, ShortIOError, SlabFile, combine, io_pieces
from .bounce import HostMirrors


class PosixBackend(Backend):
    name = "posix"

    def __init__(self, config: TierConfig, device: torch.device | str = "cpu") -> None:
        self._threads = config.io_threads
        self._chunk = config.io_chunk_size
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            self._threads, thread_name_prefix="gdskv-posix")
        self._files: list[SlabFile] = []
        self._mirrors = HostMirrors()

    @property
    def gpu_direct(self) -> bool:
        return False

    def attach(self, files: Sequence[SlabFile]) -> None:
        self._files = list(files)

    def describe(self) -> dict:
        return {**super().describe(), "threads": self._threads, "io_chunk_size": self._chunk,
                "gpu_buffers": "staged through a pinned host mirror"}

    def write(self, buffer: torch.Tensor, extents: Sequence[Extent]) -> Future:
        host = self._mirrors.to_host(buffer, extents)
        return self._submit(_pwrite_all, host, extents)

    def read(self, buffer: torch.Tensor, extents: Sequence[Extent]) -> Future:
        host = self._mirrors.host_buffer(buffer)
        after = None if host is buffer else (lambda: self._mirrors.from_host(host, buffer, extents))
        return self._submit(_pread_all, host, extents, after)

    def _submit(self, fn, host: torch.Tensor, extents: Sequence[Extent], after=None) -> Future:
        if self._pool is None:
            raise RuntimeError("posix backend is closed")
        view = host_numpy(host)
        futures = []
        for idx, piece in io_pieces(extents, self._threads, self._chunk):
            f = self._files[piece.file]
            mv = view[piece.buffer_offset:piece.buffer_offset + piece.length]
            futures.append((idx, piece, self._pool.submit(fn, f, mv, piece.file_offset)))
        return combine(futures, after=after)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._mirrors.clear()


def _pwrite_all(f: SlabFile, view, offset: int) -> int:
    mv, done = memoryview(view), 0
    while done < len(mv):
        n = os.pwrite(f.fd, mv[done:], offset + done)
        if n <= 0:
            raise ShortIOError("write", f.path, offset, len(mv), done)
        done += n
    return done


def _pread_all(f: SlabFile, view, offset: int) -> int:
    mv, done = memoryview(view), 0
    while done < len(mv):
        n = os.preadv(f.fd, [mv[done:]], offset + done)
        if n <= 0:
            raise ShortIOError("read", f.path, offset, len(mv), done)
        done += n
    return done
