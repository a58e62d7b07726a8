"""The three I/O engines a job can run, all moving the same pages of the same geometry.

- ``gdskv``: the tier's ``put``/``get`` on pages gathered from (scattered into) a KV pool in
  GPU or host memory, as an inference engine would call it.
- ``raw``: the I/O ceiling. One contiguous, already page-first buffer written to and read from
  the store's slab files through the same backend (``backend.write/read`` on the store's
  extents): no gather, no checksum, no directory, no journal. Same fdatasync policy as the tier.
- ``hicachefile``: SGLang's own ``HiCacheFile`` L3 class (one file per page), imported from the
  installed sglang, fed the same pages from a page-first host pool (SGLang's L2 host pool; its
  GPU->host copy is not counted, which favours it).

Each engine serves ``numjobs`` threads; thread ``t`` owns pages ``0..pages-1`` of its own pool.
Batches are runs of consecutive page numbers; ``loc`` maps a page number to where it sits (pool
position for gdskv/hicachefile, store slot for raw), shuffled for the ``rand*`` modes.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import glob
import hashlib
import importlib
import importlib.metadata
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gdskv.backends.memory_files import wait_registered
from gdskv.config import SyncPolicy, TierConfig
from gdskv.layout import ALIGNMENT, KVLayout
from gdskv.memory import alloc_host
from gdskv.streams import OnStream

from .cache import drop_page_cache

HICACHE_MODULE = "sglang.srt.mem_cache.hicache_storage"


class EngineUnavailable(RuntimeError):
    """The engine cannot run here (e.g. sglang not importable); the message says why."""


@dataclass
class EngineSpec:
    """What an engine needs to know about the job."""
    name: str                    # job name (keys and file names derive from it)
    layout: KVLayout
    config: TierConfig           # directories, backend, O_DIRECT, sync... (raw uses it too)
    device: torch.device         # where the KV pool lives
    threads: int
    pages: int                   # pages per thread
    seed: int
    randomize: bool              # rand* modes: shuffled page locations
    verify: bool                 # keep written bytes apart from read ones to compare them
    batch_pages: int = 1         # pages per batch (raw warms its per-batch buffers with it)
    raw_io: str = "pool"         # raw: "pool" (the backend's threads) or "caller" (see run)


def page_keys(job: str, thread: int, pages: Sequence[int]) -> list[str]:
    """Keys shaped like SGLang's (SHA-256 hex), distinct per job, thread and page."""
    return [hashlib.sha256(f"{job}/{thread}/{p}".encode()).hexdigest() for p in pages]


def _random_bytes(t: torch.Tensor, seed: int) -> None:
    """Fill a tensor's bytes with random data (incompressible, distinct per page), generated
    where the tensor lives (no host round trip for GPU pools)."""
    b = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    gen = torch.Generator(device=b.device)
    gen.manual_seed(seed)
    b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen, device=b.device))


def _locations(spec: EngineSpec, thread: int) -> np.ndarray:
    if not spec.randomize:
        return np.arange(spec.pages, dtype=np.int64)
    return np.random.default_rng(spec.seed * 1000 + thread).permutation(spec.pages)


def _gpu_aligned(nbytes: int, device: torch.device) -> torch.Tensor:
    raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, device=device)
    skew = (-raw.data_ptr()) % ALIGNMENT
    return raw[skew:skew + nbytes]


def _buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    return alloc_host(nbytes) if device.type == "cpu" else _gpu_aligned(nbytes, device)


def _settle(device: torch.device) -> None:
    """Finish the GPU work queued on the default stream (pool fills) before timed calls."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mismatched_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per leading index: does any byte differ? (``a``/``b``: [n, ...])."""
    return (a.reshape(a.shape[0], -1) != b.reshape(b.shape[0], -1)).any(dim=1)


