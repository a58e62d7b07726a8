"""Slab files held in memory (tmpfs, ramfs: ``/dev/shm``), read by the GPU's copy engine from
the files' own pages.

Such a file's pages are its storage. kvikio without GPUDirect Storage (and cuFile on these file
systems, which it cannot serve directly) reads them through a bounce buffer: each byte is copied
from the page cache into pinned memory by a CPU, then read again by the copy engine. On the
H100 VMs that read 4 GiB at 42-45 GB/s, against 55 GB/s for the copy engine alone
(``bench/results/h100-2026-11-27/compat-read/``). Mapped (``MAP_SHARED``, read-only) and
registered with CUDA (``cuMemHostRegister``: the pages are locked where they lie), a file is read
by one copy of each extent from its mapping, at the copy engine's speed: 78.6 ms for the same
4 GiB, bit-exact, and a write through the file (the tier's ``pwrite``) is what the next copy
reads, as the mapping is the file's page cache.

Registering takes 0.2–0.6 s a GiB on those hosts (the kernel locks each page), so it runs on
a background thread from the moment the store is attached; a read of a file not registered
yet goes through kvikio, as before. A registered file stays locked in memory until the backend
closes: it is RAM already, but can no longer be swapped out. Only preallocated files are mapped:
locking a sparse file's range would allocate all of it at once.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from ..store import file_system_type, MEMORY_FILE_SYSTEMS
from . import cuda_driver
from .base import Extent, IOOutcome, ShortIOError, SlabFile

log = logging.getLogger("gdskv.memory_files")

#: the range may be used from every context, and the GPU only reads it (so a read-only
#: mapping can be registered)
_REGISTER_FLAGS = cuda_driver.HOST_REGISTER_PORTABLE | cuda_driver.HOST_REGISTER_READ_ONLY


def why_not(files: Sequence[SlabFile], device: torch.device) -> str | None:
    """None where ``files`` can be read from their mappings on ``device``, else why not."""
    if device.type != "cuda":
        return "the tier's device is not a GPU"
    if not files:
        return "no slab files"
    for f in files:
        why = why_not_file(f)
        if why is not None:
            return why
    return None


def why_not_file(f: SlabFile) -> str | None:
    """None where slab file ``f`` may be read from a mapping of it (by the GPU, registered, or
    by the posix backend's copies), else why not: it must be on a file system held in memory
    and preallocated to its size. (Registering locks every page of the range, so a file not
    yet grown to its size -- no preallocate, or another writer's -- would be allocated whole;
    and a read of a hole through a mapping allocates the page, which faults where the file
    system is full.)"""
    kind = file_system_type(f.path)
    if kind not in MEMORY_FILE_SYSTEMS:
        return f"{f.path} is on {kind or 'an unknown file system'}, not one held in memory"
    try:
        st = os.stat(f.path)
    except OSError as exc:
        return f"{f.path}: {exc.strerror}"
    if st.st_size < f.size or st.st_blocks * 512 < f.size:
        return f"{f.path} is not preallocated to its {f.size} bytes"
    return None


class MemoryFiles:
    """The slab files mapped and registered with CUDA, for reads into GPU memory.

    ``read(buffer, extents)`` copies each extent from its file's mapping into ``buffer`` on
    this object's stream and returns the event that marks the copies' end, or None when an
    extent's file is not registered (yet): the caller then reads it its usual way."""

    def __init__(self, files: Sequence[SlabFile], device: torch.device) -> None:
        self.device = device
        self.files = list(files)
        self._maps: list[mmap.mmap | None] = [None] * len(files)
        self._hosts: list[torch.Tensor | None] = [None] * len(files)  # each mapping, as bytes
        self._addresses: list[int] = [0] * len(files)
        self._ready = [False] * len(files)
        self._stream = torch.cuda.Stream(device)  # every read's copies, in order
        self._closing = threading.Event()
        self.error: str | None = None
        #: reads served from the mappings
        self.reads = 0
        self.register_seconds = 0.0
        self._thread = threading.Thread(target=self._register_all, name="gdskv-map-files",
                                        daemon=True)
        self._thread.start()

    @property
    def registered(self) -> int:
        return sum(self._ready)

    def describe(self) -> dict:
        state = ("failed: " + self.error if self.error else
                 "ready" if all(self._ready) else "registering")
        return {"state": state, "files_registered": self.registered, "files": len(self.files),
                "register_seconds": round(self.register_seconds, 3)}

    def _register_all(self) -> None:
        t0 = time.perf_counter()
        try:
            index = self.device.index if self.device.index is not None \
                else torch.cuda.current_device()
            cuda_driver.make_context_current(index)
            cuda_driver.relax_capture_mode()  # (an engine may capture its graphs meanwhile)
            for i, f in enumerate(self.files):
                if self._closing.is_set():
                    return
                self._register(i, f)
        except Exception as exc:  # noqa: BLE001 - reads go on through kvikio
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("gdskv: slab files in memory will be read through kvikio, not from "
                        "their mappings: %s", self.error)
            return
        finally:
            self.register_seconds = time.perf_counter() - t0
        log.info("gdskv: %d slab files in memory mapped and registered with CUDA in %.2f s; "
                 "reads copy from them", len(self.files), self.register_seconds)

    def _register(self, i: int, f: SlabFile) -> None:
        if f.size <= 0:
            raise ValueError(f"{f.path} has no size to map")
        fd = os.open(f.path, os.O_RDONLY)
        try:  # (the mapping keeps the file open; its descriptor is not needed after)
            m = mmap.mmap(fd, f.size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        array = np.frombuffer(m, dtype=np.uint8)
        address = array.ctypes.data
        try:
            cuda_driver.host_register(address, f.size, _REGISTER_FLAGS)
        except OSError as exc:
            array = None  # (the mapping's only view: it can close)
            m.close()
            raise OSError(f"registering {f.path} ({f.size} bytes) with CUDA: {exc}") from None
        with warnings.catch_warnings():  # read-only memory: only ever copied out of
            warnings.simplefilter("ignore", UserWarning)
            host = torch.from_numpy(array)
        self._maps[i], self._addresses[i], self._hosts[i] = m, address, host
        self._ready[i] = True

    def read(self, buffer: torch.Tensor, extents: Sequence[Extent]
             ) -> tuple[torch.cuda.Event, IOOutcome] | None:
        """Copy each extent (GPU ``buffer`` ranges, no memory of their own) from its file's
        mapping; the copies' end event and the outcome, or None if a file is not registered."""
        ready = self._ready
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            return None
        for e in extents:
            if e.memory or not ready[e.file]:
                return None
        outcome = IOOutcome()
        with torch.cuda.stream(self._stream):
            for i, e in enumerate(extents):
                host, size = self._hosts[e.file], self.files[e.file].size
                n = max(0, min(e.length, size - e.file_offset))
                if n:
                    buffer[e.buffer_offset:e.buffer_offset + n].copy_(
                        host[e.file_offset:e.file_offset + n], non_blocking=True)
                    outcome.nbytes += n
                if n != e.length:  # past the file's end: what a short read reports
                    outcome.fail(i, ShortIOError("read", self.files[e.file].path,
                                                 e.file_offset, e.length, n), e)
            done = torch.cuda.Event()
            done.record(self._stream)
        self.reads += 1
        return done, outcome

    def close(self) -> None:
        """Unregister and unmap (after the registration thread has stopped)."""
        self._closing.set()
        self._thread.join()
        self._stream.synchronize()
        for i, m in enumerate(self._maps):
            if m is None:
                continue
            self._ready[i] = False
            self._hosts[i] = None  # (the last view of the mapping: it can close now)
            try:
                cuda_driver.host_unregister(self._addresses[i])
            except OSError as exc:  # closing: nothing else to do
                log.debug("unregistering %s failed: %s", self.files[i].path, exc)
            try:
                m.close()
            except BufferError:  # a view is still alive somewhere: unmapped when it goes
                pass
            self._maps[i] = None


def wait_registered(tier, timeout: float = 300.0) -> dict:
    """Wait until ``tier``'s slab files held in memory are registered (or failed, or off), for
    a benchmark that times the open tier's steady state; the backend's record of them, with
    ``register_seconds``."""
    def detail():
        return tier.stats()["backend_detail"].get("memory_files")
    got = detail()
    if got is None:
        return {"state": f"not applicable ({tier.stats()['backend']} backend)"}
    deadline = time.monotonic() + timeout
    while got["state"] == "registering" and time.monotonic() < deadline:
        time.sleep(0.01)
        got = detail()
    return got
