"""kvikio backend: cuFile ``pwrite``/``pread`` between GPU staging buffers and slab files.

With GPUDirect Storage (nvidia-fs, or P2PDMA on new kernels) bytes move NVMe <-> GPU without a
host copy. Without it cuFile runs in *compat mode*: kvikio reads/writes through its own pinned
bounce buffers with POSIX calls. Which one runs is kvikio's decision
(``kvikio.defaults.is_compat_mode_preferred()``); this backend reports it in ``describe()`` and
one log line, and ``gpu_direct`` is True only when compat mode is off.

Settings. Each extent (at most one stripe unit) is one kvikio call, cut into tasks of a quarter
of ``io_chunk_size`` (at least 1 MiB), passed with each ``pread``/``pwrite``: measured on an H100
VM with 64 MiB calls on /dev/shm, 16 MiB tasks read at 11 GB/s and 4 MiB tasks at 23 GB/s.
kvikio keeps its other settings process-wide (``kvikio.defaults``), under the engine that hosts
gdskv, which may use kvikio itself. The ones this backend needs -- ``num_threads`` (kvikio's
default of 1 thread serialises a batch) = ``io_threads``, the compat-mode ``bounce_buffer_size``
= the task size, and compat mode's ``auto_direct_io_read``/``_write`` = the store's O_DIRECT
answer -- are set only where nobody else did (:func:`claim_settings`); a value the host process
or a ``KVIKIO_*`` variable set stands, and ``describe()``/:meth:`direct_io` report what is in
force. What was set and what was kept is logged once.

O_DIRECT has one owner, the store (it probes the file system); this backend asks kvikio for the
same, and :meth:`KvikioBackend.direct_io` reports what kvikio does (its file handles and the
settings in force), which is what the tier's ``o_direct`` stat shows.

Slab files on a file system held in memory (tmpfs, ramfs), preallocated: once registered with
CUDA on a background thread, reads into GPU memory are copies from the files' own mapped pages,
not kvikio calls (:mod:`.memory_files`, ``map_memory_files``); writes still go through kvikio.

Small calls: extents of GPU memory within a task together move by ``raw_write``/``raw_read`` on
the calling thread when the tier asks (:meth:`KvikioBackend.move_on_caller`), with the device's
primary CUDA context made current there first.

The module imports without a CUDA driver (kvikio opens files and reads its settings on CPU);
I/O needs CUDA.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Mapping, Sequence

import torch

from ..config import TierConfig
from ..log_once import LogOnce
from .base import (MIN_PIECE_BYTES, Backend, CompletedIO, CompletionPoller, Extent, IOOutcome,
                   ShortIOError, SlabFile, WaitingFuture, split_extents)
from .cuda_driver import libcuda, make_context_current
from .memory_files import MemoryFiles
from .memory_files import why_not as why_not_mapped

log = logging.getLogger("gdskv.kvikio")

#: staging parts whose kvikio target a backend keeps (a tier has a handful)
MAX_TARGETS = 64


def _kvikio():
    import kvikio
    import kvikio.defaults
    return kvikio


#: kvikio's own defaults for the process-wide settings gdskv sets (kvikio 26.x "Runtime
#: Settings"). A setting still at this value was set by nobody; one set explicitly to the same
#: value cannot be told apart and is taken as unset.
KVIKIO_DEFAULTS: dict[str, object] = {"num_threads": 1, "bounce_buffer_size": 16 << 20,
                                      "auto_direct_io_read": False, "auto_direct_io_write": True}
#: the environment variables kvikio reads each of them from
KVIKIO_ENV: dict[str, tuple[str, ...]] = {
    "num_threads": ("KVIKIO_NTHREADS", "KVIKIO_NUM_THREADS"),
    "bounce_buffer_size": ("KVIKIO_BOUNCE_BUFFER_SIZE",),
    "auto_direct_io_read": ("KVIKIO_AUTO_DIRECT_IO_READ",),
    "auto_direct_io_write": ("KVIKIO_AUTO_DIRECT_IO_WRITE",)}

_settings_lock = threading.Lock()
_set_by_gdskv: dict[str, object] = {}   # what gdskv set in this process
_log_settings = LogOnce(log, logging.INFO)  # each distinct outcome once per process


def claim_settings(wanted: Mapping[str, object], environ: Mapping[str, str] = os.environ
                   ) -> dict[str, tuple[object, str]]:
    """Set the kvikio process-wide settings in ``wanted`` that nobody else set.

    A setting is left as it is when a ``KVIKIO_*`` variable names it, when it no longer holds
    kvikio's default (the host process set it), or when an earlier gdskv tier of this process set
    it (one value per process: changing it would change that tier's I/O). Returns, per setting,
    the value in force and who set it; logs each distinct outcome once.
    """
    defaults = _kvikio().defaults
    out: dict[str, tuple[object, str]] = {}
    with _settings_lock:
        for key, value in wanted.items():
            current = defaults.get(key)
            env = next((v for v in KVIKIO_ENV[key] if v in environ), None)
            if env is not None:
                out[key] = (current, env)
            elif key in _set_by_gdskv and _set_by_gdskv[key] == current:
                out[key] = (current, "gdskv (an earlier tier)")
            elif current != KVIKIO_DEFAULTS[key]:
                out[key] = (current, "the host process")
            else:
                if current != value:
                    defaults.set(key, value)  # a plain call (no `with`): stays set
                _set_by_gdskv[key] = value
                out[key] = (value, "gdskv")
        line = "; ".join(f"{k}={v} ({who})" for k, (v, who) in sorted(out.items()))
        _log_settings(line, "kvikio process-wide settings in force (set by): %s", line)
    return out


class KvikioBackend(Backend):
    name = "kvikio"
    #: kvikio reads and writes host memory too (numpy arrays: POSIX in its thread pool)
    in_place_host_memory = True

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        # kvikio opens files and reads its settings without CUDA, but every pread/pwrite
        # (compat mode and host buffers included) loads the CUDA driver first.
        try:
            libcuda()
        except OSError as exc:
            return f"kvikio needs the CUDA driver (libcuda.so.1) for every read and write: {exc}"
        return None

    def __init__(self, config: TierConfig, device: torch.device | str = "cuda") -> None:
        kvikio = _kvikio()
        # Tasks of a quarter stripe unit: a 64 MiB call over 16 MiB stripes still spreads over
        # 16 threads, from one kvikio call per extent (each Python->C call costs GIL hand-offs).
        self._task = max(MIN_PIECE_BYTES, config.io_chunk_size // 4)
        self._threads = config.io_threads
        self._settings: dict[str, tuple[object, str]] = {}
        self._compat = bool(kvikio.defaults.is_compat_mode_preferred())
        try:
            import kvikio.cufile_driver
            self._nvidia_fs = bool(kvikio.cufile_driver.get("is_gds_available"))
        except Exception as exc:  # noqa: BLE001 - the driver query itself can fail in compat mode
            self._nvidia_fs = None
            log.debug("cufile_driver query failed: %s", exc)
        self._chunk = config.io_chunk_size
        self._map_memory_files = config.map_memory_files
        self._memory: MemoryFiles | None = None  # slab files in memory, read from their pages
        self._memory_off = "the store is not attached yet"
        self._poller = CompletionPoller(config.io_poll_us)
        self._files: list = []
        self._registered: dict[tuple[int, int], torch.Tensor] = {}
        self._targets: dict[int, tuple[torch.Tensor, object]] = {}  # id -> (part, target)
        self._lock = threading.Lock()
        self._closed = False
        self._device = torch.device(device)  # whose GPU memory its buffers are, when on one
        self._device_index: int | None = None  # its index, once a call on the caller needs it
        self._thread = threading.local()  # per calling thread: the device whose context is set
        self._context_failed = False
        if self._compat:
            log.warning("kvikio: cuFile runs in compat mode (no GPUDirect Storage: nvidia-fs "
                        "loaded=%s); bytes go through host bounce buffers", self._nvidia_fs)
        else:
            log.info("kvikio: GPUDirect Storage active (nvidia-fs loaded=%s)", self._nvidia_fs)

    @property
    def gpu_direct(self) -> bool:
        return not self._compat

    @property
    def compat_mode(self) -> bool:
        return self._compat

    def describe(self) -> dict:
        return {**super().describe(), "compat_mode": self._compat,
                "nvidia_fs_loaded": self._nvidia_fs, "task_size": self._task,
                "io_poll_us": self._poller.budget_us,
                "settings": {k: {"value": v, "set_by": who}
                             for k, (v, who) in self._settings.items()},
                "kvikio_version": getattr(_kvikio(), "__version__", "?"),
                "memory_files": self._memory.describe() if self._memory is not None
                else {"state": f"off: {self._memory_off}"}}

    def attach(self, files: Sequence[SlabFile]) -> None:
        kvikio = _kvikio()
        direct = bool(files) and all(f.direct for f in files)  # the store's answer
        self._settings = claim_settings({
            "num_threads": self._threads,
            # compat mode bounces through buffers of this size: one per task
            "bounce_buffer_size": self._task,
            # compat mode: O_DIRECT for aligned I/O exactly where the store got it
            "auto_direct_io_read": direct, "auto_direct_io_write": direct})
        # "r+": read/write without truncating the preallocated slabs. CuFile opens its own
        # O_DIRECT and buffered fds (whether it may use O_DIRECT is fixed when it opens); the
        # store's fds stay for fdatasync.
        self._files = [kvikio.CuFile(f.path, "r+") for f in files]
        self._paths = [f.path for f in files]
        why = why_not_mapped(files, self._device) if self._map_memory_files \
            else "map_memory_files=false"
        if why is None:
            self._memory = MemoryFiles(files, self._device)
        else:
            self._memory_off = why

    def direct_io(self) -> tuple[bool, str] | None:
        """Whether kvikio reads and writes the slab files with O_DIRECT, and why: its file
        handles' answer and, in compat mode, the ``auto_direct_io_*`` settings in force now."""
        if not self._files:
            return None
        handles = all(f.is_direct_io_supported() for f in self._files)
        if not self._compat:
            return handles, ("cuFile (GPUDirect Storage) does its I/O on its O_DIRECT handles"
                             if handles else "kvikio's file handles have no O_DIRECT")
        defaults = _kvikio().defaults
        flags = {op: bool(defaults.get(f"auto_direct_io_{op}")) for op in ("read", "write")}
        who = {op: self._settings.get(f"auto_direct_io_{op}", (None, "?"))[1]
               for op in ("read", "write")}
        why = ", ".join(f"auto_direct_io_{op}={flags[op]} (set by {who[op]})"
                        for op in ("read", "write"))
        if not handles:
            return False, f"kvikio compat mode: its file handles have no O_DIRECT; {why}"
        return flags["read"] and flags["write"], f"kvikio compat mode: {why}"

    def _register(self, buffer: torch.Tensor) -> None:
        """Register a long-lived staging buffer with cuFile once (a no-op in compat mode)."""
        if buffer.device.type != "cuda" or self._compat:
            return
        key = (buffer.data_ptr(), buffer.numel())
        with self._lock:
            if key in self._registered:
                return
            import kvikio.buffer
            kvikio.buffer.memory_register(buffer)
            self._registered[key] = buffer

    def _target(self, buffer: torch.Tensor):
        """What kvikio is handed for a staging part: made (and the part registered) the first
        time a part is seen, then reused; each torch query it takes costs host time on every
        call otherwise (the tier passes only its long-lived staging parts here)."""
        known = self._targets.get(id(buffer))
        if known is not None and known[0] is buffer:
            return known[1]
        self._register(buffer)
        target = DeviceBytes.of(buffer) if buffer.device.type == "cuda" else buffer.numpy()
        if len(self._targets) < MAX_TARGETS:  # (the entry keeps ``buffer``, so its id holds)
            self._targets[id(buffer)] = (buffer, target)
        return target

    def write(self, buffer: torch.Tensor | None, extents: Sequence[Extent]) -> WaitingFuture:
        return self._submit("pwrite", buffer, extents)

    def read(self, buffer: torch.Tensor | None, extents: Sequence[Extent]) -> WaitingFuture:
        return self._submit("pread", buffer, extents)

    def move_on_caller(self, op: str, buffer: torch.Tensor | None,
                       extents: Sequence[Extent]) -> CompletedIO | None:
        """Extents of GPU memory no larger than a task together (which kvikio's pool would run
        on one or a few threads, after a hand-off to each) move by ``raw_write``/``raw_read``
        on this thread, one after the other: cuFile's synchronous call with GPUDirect
        Storage, kvikio's bounce-buffer copy and POSIX call in compat mode; the GIL is
        released meanwhile. Host memory (those calls take none) and larger calls go through
        the pool. (Several extents: a few pages of a combined call, :mod:`gdskv.call_combiner`.)"""
        if self._closed or buffer is None or not extents:
            return None
        if op == "read" and self._memory is not None:
            copied = self._memory.read(buffer, extents)
            if copied is not None:  # a copy from the files' pages: waited for here
                copied[0].synchronize()
                return CompletedIO(copied[1])
        total = 0
        for e in extents:
            if e.memory:
                return None
            total += e.length
        if total > self._task:
            return None
        # (the target, not a torch query, says whether it is GPU memory: each query costs
        # host time on every small call)
        target = self._target(buffer)
        if not isinstance(target, DeviceBytes) or not self._caller_context():
            return None
        outcome = IOOutcome()
        for i, e in enumerate(extents):
            handle = self._files[e.file]
            try:
                n = (handle.raw_write if op == "write" else handle.raw_read)(
                    target, e.length, e.file_offset, e.buffer_offset)
                if n != e.length:
                    raise ShortIOError(op, self._paths[e.file], e.file_offset, e.length, n)
                outcome.nbytes += n
            except Exception as exc:  # noqa: BLE001 - recorded against the extent, as a pool I/O
                outcome.fail(i, exc, e)
        return CompletedIO(outcome)

    def _caller_context(self) -> bool:
        """Make the device's primary CUDA context current on this thread, once per thread (the
        compat-mode copy of ``raw_read``/``raw_write`` runs in the caller's context, and a
        thread that has made no CUDA call has none: CUDA_ERROR_INVALID_CONTEXT; kvikio's own
        threads set theirs). False where that fails: the call goes through the pool."""
        index = self._device_index
        if index is None:
            index = self._device_index = self._device.index if self._device.index is not None \
                else torch.cuda.current_device()
        elif getattr(self._thread, "context", None) == index:
            return True
        try:
            make_context_current(index)
        except OSError as exc:
            if not self._context_failed:
                self._context_failed = True
                log.warning("kvikio: cannot make the CUDA context current on a calling thread "
                            "(%s); its small I/O goes through kvikio's threads", exc)
            return False
        self._thread.context = index
        return True

    def _submit(self, op: str, buffer: torch.Tensor | None,
                extents: Sequence[Extent]) -> WaitingFuture:
        if self._closed:
            raise RuntimeError("kvikio backend is closed")
        if op == "pread" and buffer is not None and self._memory is not None:
            copied = self._memory.read(buffer, extents)
            if copied is not None:  # a copy from the files' pages (memory_files)
                return WaitingFuture(functools.partial(_copied, *copied, buffer))
        target = None
        if buffer is not None:
            target = self._target(buffer)
        started = []
        outcome = IOOutcome()
        # One kvikio call per extent (at most a stripe unit: io_chunk_size), or per buffer of
        # an extent's own host memory; kvikio cuts it into task_size tasks over its threads.
        for i, piece in split_extents(extents, self._chunk):
            for part, view in _views(piece, target):
                try:
                    started.append((i, part, getattr(self._files[part.file], op)(
                        view, part.length, part.file_offset, self._task)))
                except Exception as exc:  # noqa: BLE001 - recorded against this extent
                    outcome.fail(i, exc, part)
        # kvikio's own threads do the I/O; the caller's thread waits on kvikio's futures when it
        # asks for the outcome (IOFuture.get releases the GIL): no waiter thread in between.
        return WaitingFuture(functools.partial(self._wait, started, outcome, (buffer, extents),
                                               op))

    def _wait(self, started, outcome: IOOutcome, memory, op: str) -> IOOutcome:
        # ``memory`` (the buffer and the extents' own) is an argument so it stays alive until
        # every future has completed.
        if self._poller.on:
            self._poller.poll([fut for _, _, fut in started])
        for i, piece, fut in started:
            try:
                n = fut.get()
                if n != piece.length:
                    raise ShortIOError(op[1:], self._paths[piece.file], piece.file_offset,
                                       piece.length, n)
                outcome.nbytes += n
            except Exception as exc:  # noqa: BLE001 - recorded against this extent
                outcome.fail(i, exc, piece)
        return outcome

    def close(self) -> None:
        self._closed = True
        if self._memory is not None:
            self._memory.close()
            self._memory = None
        if self._registered:
            import kvikio.buffer
            for buf in self._registered.values():
                try:
                    kvikio.buffer.memory_deregister(buf)
                except Exception as exc:  # noqa: BLE001
                    log.debug("deregister failed: %s", exc)
            self._registered.clear()
        self._targets.clear()
        for f in self._files:
            f.close()
        self._files = []


def _copied(done: torch.cuda.Event, outcome: IOOutcome, buffer: torch.Tensor) -> IOOutcome:
    """A read's outcome once its copies from the files' pages have ended (``buffer``: held
    until then)."""
    done.synchronize()
    return outcome


class DeviceBytes:
    """A byte range of device memory as kvikio takes it (``__cuda_array_interface__``).

    Slicing a torch tensor and exporting its interface for kvikio costs 20-50 µs of host time
    per I/O call on a busy host; this costs two integers. Whoever makes one keeps the memory it
    points into alive until the I/O has ended (:meth:`KvikioBackend._wait` holds the buffer).
    """

    __slots__ = ("ptr", "nbytes", "__cuda_array_interface__")

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr, self.nbytes = ptr, nbytes
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "strides": None, "version": 3}

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "DeviceBytes":
        """All bytes of a contiguous CUDA tensor."""
        if not tensor.is_contiguous():
            raise ValueError("kvikio backend: the staging buffer must be contiguous")
        return cls(tensor.data_ptr(), tensor.numel() * tensor.element_size())

    def __len__(self) -> int:
        return self.nbytes

    def __getitem__(self, s: slice) -> "DeviceBytes":
        start, stop, step = s.indices(self.nbytes)
        if step != 1:
            raise ValueError("DeviceBytes: only contiguous ranges")
        return DeviceBytes(self.ptr + start, max(0, stop - start))


def _views(piece: Extent, target) -> list[tuple[Extent, object]]:
    """The (extent, buffer view) pairs one piece is moved as: its range of the call's buffer,
    or each buffer of its own memory at its place in the file."""
    if not piece.memory:
        return [(piece, target[piece.buffer_offset:piece.buffer_offset + piece.length])]
    out, done = [], 0
    for m in piece.memory:
        out.append((Extent(piece.file, piece.file_offset + done, len(m),
                           piece.buffer_offset + done), m))
        done += len(m)
    return out