class Engine(abc.ABC):
    name = "?"

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.loc = [_locations(spec, t) for t in range(spec.threads)]

    @abc.abstractmethod
    def open(self) -> None:
        """Create or attach the storage (untimed)."""

    def write(self, thread: int, pages: Sequence[int]) -> int:
        """Store these pages; returns how many were stored."""
        return self.run("write", self.call_args("write", thread, pages))

    def read(self, thread: int, pages: Sequence[int]) -> int:
        """Load these pages; returns how many were loaded."""
        return self.run("read", self.call_args("read", thread, pages))

    @abc.abstractmethod
    def call_args(self, op: str, thread: int, pages: Sequence[int]) -> tuple:
        """What one call of ``op`` ("write"/"read") needs that an engine hands over already
        made (page keys, token slot indices, file extents), made here, before the runner
        starts the clock: clat times the storage call, for every engine alike."""

    @abc.abstractmethod
    def run(self, op: str, args: tuple) -> int:
        """The timed call, on :meth:`call_args`' result; returns the pages done."""

    def forget(self, thread: int, pages: Sequence[int]) -> None:
        """Make the next write of these pages a real write (engines skip stored keys)."""

    def files(self) -> list[str]:
        """Files holding the data (for dropping their page cache, and for tests)."""
        return []

    def invalidate(self, machine_wide: bool = False) -> dict[str, Any]:
        """Drop the page cache of this engine's files (and the machine's, when asked)."""
        return drop_page_cache(self.files(), machine_wide=machine_wide)

    @abc.abstractmethod
    def verify(self, thread: int, pages: Sequence[int]) -> int:
        """How many of ``pages`` (read since the last write) differ from what was written."""

    def info(self) -> dict[str, Any]:
        return {}

    def close(self) -> None: ...


# -- gdskv --------------------------------------------------------------------------------------

