"""NIXL backend: GDS / GDS_MT where they really run, the POSIX plugin (with a pinned host bounce
buffer for GPU buffers) otherwise, and always a statement of which one runs and why.

One ``nixl_agent`` per backend, created with no plugins; plugins are created explicitly:

* GPU buffers (``device`` is CUDA): ``GDS_MT`` then ``GDS`` (``config.nixl_plugin`` may name
  one), after preloading libcudart/libcufile with ``cuda.pathfinder`` (the wheel's plugins do
  not find them otherwise). If no GDS plugin can be created, or a slab file or the staging
  buffer cannot be registered with it (cuFile error 5027 without nvidia-fs), the backend falls
  back to ``POSIX`` and stages GPU ranges through a pinned host mirror (:class:`HostMirrors`,
  shared with the posix backend).
* Host buffers: ``POSIX`` (queue ``config.nixl_posix_queue``: aio, uring or posix_aio).

``describe()`` gives ``{"name", "plugin", "gpu_direct", "fallback_reason", ...}``; a fallback is
also logged once on ``gdskv.nixl``.

Every NIXL call runs on one worker thread (the agent is created with ``NIXL_THREAD_SYNC_NONE``
semantics in mind): ``write``/``read`` queue a request and return a Future at once; the worker
posts one NIXL transfer per request (an Nx3 descriptor array covering every extent piece) and
polls all in-flight transfers, sleeping with exponential back-off (50 us .. 2 ms) while nothing
completes, so waiting costs no core. A request that fails as a whole (an exception from
``initialize_xfer``/``transfer`` or the ``ERR`` state) is retried piece by piece to find the
failing extents; only those are reported in ``IOOutcome.errors``.

Why ``initialize_xfer`` and not ``prep_xfer_dlist`` + ``make_prepped_xfer``: the extents change
with every call, so a prepped list would have to be built per call too. Measured on CPU (NIXL
1.5.1, POSIX/aio, 1024 descriptors of 16 KiB): ``initialize_xfer`` ~90 us against a ~11-15 ms
transfer, i.e. < 1 %; not worth a per-slot prepped table and its memory.

No in-place host path (``in_place_host_memory`` is False): NIXL moves only memory registered
with its agent, and a CPU tier's callers hand new regions every call (vLLM's primary rows,
LMCache's L1 objects), so each call would register and deregister them (the registration cache
holds ``_MAX_REGISTRATIONS`` buffers, not thousands of rows). For host memory NIXL's POSIX plugin
does the same kernel I/O as the posix backend, which moves those regions in place with nothing
to register; a CPU tier on NIXL keeps its registered staging buffer.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import numpy as np
import torch

from ..config import NixlPlugin, TierConfig
from ..memory import cuda_available
from .base import Backend, CompletionPoller, Extent, IOOutcome, SlabFile, io_pieces
from .bounce import HostMirrors

log = logging.getLogger("gdskv.nixl")

GDS_PLUGINS = ("GDS_MT", "GDS")
POSIX_QUEUES = {"aio": "use_aio", "uring": "use_uring", "posix_aio": "use_posix_aio"}
_POLL_MIN_S = 50e-6     # about the smallest sleep Linux gives
_POLL_MAX_S = 2e-3      # bound on the latency added to a completion
_MAX_REGISTRATIONS = 8  # cached memory registrations (staging buffers, bounce mirrors)
_agent_ids = itertools.count()


class NixlUnavailableError(ImportError):
    """NIXL is not installed (or does not import) but the nixl backend was requested."""


class NixlTransferError(OSError):
    """A NIXL transfer of one extent piece failed (exception or ``ERR`` state)."""


def load_nixl_api():
    """``(nixl_agent, nixl_agent_config)`` from whichever NIXL wheel is installed."""
    errors = []
    for module in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            api = importlib.import_module(module)
        except ImportError as exc:
            errors.append(f"{module}: {exc}")
            continue
        return api.nixl_agent, api.nixl_agent_config
    raise NixlUnavailableError("backend 'nixl' needs NIXL; install it with `pip install "
                               "nixl-cu13` (or nixl-cu12). Import errors: " + "; ".join(errors))


def preload_cuda_libs() -> str | None:
    """Load libcudart and libcufile for the GDS plugins; returns why not, or None when loaded."""
    try:
        from cuda import pathfinder
    except ImportError as exc:
        return f"cuda.pathfinder is not installed ({exc})"
    for lib in ("cudart", "cufile"):
        try:
            pathfinder.load_nvidia_dynamic_lib(lib)
        except Exception as exc:  # noqa: BLE001 - any failure means "no GDS", reported
            return f"cannot load lib{lib} ({type(exc).__name__}: {exc})"
    return None


def plan_plugins(requested: NixlPlugin | str, device: torch.device,
                 cuda_ok: bool) -> tuple[tuple[str, ...], str | None]:
    """The GDS plugins to try, in order, and (when there are none) why POSIX runs instead.

    The reason is None when POSIX is simply the right plugin (host buffers, nothing else asked).
    GDS plugins are never tried without a usable CUDA device: with the NIXL 1.5.1 wheel,
    ``cuFileDriverOpen`` spins forever inside ``create_backend("GDS_MT")`` on a machine with no
    GPU (seen here), so trying would hang the process.
    """
    requested = NixlPlugin(requested if isinstance(requested, NixlPlugin)
                           else NixlPlugin[str(requested).upper()])
    if requested is NixlPlugin.POSIX:
        if device.type == "cuda":
            return (), "nixl_plugin=POSIX: GPU buffers are staged through pinned host memory"
        return (), None
    if device.type != "cuda":
        if requested is NixlPlugin.AUTO:
            return (), None
        return (), (f"nixl_plugin={requested.value} asked, but buffers are host memory (device "
                    f"{device}): GDS is for GPU memory, POSIX plugin used")
    if not cuda_ok:
        return (), "no usable CUDA device: GDS plugins not tried, POSIX with host staging"
    if requested is NixlPlugin.AUTO:
        return GDS_PLUGINS, None
    return (requested.value,), None


class _Call:
    """A function to run on the worker thread (NIXL calls stay on one thread)."""
    __slots__ = ("fn", "future")

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn, self.future = fn, Future()


class _Request:
    """One write/read call in flight."""
    __slots__ = ("op", "buffer", "extents", "pieces", "future", "event", "io", "mem", "devid",
                 "pending", "errors", "bounce")

    def __init__(self, op, buffer, extents, pieces, event) -> None:
        self.op, self.buffer, self.extents, self.pieces = op, buffer, extents, pieces
        self.event = event
        self.future: Future = Future()
        self.io = buffer
        self.mem, self.devid, self.bounce = "DRAM", 0, False
        self.pending = len(pieces)
        self.errors: dict[int, BaseException] = {}


_STOP = object()


class NixlBackend(Backend):
    """Backend over one NIXL agent; see the module docstring."""

    name = "nixl"

    def __init__(self, config: TierConfig, device: torch.device | str) -> None:
        nixl_agent, nixl_agent_config = load_nixl_api()
        self._config = config
        self._device = torch.device(device)
        self._agent = nixl_agent(f"gdskv-nixl-{os.getpid()}-{next(_agent_ids)}",
                                 nixl_agent_config(enable_prog_thread=False, backends=[]))
        self._plugins: dict[str, dict] = {}       # created plugin -> params given
        self._plugin = "POSIX"
        self._direct = False
        self._fallback_reason: str | None = None
        self._posix_queue: str | None = None
        self._files: dict[int, SlabFile] = {}
        self._file_regs: dict[str, dict[int, object]] = {}    # plugin -> file index -> reg
        # (start, end, mem, plugin, reg, keepalive tensor), most recently used last
        self._mem_regs: list[tuple] = []
        self._bounce: HostMirrors | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._poller = CompletionPoller(config.io_poll_us)

        candidates, reason = plan_plugins(config.nixl_plugin, self._device,
                                          cuda_available() if self._device.type == "cuda"
                                          else False)
        if candidates:
            reason = self._try_gds(candidates)
        if not self._direct:
            self._ensure_posix()
            if reason is not None:
                self._fall_back_note(reason)

        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="gdskv-nixl", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------------------- plugins
    def _try_gds(self, candidates: Sequence[str]) -> str | None:
        """Create the first GDS plugin that works; returns why none did (None on success)."""
        why = preload_cuda_libs()
        if why is not None:
            return f"GDS plugins not usable: {why}"
        failures = []
        for plugin in candidates:
            params = {"thread_count": str(self._config.io_threads)} if plugin == "GDS_MT" else {}
            try:
                self._create_plugin(plugin, params)
            except Exception as exc:  # noqa: BLE001 - reported as the fallback reason
                failures.append(f"{plugin}: create_backend failed ({type(exc).__name__}: {exc})")
                continue
            self._plugin, self._direct = plugin, True
            log.info("NIXL plugin %s runs (GPU direct)", plugin)
            return None
        return "; ".join(failures)

    def _create_plugin(self, plugin: str, params: dict[str, str]) -> None:
        self._agent.create_backend(plugin, params)
        self._plugins[plugin] = params

    def _ensure_posix(self) -> None:
        if "POSIX" in self._plugins:
            return
        wanted = self._config.nixl_posix_queue
        params = {flag: "true" if q == wanted else "false" for q, flag in POSIX_QUEUES.items()}
        try:
            self._create_plugin("POSIX", params)
            self._posix_queue = wanted
        except Exception as exc:  # noqa: BLE001 - the queue kind may be missing (no io_uring)
            log.warning("NIXL POSIX plugin with queue %s failed (%s); using its default queue",
                        wanted, exc)
            self._create_plugin("POSIX", {})
            self._posix_queue = "default"

    def _fall_back_note(self, reason: str) -> None:
        """Record (and log once) why POSIX runs instead of what was asked."""
        if self._fallback_reason is None:
            self._fallback_reason = reason
            log.warning("gdskv nixl backend: plugin POSIX%s runs, not GPU direct: %s",
                        " with pinned host staging" if self._device.type == "cuda" else "",
                        reason)

    def _fall_back(self, reason: str) -> None:
        """Switch from a GDS plugin to POSIX (worker thread or attach); files re-registered."""
        failed = self._plugin
        self._plugin, self._direct = "POSIX", False
        self._ensure_posix()
        for reg in self._file_regs.pop(failed, {}).values():
            self._safe(self._agent.deregister_memory, reg, backends=[failed])
        for entry in [e for e in self._mem_regs if e[3] == failed]:
            self._mem_regs.remove(entry)
            self._safe(self._agent.deregister_memory, entry[4], backends=[failed])
        for f in self._files.values():
            self._register_file(f, "POSIX")
        self._fall_back_note(f"{failed}: {reason}")

    @property
    def gpu_direct(self) -> bool:
        return self._direct

    @property
    def plugin(self) -> str:
        return self._plugin

    def describe(self) -> dict:
        return {**super().describe(), "plugin": self._plugin,
                "fallback_reason": self._fallback_reason,
                "bounce": self._device.type == "cuda" and not self._direct,
                "posix_queue": self._posix_queue if self._plugin == "POSIX" else None,
                "plugins_created": sorted(self._plugins), "device": str(self._device),
                "io_poll_us": self._poller.budget_us}

    # ----------------------------------------------------------------------------- files
    def attach(self, files: Sequence[SlabFile]) -> None:
        self._call(lambda: self._attach(list(files)))

    def _attach(self, files: list[SlabFile]) -> None:
        for f in files:
            if not isinstance(f, SlabFile):
                raise TypeError(f"attach: expected SlabFile, got {type(f).__name__}")
            old = self._files.get(f.index)
            if old is not None and (old.fd, old.size) == (f.fd, f.size):
                continue  # registered once
            if old is not None:
                self._deregister_file(f.index)
            self._files[f.index] = f
            try:
                self._register_file(f, self._plugin)
            except Exception as exc:
                if self._plugin == "POSIX":
                    del self._files[f.index]
                    raise OSError(f"NIXL POSIX cannot register slab file {f.path} "
                                  f"(fd {f.fd}): {exc}") from exc
                self._fall_back(f"file registration failed for {f.path} "
                                f"({type(exc).__name__}: {exc})")

    def _register_file(self, f: SlabFile, plugin: str) -> None:
        reg = self._agent.register_memory([(0, f.size, f.fd, "")], "FILE", backends=[plugin])
        self._file_regs.setdefault(plugin, {})[f.index] = reg

    def _deregister_file(self, index: int) -> None:
        for plugin, regs in self._file_regs.items():
            reg = regs.pop(index, None)
            if reg is not None:
                self._safe(self._agent.deregister_memory, reg, backends=[plugin])
        self._files.pop(index, None)

    # ----------------------------------------------------------------------------- memory
    def _registration(self, tensor: torch.Tensor, mem: str, devid: int) -> None:
        """Register ``tensor``'s memory with the active plugin once (cached, bounded LRU)."""
        start = tensor.data_ptr()
        end = start + tensor.numel()
        for i, entry in enumerate(self._mem_regs):
            if entry[0] <= start and end <= entry[1] and entry[2] == mem \
                    and entry[3] == self._plugin:
                self._mem_regs.append(self._mem_regs.pop(i))
                return
        if mem == "DRAM":
            # Register the whole host allocation: views of it (the tier's two staging halves)
            # then share one registration. Host registration is bookkeeping only for POSIX.
            storage = tensor.untyped_storage()
            start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        reg = self._agent.register_memory([(start, end - start, devid, "")], mem,
                                          backends=[self._plugin])
        # The tensor is kept so its memory cannot be freed and reused under a live registration.
        self._mem_regs.append((start, end, mem, self._plugin, reg, tensor))
        while len(self._mem_regs) > _MAX_REGISTRATIONS:
            old = self._mem_regs.pop(0)
            self._safe(self._agent.deregister_memory, old[4], backends=[old[3]])

    def _prepare_memory(self, req: _Request) -> None:
        buf = req.buffer
        if buf.device.type == "cuda" and self._direct:
            try:
                self._registration(buf, "VRAM", buf.device.index or 0)
                req.io, req.mem, req.devid = buf, "VRAM", buf.device.index or 0
                return
            except Exception as exc:  # noqa: BLE001 - cuFile refused GPU memory: fall back
                self._fall_back(f"GPU buffer registration failed ({type(exc).__name__}: {exc})")
        if buf.device.type == "cuda":
            if self._bounce is None:
                self._bounce = HostMirrors()
            req.io, req.bounce = self._bounce.host_buffer(buf), True
        req.mem, req.devid = "DRAM", 0
        self._registration(req.io, "DRAM", 0)

    # ----------------------------------------------------------------------------- I/O API
    def write(self, buffer: torch.Tensor, extents: Sequence[Extent]) -> Future:
        return self._submit("WRITE", buffer, extents)

    def read(self, buffer: torch.Tensor, extents: Sequence[Extent]) -> Future:
        return self._submit("READ", buffer, extents)

    def _submit(self, op: str, buffer: torch.Tensor, extents: Sequence[Extent]) -> Future:
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"buffer: expected a torch.Tensor, got {type(buffer).__name__}")
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
            raise ValueError(f"buffer: expected a contiguous 1-D uint8 tensor, got "
                             f"{buffer.dtype} shape {tuple(buffer.shape)}")
        size = buffer.numel()
        for i, e in enumerate(extents):
            if e.length < 0 or e.buffer_offset < 0 or e.buffer_offset + e.length > size:
                raise ValueError(f"extents[{i}]: {e} does not fit a buffer of {size} bytes")
            if e.memory:  # in_place_host_memory is False: the tier never sends these
                raise ValueError(f"extents[{i}] carries its own memory; the nixl backend moves "
                                 "only registered buffers (the call's buffer)")
        pieces = io_pieces(extents, self._config.io_threads, self._config.io_chunk_size)
        event = None
        if buffer.device.type == "cuda":
            # The caller's kernels that produce (or still read) the buffer run on its stream.
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(buffer.device))
        req = _Request(op, buffer, list(extents), pieces, event)
        with self._lock:
            if self._closed:
                raise RuntimeError("nixl backend is closed")
            self._queue.put(req)
        return self._poller.wrap(req.future)

    def _call(self, fn: Callable[[], object]):
        call = _Call(fn)
        with self._lock:
            if self._closed:
                raise RuntimeError("nixl backend is closed")
            self._queue.put(call)
        return call.future.result()

    # ----------------------------------------------------------------------------- worker
    def _run(self) -> None:
        inflight: list = []     # (handle, request, piece ids)
        delay = _POLL_MIN_S
        stopping = False
        while not (stopping and not inflight):
            try:
                item = self._queue.get(timeout=delay) if inflight else self._queue.get()
            except queue.Empty:
                item = None
            while item is not None:
                if item is _STOP:
                    stopping = True
                elif isinstance(item, _Call):
                    try:
                        item.future.set_result(item.fn())
                    except BaseException as exc:  # noqa: BLE001 - handed to the caller
                        item.future.set_exception(exc)
                else:
                    try:
                        self._start(item, inflight)
                    except BaseException as exc:  # noqa: BLE001 - a bug must not hang callers
                        log.exception("nixl request failed unexpectedly")
                        if not item.future.done():
                            item.future.set_result(IOOutcome(0, {i: exc for i in range(
                                len(item.extents))}))
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = None
            progressed = self._poll(inflight)
            delay = _POLL_MIN_S if progressed else min(delay * 2, _POLL_MAX_S)
        self._release_all()

    def _start(self, req: _Request, inflight: list) -> None:
        ids = []
        for pid, (idx, piece) in enumerate(req.pieces):
            if piece.file not in self._files:
                self._piece_failed(req, pid, KeyError(f"slab file {piece.file} is not attached"))
            else:
                ids.append(pid)
        if not ids:
            self._maybe_finish(req)
            return
        try:
            if req.event is not None:
                req.event.synchronize()
            self._prepare_memory(req)
            if req.bounce and req.op == "WRITE":
                self._bounce.to_host(req.buffer, [req.pieces[i][1] for i in ids])
        except Exception as exc:  # noqa: BLE001 - every extent of this request fails
            for pid in ids:
                self._piece_failed(req, pid, exc)
            self._maybe_finish(req)
            return
        self._post(req, ids, inflight)

    def _post(self, req: _Request, ids: list[int], inflight: list) -> None:
        handle = None
        try:
            base = req.io.data_ptr()
            local = np.empty((len(ids), 3), dtype=np.uint64)
            remote = np.empty((len(ids), 3), dtype=np.uint64)
            for row, pid in enumerate(ids):
                p = req.pieces[pid][1]
                local[row] = (base + p.buffer_offset, p.length, req.devid)
                remote[row] = (p.file_offset, p.length, self._files[p.file].fd)
            agent = self._agent
            handle = agent.initialize_xfer(req.op, agent.get_xfer_descs(local, req.mem),
                                           agent.get_xfer_descs(remote, "FILE"), agent.name,
                                           backends=[self._plugin])
            state = agent.transfer(handle)
        except Exception as exc:  # noqa: BLE001 - becomes a failure of these pieces
            if handle is not None:
                self._safe(handle.release)
            self._group_failed(req, ids, exc, inflight)
            return
        if state == "PROC":
            inflight.append((handle, req, ids))
        else:
            self._settle(handle, req, ids, state, inflight)

    def _poll(self, inflight: list) -> bool:
        progressed = False
        for item in list(inflight):
            handle, req, ids = item
            try:
                state = self._agent.check_xfer_state(handle)
            except Exception as exc:  # noqa: BLE001
                state = exc
            if state == "PROC":
                continue
            inflight.remove(item)
            progressed = True
            self._settle(handle, req, ids, state, inflight)
        return progressed

    def _settle(self, handle, req: _Request, ids: list[int], state, inflight: list) -> None:
        self._safe(handle.release)
        if state == "DONE":
            req.pending -= len(ids)
            self._maybe_finish(req)
            return
        exc = state if isinstance(state, BaseException) else None
        self._group_failed(req, ids, exc, inflight)

    def _group_failed(self, req: _Request, ids: list[int], exc: BaseException | None,
                      inflight: list) -> None:
        if len(ids) > 1:
            # NIXL reports one state per request: retry each piece alone to find the bad ones.
            for pid in ids:
                self._post(req, [pid], inflight)
            return
        pid = ids[0]
        p = req.pieces[pid][1]
        f = self._files.get(p.file)
        what = (f"NIXL {self._plugin} {req.op} of {p.length} bytes at offset {p.file_offset} "
                f"of {f.path if f else p.file}")
        err = NixlTransferError(f"{what}: " + (f"{type(exc).__name__}: {exc}" if exc is not None
                                                else "transfer state ERR"))
        if exc is not None:
            err.__cause__ = exc
        self._piece_failed(req, pid, err)
        self._maybe_finish(req)

    def _piece_failed(self, req: _Request, pid: int, exc: BaseException) -> None:
        req.errors.setdefault(req.pieces[pid][0], exc)
        req.pending -= 1

    def _maybe_finish(self, req: _Request) -> None:
        if req.pending:
            return
        if req.bounce and req.op == "READ":
            ok = [e for i, e in enumerate(req.extents) if i not in req.errors]
            try:
                self._bounce.from_host(req.io, req.buffer, ok)
            except Exception as exc:  # noqa: BLE001 - the data did not reach the GPU
                for i in range(len(req.extents)):
                    req.errors.setdefault(i, exc)
        nbytes = sum(p.length for i, p in req.pieces if i not in req.errors)
        req.buffer = req.io = None   # drop references before the caller sees the result
        req.future.set_result(IOOutcome(nbytes=nbytes, errors=req.errors))

    # ----------------------------------------------------------------------------- close
    def _release_all(self) -> None:
        for entry in self._mem_regs:
            self._safe(self._agent.deregister_memory, entry[4], backends=[entry[3]])
        self._mem_regs.clear()
        for index in list(self._files):
            self._deregister_file(index)
        self._file_regs.clear()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        self._thread.join()
        if self._bounce is not None:
            self._bounce.clear()
        self._agent = None   # the agent's destructor frees its plugins

    @staticmethod
    def _safe(fn, *args, **kwargs) -> None:
        """Best-effort release during cleanup; a failure there is logged, not raised."""
        try:
            fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            log.debug("NIXL cleanup call %s failed: %s", getattr(fn, "__name__", fn), exc)