class GdskvEngine(Engine):
    name = "gdskv"

    def open(self) -> None:
        from gdskv.tier import Tier

        s, lay = self.spec, self.spec.layout
        # One KV pool that every thread's calls use, each thread its own pages of it, as an
        # engine's transfer threads share the engine's one pool (calls in flight on one pool
        # can be combined: gdskv.call_combiner).
        slots = s.pages * lay.page_size * s.threads
        shape = (lay.num_layers, slots, lay.kv_heads, lay.head_dim)
        parts = [torch.empty(shape, dtype=lay.torch_dtype, device=s.device)
                 for _ in range(lay.kv_count)]
        for i, p in enumerate(parts):
            _random_bytes(p, s.seed * 2 + i)
        self.src = [parts] * s.threads
        self.dst = [[torch.zeros_like(p) for p in parts] if s.verify else parts] * s.threads
        self.tier = Tier(lay, s.config, device=s.device)
        # a store held in memory registers its files for GPU copies once, on its own thread
        # (gdskv.backends.memory_files): the timed phase is the open tier's steady state
        self.memory_files = wait_registered(self.tier)
        self._local = threading.local()
        # Token slots of every page, made once: an engine hands the tier indices it already
        # has, so building them is not part of a timed call. Thread t's pages are rows
        # t * pages ... of the shared pool.
        offsets = torch.arange(lay.page_size, dtype=torch.int64)
        self.slot_table = [(torch.as_tensor(loc, dtype=torch.int64)[:, None] + t * s.pages)
                           * lay.page_size + offsets[None, :] for t, loc in enumerate(self.loc)]
        _settle(s.device)  # the pools were filled on the default stream; calls use their own
        self._warm_up()

    def _warm_up(self) -> None:
        """One untimed spill and restore of a batch (then forgotten), as raw warms its buffers:
        a process's first tier call costs ~50 ms more on an H100 (measured by
        bench/experiments/call_profile.py), which a 16-call job would otherwise count against
        the steady state."""
        pages = range(min(self.spec.batch_pages, self.spec.pages))
        keys = [f"warm-up/{p}" for p in pages]
        with self._engine_stream():
            self.tier.put(keys, self._pool(self.src[0]), self._slots(0, pages))
            self.tier.get(keys, self._pool(self.src[0]), self._slots(0, pages))  # same bytes
        self.tier.evict(keys)
        _settle(self.spec.device)

    def _pool(self, parts: list[torch.Tensor]):
        return parts[0] if self.spec.layout.mla else (parts[0], parts[1])

    def _slots(self, thread: int, pages: Sequence[int]) -> torch.Tensor:
        table, first = self.slot_table[thread], pages[0]
        if isinstance(pages, range) and pages.step == 1 or \
                list(pages) == list(range(first, first + len(pages))):  # a run: a view
            return table[first:first + len(pages)].reshape(-1)
        return table[torch.as_tensor(np.asarray(pages), dtype=torch.int64)].reshape(-1)

    def _engine_stream(self):
        """The calling thread's own CUDA stream, as an inference engine's KV-transfer thread
        has: a call made from the legacy default stream is ordered after every blocking
        stream's work, kvikio's compat-mode copies for the other calls in flight included."""
        if self.spec.device.type != "cuda":
            return contextlib.nullcontext()
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(self.spec.device)
        # (gdskv's cheap stream switch: an engine's transfer thread sets its stream once, and
        # torch.cuda.stream's per-entry device lookups would be timed against gdskv, not raw)
        return OnStream(stream)

    def _stay_on_engine_stream(self) -> None:
        """Make the calling thread's own stream current and leave it so: an engine's transfer
        thread sets its stream once, not around every call (the switch is not the tier's)."""
        if self.spec.device.type == "cuda" and not getattr(self._local, "staying", False):
            self._engine_stream().__enter__()  # never left: this thread works on it from now
            self._local.staying = True

    def call_args(self, op: str, thread: int, pages: Sequence[int]) -> tuple:
        self._stay_on_engine_stream()  # once per thread, untimed
        pool = self.src[thread] if op == "write" else self.dst[thread]
        return (page_keys(self.spec.name, thread, pages), self._pool(pool),
                self._slots(thread, pages))

    def run(self, op: str, args: tuple) -> int:
        # on the thread's own stream already (call_args): an engine's transfer thread
        ok = self.tier.put(*args) if op == "write" else self.tier.get(*args)
        return sum(ok)

    def forget(self, thread: int, pages: Sequence[int]) -> None:
        self.tier.evict(page_keys(self.spec.name, thread, pages))

    def files(self) -> list[str]:
        return [f.path for f in self.tier.store.files]

    def verify(self, thread: int, pages: Sequence[int]) -> int:
        if not self.spec.verify:
            raise RuntimeError("verify was not asked for at open()")
        bad = 0
        pt = self.spec.layout.page_size
        for i in range(0, len(pages), 64):
            chunk = list(pages[i:i + 64])
            idx = self._slots(thread, chunk).to(self.spec.device)
            diff = torch.zeros(len(chunk), dtype=torch.bool, device=self.spec.device)
            for a, b in zip(self.src[thread], self.dst[thread]):
                # [layers, pages*pt, ...] -> per page: any byte different in any layer
                x = a.index_select(1, idx).view(torch.uint8).transpose(0, 1)
                y = b.index_select(1, idx).view(torch.uint8).transpose(0, 1)
                diff |= _mismatched_rows(x.reshape(len(chunk), pt, -1),
                                         y.reshape(len(chunk), pt, -1))
            bad += int(diff.sum())
        return bad

    def reset_read_buffers(self) -> None:
        if self.spec.verify:
            for parts in self.dst:
                for p in parts:
                    p.zero_()
            _settle(self.spec.device)

    def info(self) -> dict[str, Any]:
        st = self.tier.stats()
        detail = st.get("backend_detail", {}) or {}
        return {"backend": st.get("backend"), "gpu_direct": bool(st.get("gpu_direct")),
                "compat_mode": detail.get("compat_mode", "n/a"),
                "backend_detail": detail,
                "backend_selected_because": st.get("backend_selected_because", ""),
                "o_direct": bool(st.get("o_direct")), "o_direct_reason": st.get("o_direct_reason"),
                "page_engine": st.get("page_engine"),
                "page_engine_detail": st.get("page_engine_detail", {}),
                "tier_stats": {k: v for k, v in st.items() if isinstance(v, (int, float))
                               and not isinstance(v, bool)}}

    def close(self) -> None:
        tier = getattr(self, "tier", None)
        if tier is not None:
            tier.close()


# -- raw ----------------------------------------------------------------------------------------

class RawEngine(Engine):
    name = "raw"

    def open(self) -> None:
        from gdskv.backends import create_backend
        from gdskv.store import SlabStore

        s, lay = self.spec, self.spec.layout
        sb = lay.slot_bytes
        self.src, self.dst = [], []
        for t in range(s.threads):
            buf = _buffer(s.pages * sb, s.device)
            self.src.append(buf)
            self.dst.append(_buffer(s.pages * sb, s.device) if s.verify else buf)
        self.store = SlabStore(lay, s.config)
        if self.store.num_slots < s.threads * s.pages:
            raise RuntimeError(f"store has {self.store.num_slots} slots, the job needs "
                               f"{s.threads * s.pages}")
        try:
            self.backend = create_backend(s.config, s.device)
            self.backend.attach(self.store.files)
        except BaseException:
            self.store.close()
            raise
        self.sync = s.config.sync == SyncPolicy.DATA
        if s.device.type == "cuda":
            # Backends that bounce GPU memory through pinned host mirrors make one per buffer
            # slice on first use; make them now (an untimed read pass of the still-unwritten,
            # preallocated slots) so the timed phases do not pay for cudaHostAlloc.
            for t in range(s.threads):
                for first in range(0, s.pages, s.batch_pages):
                    pages = list(range(first, min(first + s.batch_pages, s.pages)))
                    self._io("read", t, pages, into=self.src)
                    if s.verify:
                        self._io("read", t, pages, into=self.dst)
        for t in range(s.threads):
            _random_bytes(self.src[t], s.seed + t)
            if s.verify:
                self.dst[t].zero_()

    def _io(self, op: str, thread: int, pages: Sequence[int], into=None) -> int:
        return self.run(op, self.call_args(op, thread, pages, into))

    def call_args(self, op: str, thread: int, pages: Sequence[int], into=None) -> tuple:
        sb = self.spec.layout.slot_bytes
        first, n = pages[0], len(pages)
        assert list(pages) == list(range(first, first + n)), "raw batches are page runs"
        base = thread * self.spec.pages
        extents = self.store.extents([base + int(x) for x in self.loc[thread][first:first + n]])
        bufs = into if into is not None else (self.src if op == "write" else self.dst)
        return n, bufs[thread][first * sb:(first + n) * sb], extents

    def run(self, op: str, args: tuple) -> int:
        n, buf, extents = args
        sb = self.spec.layout.slot_bytes
        # "caller": what gdskv's io_on_caller does, the same backend call, so that gdskv can be
        # compared with raw on the same path as well as with raw through the pool
        outcome = self.backend.start(op, buf, extents,
                                     on_caller=self.spec.raw_io == "caller").result()
        if outcome.errors:
            failed = set()
            for idx in outcome.errors:
                e = extents[idx]
                failed.update(range(e.buffer_offset // sb, (e.buffer_offset + e.length) // sb))
            return n - len(failed)
        if op == "write" and self.sync:  # the tier's durability, so the comparison is fair
            for f in {e.file for e in extents}:
                os.fdatasync(self.store.files[f].fd)
        return n

    def files(self) -> list[str]:
        return [f.path for f in self.store.files]

    def verify(self, thread: int, pages: Sequence[int]) -> int:
        sb = self.spec.layout.slot_bytes
        pb = self.spec.layout.page_bytes
        idx = torch.as_tensor(np.asarray(pages), dtype=torch.int64, device=self.spec.device)
        a = self.src[thread].view(-1, sb).index_select(0, idx)[:, :pb]
        b = self.dst[thread].view(-1, sb).index_select(0, idx)[:, :pb]
        return int(_mismatched_rows(a, b).sum())

    def reset_read_buffers(self) -> None:
        if self.spec.verify:
            for d in self.dst:
                d.zero_()

    def info(self) -> dict[str, Any]:
        d = self.backend.describe()
        return {"backend": self.backend.name, "gpu_direct": bool(self.backend.gpu_direct),
                "compat_mode": d.get("compat_mode", "n/a"), "backend_detail": d,
                "backend_selected_because": getattr(self.backend, "selected_because", ""),
                "o_direct": bool(self.store.direct), "o_direct_reason": self.store.direct_reason}

    def close(self) -> None:
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.close()
        store = getattr(self, "store", None)
        if store is not None:
            store.close()


# -- SGLang HiCacheFile ------------------------------------------------------------------------

def sglang_hicache():
    """SGLang's hicache_storage module, or EngineUnavailable saying why it cannot be used."""
    try:
        return importlib.import_module(HICACHE_MODULE)
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available here"
        raise EngineUnavailable(
            f"ioengine=hicachefile needs SGLang's {HICACHE_MODULE} (HiCacheFile), which does not "
            f"import here: {type(exc).__name__}: {exc}. Install sglang (e.g. pip install "
            "--no-deps sglang plus what its import asks for) or use ioengine=gdskv|raw") from None


def sglang_version() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _storage_config(mod, layout: KVLayout):
    """HiCacheStorageConfig for one unsharded model, whatever fields this sglang version has."""
    cls = mod.HiCacheStorageConfig
    known = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                 is_mla_model=layout.mla, is_page_first_layout=True,
                 model_name=layout.model_name or "gdskv-bench", extra_config=None)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in known:
            kwargs[f.name] = known[f.name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kwargs[f.name] = 1 if f.name.endswith("_size") else (0 if f.name.endswith("_rank")
                                                                 else None)
    return cls(**kwargs)


class HiCacheFileEngine(Engine):
    name = "hicachefile"

    def open(self) -> None:
        mod = sglang_hicache()
        s, lay = self.spec, self.spec.layout
        self.path = os.path.join(s.config.directories[0], "hicache")
        os.makedirs(self.path, exist_ok=True)
        self.hc = mod.HiCacheFile(_storage_config(mod, lay), file_path=self.path)
        self.path = getattr(self.hc, "file_path", self.path)
        # SGLang's L2 host pool holds pages page-first; HiCacheFile writes one page per file.
        self.src, self.dst = [], []
        for t in range(s.threads):
            pool = alloc_host(s.pages * lay.page_bytes).view(s.pages, lay.page_bytes)
            _random_bytes(pool, s.seed + t)
            self.src.append(pool)
            if s.verify:
                dst = alloc_host(s.pages * lay.page_bytes).view(s.pages, lay.page_bytes)
                dst.zero_()
                self.dst.append(dst)
            else:
                self.dst.append(pool)

    def call_args(self, op: str, thread: int, pages: Sequence[int]) -> tuple:
        loc = self.loc[thread]
        pool = self.src[thread] if op == "write" else self.dst[thread]
        return page_keys(self.spec.name, thread, pages), [pool[int(loc[p])] for p in pages]

    def run(self, op: str, args: tuple) -> int:
        keys, pages = args
        if op == "write":
            # batch_set answers for the whole batch; on failure count what actually landed.
            if self.hc.batch_set(keys, pages):
                return len(keys)
            return sum(bool(self.hc.exists(k)) for k in keys)
        return self._got(self.hc.batch_get(keys, pages), pages)

    @staticmethod
    def _got(got, targets) -> int:
        """Pages batch_get found (copied into their targets where it returned new tensors)."""
        n = 0
        for out, target in zip(got, targets):
            if out is None:
                continue
            if out.data_ptr() != target.data_ptr():  # versions that return a fresh tensor
                target.copy_(out.view(torch.uint8).reshape(-1)[:target.numel()])
            n += 1
        return n

    def forget(self, thread: int, pages: Sequence[int]) -> None:
        for f in self._page_files(page_keys(self.spec.name, thread, pages)):
            os.unlink(f)

    def _page_files(self, keys: Sequence[str]) -> list[str]:
        out = []
        for k in keys:
            out += glob.glob(os.path.join(glob.escape(self.path), glob.escape(k) + "*"))
        return out

    def files(self) -> list[str]:
        return [os.path.join(self.path, f) for f in os.listdir(self.path)]

    def verify(self, thread: int, pages: Sequence[int]) -> int:
        idx = torch.as_tensor(self.loc[thread][np.asarray(pages)], dtype=torch.int64)
        return int(_mismatched_rows(self.src[thread].index_select(0, idx),
                                    self.dst[thread].index_select(0, idx)).sum())

    def reset_read_buffers(self) -> None:
        if self.spec.verify:
            for d in self.dst:
                d.zero_()

    def info(self) -> dict[str, Any]:
        return {"backend": f"sglang-{sglang_version()} HiCacheFile", "gpu_direct": False,
                "compat_mode": "n/a", "o_direct": False,
                "o_direct_reason": "HiCacheFile writes and reads through the page cache",
                "backend_detail": {"class": f"{HICACHE_MODULE}.HiCacheFile",
                                   "sglang_version": sglang_version(), "file_path": self.path,
                                   "files": "one per page"},
                "note": "hicachefile: SGLang's own HiCacheFile (one file per page) fed from a "
                        "page-first host pool; its GPU->host copy is not counted"}

    def close(self) -> None:
        hc = getattr(self, "hc", None)
        if hc is not None and hasattr(hc, "close"):
            try:
                hc.close()
            except Exception:  # noqa: BLE001 - closing a baseline must not hide the results
                pass


ENGINES = {"gdskv": GdskvEngine, "raw": RawEngine, "hicachefile": HiCacheFileEngine}


def make_engine(kind: str, spec: EngineSpec) -> Engine:
    if kind not in ENGINES:
        raise ValueError(f"unknown ioengine {kind!r}; known: {', '.join(ENGINES)}")
    return ENGINES[kind](spec)
