"""The tier: spill KV pages from an engine pool to the slab store and restore them.

Spill (``put``): reserve slots in the directory -> gather pages into one part of the staging
buffer -> checksum -> ``backend.write`` -> (fdatasync per sync policy) -> journal COMMIT ->
directory READY. The staging buffer has ``pipeline_depth`` parts (:mod:`.staging`): while the
others' writes are in flight the next chunk is gathered into a free part.

Restore (``get``): pin READY pages -> ``backend.read`` chunks into the staging parts -> verify
checksums -> scatter into the engine's slots -> unpin. While one chunk is scattered the next is
read. A page that is missing, fails I/O or fails its checksum is a miss (``False``), never an
exception and never wrong bytes; one that could not be read is dropped (journaled as evicted),
so existence checks answer miss and no engine loads it again and again: at once when the
failure lasts (a checksum mismatch, a slab that ends early, a file gone), after
``READ_RETRIES`` more reads in the call for an error that may pass (EIO).

Data calls from several threads run concurrently and share the staging parts (``put_async`` /
``get_async`` run on ``pipeline_depth`` workers): one call's fixed costs (fdatasync, journal,
verification, Python) overlap the others' I/O. A call that finds no free part first waits for
its own oldest I/O (a restore finishes that chunk; a spill waits for the write, which frees
its part, and commits it once its next write is under way), so calls never wait on each other
in a cycle. Follower catch-up, ``clear`` and ``close`` wait for the calls in flight and run
alone.

Small calls (``config.io_on_caller``): a call of one chunk, whose I/O the backend's pool would
run on one thread anyway, moves its bytes on the calling thread (``Backend.move_on_caller``,
the GIL released): the hand-off to a pool thread and back cost a 1-page call more than all of
gdskv's own work the read or write hid (bench/RESULTS.md, "Small calls' I/O on the calling
thread"). Calls of several chunks keep the pipeline above.

Read-only followers (``config.read_only``): a tier in another process over a store some writer
tier owns (e.g. the non-writing TP ranks of an MLA model). It takes no lock and writes nothing:
puts return False, evict/clear only forget pages locally. Before each read call it catches up
with the writer's journal (at most every ``FOLLOW_INTERVAL`` s: one ``stat`` and a read of the
new bytes; the whole journal again after the writer compacted it). A slot the writer reuses
while a follower still maps it to the old page fails its checksum on read and is a miss, which
is why followers must verify.

Host regions in place: on a tier staging in host memory, ``put_pages``/``get_pages`` move
pages whose regions allow it straight between the caller's memory and the files, without the
staging copy (:mod:`.host_pages`); the other pages of the call go through staging. Everything
else (slots, trailers, journal, sync, commit, pins, verification, stats) is the same path.

Beside the data path: the directory and its journal (recovery, compaction, follower catch-up)
are :mod:`.persistence`; the call gate :mod:`.call_gate`; the admission filter
:mod:`.admission`; the validated-pool cache :mod:`.pool`; the staging parts :mod:`.staging`.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from . import checksum, native
from . import kernels as kd
from .admission import AdmissionFilter
from .backends import backend_class, create_backend
from .backends.base import Extent, IOOutcome, ShortIOError
from .call_gate import CallGate
from .config import ConfigError, SyncPolicy, TierConfig
from .copiers import DeferredCopier, PageCopier, PoolCopier, RegionCopier
from .directory import PageDirectory, PageState
from .gpu_spill import GpuSpill
from .gpu_verdicts import GpuVerdicts, VerdictBuffers
from .host_pages import HostPagePath, InPlacePages
from .journal import Encoded, Journal, JournalFollower, check_key
from .ledger import CallLedger
from .log_once import LogOnce
from . import slot_trailer
from .layout import FORMAT_VERSION, BytePageLayout, KVLayout, PageLayout
from .memory import check_device, cuda_available
from .metrics import TierMetrics
from .persistence import PersistentDirectory
from .pool import KVPool, PoolCache
from .staging import StagingParts, staging_part_pages
from .streams import CallStream
from .stats import TierStats
from .store import SlabStore, StoreError

log = logging.getLogger("gdskv.tier")

#: where a pending write's future sits in the entry :meth:`Tier._writing` makes
_FUT = 4
#: page states as plain ints (an enum member lookup costs a put's loop more)
_FREE, _WRITING, _READY = int(PageState.FREE), int(PageState.WRITING), int(PageState.READY)
#: a read failing with these will fail again: the file is gone (a truncated one, a short read
#: that found its end, is the other lasting case)
_GONE = frozenset({errno.ENOENT, errno.ESTALE, errno.ENXIO, errno.ENODEV})


def _may_read_later(exc: BaseException) -> bool:
    """Whether a read that failed with ``exc`` may succeed if tried again
    (:meth:`Tier._read_again`): an I/O error (EIO, a NIXL transfer error), not a file that
    ended or is gone. Not an ``OSError`` (a fault of this process, e.g. a CUDA copy's): not
    tried again, nor dropped."""
    if not isinstance(exc, OSError):
        return False
    if isinstance(exc, ShortIOError) and exc.errno is None:
        return False
    return exc.errno not in _GONE


def _refuse_shared_regions(starts: list[int], sizes: list[int], pages) -> None:
    """ValueError if two of a restore's regions (their addresses ``starts`` and ``sizes``,
    in call order; none empty) share memory: the page read last would overwrite the other's
    bytes, and both would report a hit. Sorted by address, any overlap shows between
    neighbours: one numpy pass, no loop over pages. (Host and device memory never share
    addresses: CUDA's unified virtual addressing keeps them apart in one process.)"""
    start = np.array(starts, dtype=np.int64)
    order = np.argsort(start, kind="stable")
    start = start[order]
    end = start + np.array(sizes, dtype=np.int64)[order]
    hit = np.flatnonzero(start[1:] < end[:-1])
    if not hit.size:
        return
    page_of = [i for i, regions in enumerate(pages) for r in regions if r.numel()]
    p, q = sorted((page_of[order[hit[0]]], page_of[order[hit[0] + 1]]))
    where = f"page {p}'s regions overlap" if p == q else \
        f"the regions of pages {p} and {q} share memory"
    raise ValueError(f"get_pages: {where}; each page restored needs memory of its own, or one "
                     "page's bytes would land in another's")


class _HeldPart:
    """A staging part a spill's write holds until the write ends. It is given back once, by
    whichever comes first: the write's done-callback (a backend thread may run that after it
    has woken the waiters) or the call that waited for the write. (It holds no reference to
    the write's future, whose callback holds it: no reference cycle for the collector.)"""

    __slots__ = ("_part",)

    def __init__(self, part: int) -> None:
        self._part = [part]

    @property
    def out(self) -> bool:
        return bool(self._part)

    def give_back(self, staging: StagingParts) -> None:
        try:
            i = self._part.pop()  # (one call of list.pop: of two racing callers, one gets it)
        except IndexError:
            return
        staging.give_back(i)


class TierClosedError(RuntimeError):
    """A call on a tier after :meth:`Tier.close`."""


class Tier:
    """A KV page tier over one slab store. Thread-safe; data calls from several threads overlap.

    Args:
        layout: what this tier stores (must match an existing store's): a :class:`KVLayout`
            (KV pages: every data call) or a :class:`BytePageLayout` (opaque byte pages:
            ``put_pages`` / ``get_pages`` only).
        config: settings; ``None`` reads ``GDSKV_*`` from the environment.
        device: where staging lives: the engine pool's device. Default: the current CUDA
            device if there is one, else CPU.
        scan_headers: rebuild the directory from the slot trailers too, even when the journal
            looks whole (``gdskv rebuild``; it happens by itself when the journal is damaged).
        scan_progress: called with the number of slots scanned as a header scan goes (from
            its reading threads).
        metrics_registry: the Prometheus registry for this tier's ``gdskv_*`` series
            (:mod:`.metrics`); None: prometheus_client's default registry.
    """

    #: seconds between a read-only follower's journal catch-ups (see :meth:`refresh`)
    FOLLOW_INTERVAL = 0.05
    #: times a read that failed for a reason that may pass (EIO) is tried again, at once,
    #: before its pages are dropped (:meth:`_read_again`)
    READ_RETRIES = 2

    def __init__(self, layout: PageLayout, config: TierConfig | None = None, *,
                 device: torch.device | str | None = None, scan_headers: bool = False,
                 scan_progress: Callable[[int], None] | None = None,
                 metrics_registry=None) -> None:
        if not isinstance(layout, (KVLayout, BytePageLayout)):
            raise TypeError(f"layout must be a KVLayout or BytePageLayout, got "
                            f"{type(layout).__name__}")
        self.layout = layout
        self.config = config if config is not None else TierConfig.from_env()
        if self.config.cluster:
            raise ConfigError("cluster=true: a Tier opens one store; open a cluster store with "
                              "gdskv.open_tier(layout, config) or gdskv.cluster.ClusterStore")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if cuda_available() \
                else torch.device("cpu")
        self.device = check_device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        depth = self.config.pipeline_depth
        self._chunk_pages = staging_part_pages(self.config.staging_size // depth, layout)
        if self._chunk_pages < 1:
            raise ConfigError(f"staging_size {self.config.staging_size} B must hold one page "
                              f"slot per pipeline stage ({depth} x {layout.slot_bytes} B for "
                              f"this layout and pipeline_depth)")
        self._closed = True
        self._sync_data = self.config.sync == SyncPolicy.DATA  # (an enum lookup less per write)
        self._io_on_caller = bool(self.config.io_on_caller)
        self._stats = TierStats()
        self._log_once = LogOnce(log)  # one line per kind of failure
        self.read_only = bool(self.config.read_only)
        #: why puts are refused now ("" while they are not): a store file removed under us
        self._lost = ""
        part_bytes = self._chunk_pages * layout.slot_bytes
        # refused before the store is touched: a bad option changes nothing on disk
        StagingParts.check_fits(part_bytes * depth, self.device)
        backend_class(self.config, self.device)
        self._persist: PersistentDirectory | None = None
        self.backend = None
        self._host_pages: HostPagePath | None = None
        self._worker: ThreadPoolExecutor | None = None
        self.store = SlabStore(layout, self.config)
        try:  # whatever fails from here releases all it acquired: lock, files, threads
            # host page I/O and checksums: the native page engine, or the Python path
            self._engine = native.engine(self.config.native)
            self._checksums = checksum.default_for(self.device, layout, self._engine)
            self._gpu_checks: tuple = (None, False)  # (checksummer, _gpu_checked's answer)
            # pages are verified with the algorithm that made their checksum (see checksum.py)
            self._verifiers = {self._checksums.algorithm: self._checksums}
            # per thread: its VerdictBuffers ("buffers"), engine event for synchronous calls
            # ("engine") and pinned slot-trailer buffer ("trailers")
            self._per_thread = threading.local()
            self._persist = PersistentDirectory(self.store, self.config, self._stats,
                                                self._log_once, scan_headers=scan_headers,
                                                scan_progress=scan_progress)
            self._followed_at = time.monotonic()
            self.backend = create_backend(self.config, self.device)
            self.backend.attach(self.store.files)
            self._host_pages = HostPagePath(
                layout, self._in_place_why_not(),
                any(f.direct for f in self.store.files) or bool(self._direct_io()[0]),
                self.config.io_threads, self._engine)
            self._staging = StagingParts(part_bytes, depth, self.device)
            # Asynchronous calls gather/scatter on the tier's own stream, so the engine's stream
            # is never blocked behind their I/O; the tier stream waits only for the engine work
            # issued before a call. A synchronous call (its caller waits for it anyway) runs
            # on the caller's own stream where it can (:class:`CallStream`).
            self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
            if self._stream is not None:
                self._warm_up_kernels()
                self._warm_up_backend()
            self._gate = CallGate()
            self._worker = ThreadPoolExecutor(depth, thread_name_prefix="gdskv-tier")
            self._admission = AdmissionFilter(self.config.admit_after, self._stored,
                                              max_tracked=4 * self.store.num_slots)
            self._pools = PoolCache(layout)
        except BaseException:
            self._release()
            raise
        self._closed = False
        o_direct, o_direct_reason = self._direct_io()
        self._metrics = TierMetrics(self.store.directories[0] + ("#follower" if self.read_only
                                                                  else ""),
                                    self.store.num_slots, layout.page_bytes, metrics_registry)
        self._stats.listener = self._metrics.count
        # each data call's counters and metrics, applied off its critical path
        self._ledger_counts: dict = {}  # calls' counters applied, not yet added (ledger flush)
        self._ledger = CallLedger(self._apply_counts, flush=self._flush_counts)
        self._metrics.settle_on_scrape(self._ledger, lambda: len(self.directory))
        if not o_direct:
            self._metrics.fallback("o_direct", o_direct_reason)
        if self.device.type == "cuda" and not self.backend.gpu_direct:
            self._metrics.fallback("gpu_direct", f"{self.backend.name}: bytes bounce through "
                                   "host memory (compat mode or no GPUDirect Storage)")
        log.info("gdskv tier%s: %d slots of %d B in %s; backend %s; O_DIRECT %s (%s)",
                 " (read-only follower)" if self.read_only else "", self.store.num_slots,
                 layout.slot_bytes, ", ".join(self.store.directories),
                 self.backend.name, "on" if o_direct else "off", o_direct_reason)

    @classmethod
    def from_env(cls, layout: PageLayout, *, device=None, **overrides) -> "Tier":
        return cls(layout, TierConfig.from_env(**overrides), device=device)

    @property
    def directory(self) -> PageDirectory:
        """Where each page is (a follower's is replaced when the writer compacts)."""
        return self._persist.directory

    @property
    def journal(self) -> Journal | JournalFollower:
        return self._persist.journal

    # -- public API -----------------------------------------------------------------------------
    def put(self, keys: Sequence[Hashable], kv_pool, token_slots) -> list[bool]:
        """Store pages (gathered from ``kv_pool`` at ``token_slots``) under ``keys``.

        Returns per page whether it is stored: True means readable, and durable as the sync
        policy says (``sync``). A key already stored is True without a write; a key another call
        is writing now gets that write's outcome (this call waits for it, after its own
        writes); a key being evicted while a reader holds it is False.
        """
        self._check_open()
        if self.read_only or self._lost:
            return self._refuse_put(keys)
        keys, fill = self._pool_copier(keys, kv_pool, token_slots, kd.gather_pages)
        return self._run(self._put, keys, fill, op="put")

    def get(self, keys: Sequence[Hashable], kv_pool, token_slots) -> list[bool]:
        """Restore pages into ``kv_pool`` at ``token_slots``; per-page hit (True) or miss."""
        self._check_open()
        self._refuse_byte_pages()
        keys = self._check_keys(keys)
        # The pool and slot checks run while the call's first read is under way (host work
        # the read hides); a bad argument still raises before anything reaches the pool.
        drain = DeferredCopier(lambda: self._copier_for(keys, kv_pool, token_slots,
                                                        kd.scatter_pages))
        return self._run(self._get, keys, drain, op="get")

    def put_async(self, keys, kv_pool, token_slots) -> Future:
        self._check_open()
        if self.read_only or self._lost:
            fut: Future = Future()
            fut.set_result(self._refuse_put(keys))
            return fut
        keys, fill = self._pool_copier(keys, kv_pool, token_slots, kd.gather_pages)
        return self._worker.submit(self._run, self._put, keys, fill, self._engine_event(),
                                   op="put")

    def get_async(self, keys, kv_pool, token_slots) -> Future:
        self._check_open()
        keys, drain = self._pool_copier(keys, kv_pool, token_slots, kd.scatter_pages)
        return self._worker.submit(self._run, self._get, keys, drain, self._engine_event(),
                                   op="get")

    def put_pages(self, keys: Sequence[Hashable], pages: Sequence[Sequence[torch.Tensor]]
                  ) -> list[bool]:
        """Store pages given as page-format byte regions: ``pages[i]`` is a list of 1-D uint8
        tensors whose concatenation is page i's payload (``layout.page_bytes``). The only way
        in for a :class:`BytePageLayout` tier.

        On a tier staging in host memory, host regions are written in place where they allow
        it (4 KiB aligned under O_DIRECT: see :mod:`gdskv.host_pages`), else through staging."""
        self._check_open()
        if self.read_only or self._lost:
            return self._refuse_put(keys)
        keys, parts = self._region_calls(keys, pages, to_staging=True)
        return self._run_parts(self._put, keys, parts)

    def get_pages(self, keys: Sequence[Hashable], pages: Sequence[Sequence[torch.Tensor]]
                  ) -> list[bool]:
        """Restore pages into page-format byte regions (see :meth:`put_pages`); per page a
        hit (True) or a miss. The regions of a missed page hold undefined bytes afterwards
        (a read in place may have landed part of the page there): never use them."""
        self._check_open()
        keys, parts = self._region_calls(keys, pages, to_staging=False)
        return self._run_parts(self._get, keys, parts)

    def put_pages_async(self, keys: Sequence[Hashable],
                        pages: Sequence[Sequence[torch.Tensor]]) -> Future:
        """:meth:`put_pages` on the tier's workers; the regions are checked here, now (a bad
        one raises in the caller), and must stay untouched until the future is done."""
        self._check_open()
        if self.read_only or self._lost:
            fut: Future = Future()
            fut.set_result(self._refuse_put(keys))
            return fut
        keys, parts = self._region_calls(keys, pages, to_staging=True)
        return self._worker.submit(self._run_parts, self._put, keys, parts, self._engine_event())

    def get_pages_async(self, keys: Sequence[Hashable],
                        pages: Sequence[Sequence[torch.Tensor]]) -> Future:
        """:meth:`get_pages` on the tier's workers (see :meth:`put_pages_async`)."""
        self._check_open()
        keys, parts = self._region_calls(keys, pages, to_staging=False)
        return self._worker.submit(self._run_parts, self._get, keys, parts, self._engine_event())

    def pin(self, keys: Sequence[Hashable]) -> list[int | None]:
        """Hold stored pages for a later read: per key a handle (its slot) or None (not
        stored). A pinned page is never evicted, neither by LRU nor by :meth:`evict` (which
        drops it at its last unpin), so a read between pin and unpin finds it. Every handle
        must be given back to :meth:`unpin` once."""
        self._check_open()
        keys = self._check_keys(keys)
        return [None if p is None else p[0] for p in self.directory.pin(keys)]

    def unpin(self, handles: Sequence[int]) -> None:
        """Give back handles from :meth:`pin`; a page evicted meanwhile goes now."""
        self._check_open()
        self._persist.journal_evictions(self.directory.unpin(handles))

    def contains(self, key: Hashable) -> bool:
        self._check_open()
        if self.read_only:
            self._follow_if_idle()
        return self.directory.contains(key)

    def match_prefix(self, keys: Sequence[Hashable]) -> int:
        """How many leading keys are stored and readable."""
        self._check_open()
        if self.read_only:
            self._follow_if_idle()
        return self.directory.match_prefix(keys)

    def refresh(self) -> int:
        """Read-only follower: catch up with the writer's journal now (reads do this by
        themselves, at most every ``FOLLOW_INTERVAL`` s); returns the records applied."""
        self._check_open()
        if not self.read_only:
            return 0
        with self._gate.alone():
            return self._follow()

    def evict(self, keys: Sequence[Hashable]) -> int:
        """Drop pages now (pinned ones as soon as their reads finish); returns how many."""
        self._check_open()
        keys = self._check_keys(keys)
        gone = sum(self.directory.state(k) == PageState.READY for k in keys)  # not len() deltas:
        self._persist.journal_evictions(self.directory.remove(keys))  # others put meanwhile
        self._stats.add(evictions=gone)
        return gone

    def clear(self) -> None:
        """Drop every page (for good: the store takes a new id, so a later header scan does not
        bring them back from their slot trailers)."""
        self._check_open()
        with self._gate.alone():
            self._check_open()  # closed while this waited
            keys = [k for k, _, _ in self.directory.ready_items()]
            self._persist.journal_evictions(self.directory.remove(keys))
            if not self.read_only and not self._lost:
                try:
                    self.store.renew_id()
                except StoreError as exc:  # the pages are dropped all the same
                    self._log_once("renew-id", "clear: %s; a header scan may bring the "
                                   "cleared pages back", exc)

    def compact(self) -> None:
        """Rewrite the journal now to one COMMIT per stored page (the writer; a follower
        does nothing)."""
        self._check_open()
        with self._gate.alone():
            self._check_open()
            self._persist.compact(force=True)

    def stats(self) -> dict:
        """Counters and what runs. Still readable after :meth:`close` (the final counters)."""
        self._ledger.settle()  # every call that has returned counts
        s = self._stats.snapshot()
        o_direct, o_direct_reason = self._direct_io()
        s.update(pages_stored=len(self.directory), bytes_stored=len(self.directory) *
                 self.layout.page_bytes, capacity_pages=self.store.num_slots,
                 slot_bytes=self.layout.slot_bytes, page_bytes=self.layout.page_bytes,
                 backend=self.backend.name, gpu_direct=self.backend.gpu_direct,
                 backend_detail=self.backend.describe(),
                 backend_selected_because=self.backend.selected_because,
                 o_direct=o_direct, o_direct_reason=o_direct_reason,
                 device=str(self.device), fingerprint=self.layout.fingerprint,
                 in_place=self._host_pages.describe(),
                 page_engine=self._engine.path, page_engine_detail=self._engine.describe(),
                 read_only=self.read_only, state=self._state())
        return s

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pools.clear()
        self._worker.shutdown(wait=True)
        with self._gate.alone():  # calls other threads still run end first
            try:
                self._host_pages.close()
                self.backend.close()
                if not self._lost:  # never rewrite a journal that is no longer the store's
                    self._persist.compact()
            finally:
                self._ledger.close()
                self._persist.close()
                self.store.close()
                self._metrics.close()

    def _release(self) -> None:
        """Undo a constructor that failed part way: threads, backend, journal, files, lock."""
        for step in (lambda: self._worker and self._worker.shutdown(wait=True),
                     lambda: self._host_pages and self._host_pages.close(),
                     lambda: self.backend and self.backend.close(),
                     lambda: self._persist and self._persist.close(), self.store.close):
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - the first error is what the caller sees
                log.debug("releasing a failed tier: %s", exc)

    def _check_open(self) -> None:
        if self._closed:
            raise TierClosedError("tier is closed: open a new Tier to use the store again")

    def _state(self) -> str:
        if self._closed:
            return "closed"
        if self._lost:
            return f"puts refused: {self._lost}"
        return "read-only follower" if self.read_only else "ok"

    def _direct_io(self) -> tuple[bool, str]:
        """O_DIRECT as the I/O really runs: the backend's answer where it opens the files
        itself (kvikio), else the store's."""
        return self.backend.direct_io() or (self.store.direct, self.store.direct_reason)

    def __enter__(self) -> "Tier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- input checking -------------------------------------------------------------------------
    @staticmethod
    def _check_keys(keys) -> list:
        if isinstance(keys, (str, bytes)):
            raise TypeError("keys must be a sequence of str/bytes keys, not a single key")
        keys = list(keys)
        for k in keys:
            if not isinstance(k, (str, bytes)):
                raise TypeError(f"page keys must be str or bytes, got {type(k).__name__}: {k!r}")
            check_key(k)  # before any I/O: a key the journal cannot record fails the call
        if len(set(keys)) != len(keys):
            dup = next(k for k, c in collections.Counter(keys).items() if c > 1)
            raise ValueError(f"duplicate key in one call: {dup!r}")
        return keys

    def _refuse_byte_pages(self) -> None:
        if isinstance(self.layout, BytePageLayout):
            raise TypeError("this tier stores byte pages (BytePageLayout): they have no KV pool "
                            "to gather from or scatter to; use put_pages / get_pages")

    def _pool_copier(self, keys, kv_pool, token_slots, copy_fn) -> tuple[list, PageCopier]:
        self._refuse_byte_pages()
        keys = self._check_keys(keys)
        return keys, self._copier_for(keys, kv_pool, token_slots, copy_fn)

    def _copier_for(self, keys: list, kv_pool, token_slots, copy_fn) -> PoolCopier:
        """The call's copier, its pool and slot indices checked (``keys`` already are)."""
        pool = self._pools.get(kv_pool)
        if pool.device != self.device:
            raise ValueError(f"KV pool is on {pool.device} but this tier stages on {self.device}")
        # a restore's slots must not repeat: one page's bytes would land in another's
        return PoolCopier(pool, self.layout, pool.check_token_slots(
            token_slots, len(keys), distinct=copy_fn is kd.scatter_pages), copy_fn)

    def _region_calls(self, keys, pages, *, to_staging: bool) -> tuple[list, list]:
        """Check a put_pages/get_pages call; returns its keys and its parts: (positions in the
        call, the pages' mover), one part for the pages moved in place and one for those going
        through staging (either may be absent)."""
        keys = self._check_keys(keys)
        if len(pages) != len(keys):
            raise ValueError(f"got {len(pages)} page buffers for {len(keys)} keys")
        # a restore's regions' addresses and sizes, to refuse shared memory
        starts: list[int] | None = None if to_staging else []
        sizes: list[int] = []
        for i, regions in enumerate(pages):
            total = 0
            for r in regions:
                if not isinstance(r, torch.Tensor) or r.dtype != torch.uint8 or r.dim() != 1:
                    raise TypeError(f"page {i}: regions must be 1-D uint8 tensors")
                if not r.is_cpu and (r.device.type != self.device.type or
                                     (r.device.type == "cuda" and r.device != self.device)):
                    raise ValueError(f"page {i}: a region is on {r.device}; regions must be in "
                                     f"host memory or on the tier's device ({self.device})")
                if not r.is_contiguous():
                    raise ValueError(f"page {i}: regions must be contiguous byte ranges (got "
                                     f"stride {r.stride(0)}: an expanded or strided view)")
                n = r.numel()
                total += n
                if starts is not None and n:
                    starts.append(r.data_ptr())
                    sizes.append(n)
            if total != self.layout.page_bytes:
                raise ValueError(f"page {i}: regions hold {total} B, a page is "
                                 f"{self.layout.page_bytes} B")
        if starts is not None and len(starts) > 1:
            _refuse_shared_regions(starts, sizes, pages)
        direct = [i for i, regions in enumerate(pages) if self._host_pages.in_place(regions)]
        staged = [] if len(direct) == len(pages) else sorted(set(range(len(pages))) - set(direct))
        parts = []
        if direct:
            parts.append((direct, self._host_pages.call([pages[i] for i in direct])))
        if staged or not direct:  # an empty call is one (empty) staged part
            parts.append((staged, RegionCopier([pages[i] for i in staged], self.layout.slot_bytes,
                                               to_staging=to_staging)))
        return keys, parts

    def _run_parts(self, fn, keys: list, parts: list, engine_event=None) -> list[bool]:
        """Run a put_pages/get_pages call (:meth:`_region_calls`) as one tier call, its parts
        one after the other; the per-page results in call order."""
        def run(keys: list, parts: list, stream: CallStream | None) -> list[bool]:
            if len(parts) == 1:  # (every page in one part, in call order: its results are)
                return fn(keys, parts[0][1], stream)
            results = [False] * len(keys)
            for positions, mover in parts:
                for pos, ok in zip(positions, fn([keys[p] for p in positions], mover, stream)):
                    results[pos] = ok
            return results

        return self._run(run, keys, parts, engine_event, op="put" if fn == self._put else "get")

    def _in_place_why_not(self) -> str:
        """Why host regions cannot move in place on this tier ("" when they can)."""
        if not self.config.in_place:
            return "off by config (in_place=false)"
        if self.device.type != "cpu":
            return f"the tier stages on {self.device}: host regions are copied to it"
        if not self.backend.in_place_host_memory:
            return (f"backend {self.backend.name} moves only buffers registered with it; "
                    "host regions go through its registered staging buffer")
        if self._checksums.algorithm != checksum.CRC32C:
            return (f"pages are checksummed with algorithm {self._checksums.algorithm}, not "
                    "CRC-32C")
        return ""

    # -- data path ------------------------------------------------------------------------------
    def _warm_up_kernels(self) -> None:
        """Compile this layout's gather/scatter/checksum kernels now (Triton JIT, about a
        second) rather than inside the engine's first spill or restore."""
        lay = self.layout
        pages = min(2, self._chunk_pages)  # Triton specializes integer arguments equal to 1
        pool = None
        if isinstance(lay, KVLayout):  # byte pages are copied, never gathered or scattered
            shape = (lay.num_layers, pages * lay.page_size, lay.kv_heads, lay.head_dim)
            parts = [torch.zeros(shape, dtype=lay.torch_dtype, device=self.device)
                     for _ in range(lay.kv_count)]
            pool = KVPool(lay, parts[0] if lay.mla else tuple(parts))
        # The first CUDA event of a call path costs ~13 ms on an H100 (measured by
        # bench/experiments/call_profile.py): make it here, with the cross-stream wait every
        # call does.
        self._stream.wait_event(self._engine_event())
        with torch.cuda.stream(self._stream):
            for dtype in (torch.int64, torch.int32):  # engines use either for slot indices
                if pool is not None:
                    slots = torch.arange(pages * lay.page_size, dtype=dtype).to(
                        self.device, non_blocking=True)
                    kd.gather_pages(pool, lay, slots, self._staging[0])
                self._checksums.compute(self._staging[0], pages)
                if pool is not None:
                    kd.scatter_pages(pool, lay, slots, self._staging[0])
                if pool is not None and self.config.verify:  # restores' and spills' variants
                    self._warm_up_gpu_checksums(pool, slots, pages)
            self._copies_done(self._stream)
        self._stream.synchronize()

    def _warm_up_gpu_checksums(self, pool: KVPool, slots: torch.Tensor, pages: int) -> None:
        """The verifying scatter restores use (:mod:`.gpu_verdicts`) and the seal spills use
        (:mod:`.gpu_spill`) are kernel variants of their own: compile them here too, into the
        throwaway warm-up pool and staging part."""
        lay, part = self.layout, self._staging[0]
        partial = kd.page_partial_sums(part, pages, lay.page_bytes, lay.slot_bytes)
        kd.scatter_pages_verified(pool, lay, slots, part, kd.Verdicts(
            partial, torch.zeros(pages, dtype=torch.int64, device=self.device),
            torch.empty(pages, dtype=torch.int8, device=self.device), lay.page_bytes))
        if self._checksums.algorithm == checksum.GPU_PAGE and kd.uses_triton(self.device):
            words = slot_trailer.TRAILER_BYTES // 4
            kd.seal_pages(part, pages, partial, lay.page_bytes, lay.slot_bytes,
                          torch.zeros(pages, words, dtype=torch.int32, device=self.device),
                          slot_trailer.CHECKSUM_OFFSET, slot_trailer.CRC_OFFSET,
                          torch.zeros(64, dtype=torch.int32, device=self.device),
                          torch.empty(pages, dtype=torch.int64, device=self.device))

    def _warm_up_backend(self) -> None:
        """Read into every staging part once, now: from GPU memory the backends bounce through
        pinned host buffers they allocate on first use (kvikio's compat-mode bounce buffers,
        the posix/NIXL host mirrors), which cost the first spill ~80 ms on an H100. Reads the
        first slots, into staging only; a failure (e.g. files not grown yet) changes nothing."""
        extents = self.store.extents(range(min(self._chunk_pages, self.store.num_slots)))
        futures = [self.backend.read(part, extents) for part in self._staging.parts]
        for fut in futures:
            fut.exception()

    def _engine_event(self):
        """An event after the caller's queued GPU work (the pool writes we are to read), for a
        call that runs in another thread (an asynchronous one). A synchronous call records its
        thread's one event when it takes its turn on the stream (:class:`CallStream`)."""
        if self._stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def _call_stream(self, engine_event) -> CallStream | None:
        """The call's stream, chosen when it first needs one (:class:`CallStream`; None for a
        tier without a stream). ``engine_event``: an asynchronous call's
        (:meth:`_engine_event`); None: a synchronous call, which runs on the caller's own stream
        where it can, else on the tier's, its thread reusing one event (a new event costs host
        time to create, record and destroy)."""
        if self._stream is None:
            return None
        if engine_event is not None:
            return CallStream(self._stream, engine_event, record=False)
        ev = getattr(self._per_thread, "engine", None)
        if ev is None:
            ev = self._per_thread.engine = torch.cuda.Event()
        return CallStream(self._stream, ev, record=True)

    def _run(self, fn, keys, copier, engine_event=None, *, op: str) -> list[bool]:
        """Run a data call (``op``: "put" or "get", for the metrics): ``fn(keys, copier,
        stream)``, where ``stream`` is the call's turn on the tier's stream
        (:class:`CallStream`), which ``fn`` enters before its first GPU work and this leaves."""
        self._check_open()
        if self.read_only and self._follow_due():
            with self._gate.alone():
                if self._follow_due():  # another call may have caught up meanwhile
                    self._follow()
        t0 = time.perf_counter()
        self._gate.enter_shared()
        stream = None
        try:
            self._check_open()
            stream = self._call_stream(engine_event)
            results = fn(keys, copier, stream)
        finally:
            if stream is not None:
                stream.leave()
            self._gate.leave_shared()
        self._ledger.record(None, (op, len(keys), time.perf_counter() - t0))
        return results

    def _apply_counts(self, amounts: dict | None, call: tuple | None) -> None:
        """Apply what a data call recorded in the ledger: its counters (``amounts``), or the
        ``(op, pages, seconds)`` of a call that has ended (the metrics)."""
        if amounts is not None:  # (added up once per settle: :meth:`_flush_counts`)
            counts = self._ledger_counts
            for key, value in amounts.items():
                counts[key] = counts.get(key, 0) + value
        if call is not None:
            self._metrics.call(*call, len(self.directory))

    def _flush_counts(self) -> None:
        """Add the counters :meth:`_apply_counts` gathered in this settle to the stats."""
        if self._ledger_counts:
            counts, self._ledger_counts = self._ledger_counts, {}
            self._stats.add(**counts)

    def _copies_done(self, gpu: torch.cuda.Stream | None) -> None:
        """Wait for the GPU copies this thread queued so far on ``gpu``, the call's stream
        (before I/O threads read a part it gathered into, or before a get returns to the
        engine); None: a tier without a stream."""
        if gpu is not None:
            # (one call; an event recorded and waited for here was two, and the same wait)
            gpu.synchronize()

    def _take_part(self, pending: collections.deque, finish_oldest: Callable[[], None]) -> int:
        """A free staging part. With none free, a call finishes its own oldest chunk (which
        frees a part) before it waits for other calls' parts: no cycle of waiting calls."""
        while True:
            i = self._staging.try_take()
            if i is not None:
                return i
            if not pending:
                return self._staging.take()
            finish_oldest()

    def _take_write_part(self, parts_out: collections.deque) -> tuple[int, bool]:
        """A free staging part for a spill's next chunk, and whether the call had to wait for
        one. With none free, the call waits for its own writes that still hold parts, oldest
        first, giving each part back as its write ends, before it waits for other calls'
        parts: no cycle of waiting calls. Their commits (fdatasync, journal, directory) wait
        until the next chunk's write is under way (:meth:`_put`)."""
        waited = False
        while True:
            i = self._staging.try_take()
            if i is not None:
                return i, waited
            while parts_out and not parts_out[0][1].out:
                parts_out.popleft()
            if not parts_out:  # all of this call's parts are back: another call holds them
                return self._staging.take(), True
            fut, held = parts_out.popleft()
            fut.exception()  # its write ends (the outcome is the commit's to read)
            held.give_back(self._staging)  # unless its done-callback already has
            waited = True

    def _put(self, keys: list, fill: PageCopier, stream: CallStream | None = None) -> list[bool]:
        results = [False] * len(keys)
        admitted = self._admission.admit(keys)
        res = self.directory.reserve(keys if len(admitted) == len(keys)
                                     else [keys[i] for i in admitted])
        if res.evicted:
            self._persist.journal_evictions(res.evicted)
        # the call's counters, added to the stats once at its end (each add costs host time)
        tally = {"not_admitted": len(keys) - len(admitted), "evictions": len(res.evicted),
                 "bytes_written": 0, "write_seconds": 0.0, "write_failed": 0}
        todo: list[tuple[int, int]] = []
        waiting: list[int] = []  # keys another call is writing now: its outcome is theirs
        no_room = 0
        for i, slot, found in zip(admitted, res.slots, res.found):
            if slot is not None:
                todo.append((i, slot))
            elif found == _READY:
                results[i] = True
            elif found == _WRITING:
                waiting.append(i)
            elif found == _FREE:
                no_room += 1
            # (EVICTING: asked to go while a reader holds it; it is not stored for this put)
        if no_room:
            self._log_once("full", "store full and eviction cannot make room: %d pages not "
                           "stored", no_room)
        if len(todo) > 1:
            todo.sort(key=lambda t: t[1])  # adjacent slots coalesce into one I/O
        chunks = [todo[k:k + self._chunk_pages] for k in range(0, len(todo), self._chunk_pages)]
        pending: collections.deque = collections.deque()
        parts_out: collections.deque = collections.deque()  # (write, _HeldPart), oldest first
        finished = 0
        held = None  # a part taken for the current chunk, not yet handed to the backend

        def finish_oldest() -> None:
            nonlocal finished
            self._finish_write(keys, *pending.popleft(), results, tally)
            finished += 1

        in_place = isinstance(fill, InPlacePages)
        # one chunk: nothing to overlap its write with, so it may move on this thread
        on_caller = self._io_on_caller and len(chunks) == 1
        self._count_region_pages(fill, len(todo), "written", tally)
        spill = None
        gpu = None  # the call's stream, once entered: its GPU work goes there
        try:
            if stream is not None:
                stream.enter()
                gpu = stream.stream
            if not in_place and todo:
                spill = self._gpu_spill(fill, [i for i, _ in todo], gpu)
                if spill is None:
                    fill.prepare([i for i, _ in todo])
            for chunk in chunks:
                if in_place:  # no part: the I/O goes straight from the caller's regions
                    pending.append(self._write_in_place(keys, chunk, fill, on_caller))
                    continue
                if spill is not None:  # trailers sealed on the GPU: encoded before the wait
                    seqs, trailers = self._trailers(keys, chunk, itertools.repeat(0))
                held, waited = self._take_write_part(parts_out)
                part = self._staging[held]
                if spill is not None:  # one sync, then the write
                    spill.gather(part, [i for i, _ in chunk], trailers)
                else:
                    fill(part, [i for i, _ in chunk])
                    sums = self._checksums.compute(part, len(chunk)) if self.config.verify \
                        else np.zeros(len(chunk), dtype=np.uint64)
                    seqs, trailers = self._trailers(keys, chunk, sums)
                    slot_trailer.write_into(part, self.layout.slot_bytes, trailers,
                                            self._trailer_buffer())
                extents = self.store.extents([s for _, s in chunk])  # (while the GPU works)
                # (while the GPU works too: a write moved on this thread has no wait to hide it)
                lost = self._lost_files()
                self._copies_done(gpu)
                t0 = time.perf_counter()
                fut = self.backend.start("write", part, extents, on_caller)
                # the part is free once its bytes are written: fdatasync and journal need not it
                part_held = _HeldPart(held)
                fut.add_done_callback(lambda _f, p=part_held: p.give_back(self._staging))
                parts_out.append((fut, part_held))
                held = None
                if spill is not None:  # the checksums came back with the sync
                    sums = spill.sums(len(chunk))
                pending.append(self._writing(keys, chunk, sums, seqs, extents, fut, t0, lost))
                if waited:  # staging is the limit: commit what ended while this write runs
                    while len(pending) > 1 and pending[0][_FUT].done():
                        finish_oldest()
            if spill is not None:
                spill.done()  # every chunk's copies ended before its write was queued
            while pending:
                finish_oldest()
            if waiting:  # (only now: this call writes nothing any more, so no cycle of waits)
                for i, ok in zip(waiting, self.directory.wait_written([keys[i] for i in waiting])):
                    results[i] = ok
        except BaseException:
            if held is not None:
                self._staging.give_back(held)
            # let in-flight I/O end before giving its slots back, and its parts too (a write
            # whose entry was not made yet among them)
            for fut, part_held in parts_out:
                fut.exception()
                part_held.give_back(self._staging)
            for item in pending:
                item[_FUT].exception()
            self.directory.abort([s for c in chunks[finished:] for _, s in c])
            self._stats.add(**tally)
            raise
        tally.update(put_pages=len(keys), put_stored=sum(results))
        self._ledger.record(tally, None)
        return results

    def _trailers(self, keys, chunk, sums) -> tuple[list[int], list[bytes]]:
        """Each page's slot trailer (written beside its payload, in the same I/O) and sequence
        number, which the journal's COMMITs carry too."""
        seqs = self._persist.next_seqs(len(chunk))
        algo, store_id = self._checksums.algorithm, self.store.store_id
        return seqs, [slot_trailer.encode(FORMAT_VERSION, store_id, slot, keys[i], seq,
                                          int(csum), algo)
                      for (i, slot), seq, csum in zip(chunk, seqs, sums)]

    def _write_in_place(self, keys, chunk, pages: InPlacePages, on_caller: bool) -> tuple:
        """Start writing a chunk straight from the caller's regions (checksummed there); the
        pending entry :meth:`_finish_write` completes."""
        idx = [i for i, _ in chunk]
        sums = pages.checksums(idx) if self.config.verify \
            else np.zeros(len(chunk), dtype=np.uint64)
        seqs, trailers = self._trailers(keys, chunk, sums)
        extents = pages.write_extents(self.store.extents([s for _, s in chunk]), idx, trailers)
        t0 = time.perf_counter()
        return self._writing(keys, chunk, sums, seqs, extents,
                             self.backend.start("write", None, extents, on_caller), t0)

    def _writing(self, keys, chunk, sums, seqs, extents: list[Extent], fut: Future,
                 t0: float, lost: bool | None = None) -> tuple:
        """A chunk whose write was just started (at ``t0``), as :meth:`_finish_write` takes it.
        The host work its commit needs that does not wait for the write is done here, while
        the write runs: its COMMIT records encoded, and whether a store file was removed
        (``lost``, unless the caller looked already)."""
        commits = self._commits(keys, chunk, sums, seqs)
        if lost is None:
            lost = self._lost_files()
        if not fut.done():  # earlier calls' counters, while the write runs (else: later)
            self._ledger.settle(wait=False)
        return chunk, sums, seqs, extents, fut, t0, commits, lost

    def _commits(self, keys, chunk, sums: np.ndarray, seqs, positions=None) -> Encoded:
        """The encoded COMMITs of a chunk's pages (those at ``positions``; None: all of them)
        (:meth:`PersistentDirectory.journal_commits`)."""
        sums = sums.tolist()  # (Python ints pack faster than numpy scalars)
        if positions is not None:
            chunk = [chunk[pos] for pos in positions]
            sums = [sums[pos] for pos in positions]
            seqs = [seqs[pos] for pos in positions]
        return self._persist.encode_commits([keys[i] for i, _ in chunk], [s for _, s in chunk],
                                            sums, self._checksums.algorithm, seqs)

    @staticmethod
    def _count_region_pages(mover, n: int, direction: str, tally: dict) -> None:
        """Stats: how put_pages/get_pages pages moved (in place, or staged from regions), into
        the call's ``tally`` (added with its other counters: one add per call)."""
        if isinstance(mover, InPlacePages):
            tally[f"pages_{direction}_in_place"] = n
        elif isinstance(mover, RegionCopier):
            tally[f"region_pages_{direction}_staged"] = n

    def _finish_write(self, keys, chunk, sums, seqs, extents: list[Extent], fut: Future,
                      t0: float, commits: Encoded, lost: bool, results: list[bool],
                      tally: dict) -> None:
        """Commit a chunk :meth:`_writing` started, once its write has ended: its pages durable,
        journaled and READY, or given back."""
        outcome: IOOutcome = fut.result()
        # (the usual case, nothing failed, takes no per-position steps: each costs a host
        # that has just woken from the write's wait a few µs)
        failed = self._failed_positions(outcome, extents, "write") if outcome.errors else set()
        ok = [pos for pos in range(len(chunk)) if pos not in failed] if failed \
            else range(len(chunk))
        if ok and lost:
            failed.update(ok)
            ok = []
        if ok:
            try:
                if self._sync_data:
                    self.store.sync({e.file for e in extents})
                self._persist.journal_commits(
                    self._commits(keys, chunk, sums, seqs, ok) if failed else commits)
            except OSError as exc:
                self._log_once(f"commit:{exc.errno}", "commit of %d pages failed: %s", len(ok), exc)
                failed.update(ok)
                ok = []
        if ok:
            self.directory.commit([chunk[pos][1] for pos in ok], sums[ok] if failed else sums,
                                  self._checksums.algorithm)
        if failed:
            self.directory.abort([chunk[pos][1] for pos in sorted(failed)])
        for pos in ok:
            results[chunk[pos][0]] = True
        tally["bytes_written"] += len(ok) * self.layout.page_bytes
        tally["write_seconds"] += time.perf_counter() - t0
        tally["write_failed"] += len(failed)

    def _get(self, keys: list, drain: PageCopier | DeferredCopier,
             stream: CallStream | None = None) -> list[bool]:
        results = [False] * len(keys)
        pins = self.directory.pin(keys)
        todo = [(i, p[0], p[1]) for i, p in enumerate(pins) if p is not None]
        if len(todo) > 1:
            todo.sort(key=lambda t: t[1])  # adjacent slots coalesce into one I/O
        chunks = [todo[k:k + self._chunk_pages] for k in range(0, len(todo), self._chunk_pages)]
        unreadable: list = []  # (key, slot) of pages to drop: checksum mismatch, failed read
        pending: collections.deque = collections.deque()
        held = None
        verdicts = None
        # the call's counters, added to the stats once at its end (each add costs host time)
        tally = {"bytes_read": 0, "read_seconds": 0.0, "read_failed": 0, "corrupt_pages": 0,
                 "unreadable_pages": 0}
        synced_parts: list[int] = []  # parts given back after the call's sync, not before
        gpu = None  # the call's stream, once entered (after the first read's submit)
        settled = False
        pinned = True

        in_place = isinstance(drain, InPlacePages)
        on_caller = self._io_on_caller and len(chunks) == 1  # (see _put)
        self._count_region_pages(drain, len(todo), "read", tally)

        def finish_oldest() -> None:
            if in_place:
                self._finish_read_in_place(keys, *pending.popleft(), drain, results,
                                           unreadable, tally)
            else:
                self._finish_read(keys, *pending.popleft(), drain, results, unreadable,
                                  verdicts, tally, synced_parts, gpu)

        try:
            for k, chunk in enumerate(chunks):
                if in_place:  # no part: the I/O goes straight into the caller's regions
                    extents = drain.read_extents(self.store.extents([s for _, s, _ in chunk]),
                                                 [i for i, _, _ in chunk],
                                                 hash_as_read=self.config.verify)
                    t0 = time.perf_counter()
                    pending.append((chunk, k * self._chunk_pages, None, extents,
                                    self.backend.start("read", None, extents, on_caller), t0))
                    continue
                held = self._take_part(pending, finish_oldest)
                extents = self.store.extents([s for _, s, _ in chunk])
                part = self._staging[held]
                t0 = time.perf_counter()
                pending.append((chunk, k * self._chunk_pages, held, extents,
                                self.backend.start("read", part, extents, on_caller), t0))
                held = None
                if k == 0:
                    # The first read is under way (or, moved on this thread, has ended): the
                    # call takes its turn on the stream, its arguments are checked and its slot
                    # indices and stored checksums are made ready meanwhile (host work that
                    # would otherwise come first).
                    if stream is not None:
                        stream.enter()
                        gpu = stream.stream
                    if isinstance(drain, DeferredCopier):
                        drain = drain.make()
                    verdicts = self._gpu_verdicts(drain, todo, gpu)
                    if drain.prepare([i for i, _, _ in todo],
                                     into=verdicts.slot_buffers if verdicts is not None
                                     else None, defer_upload=verdicts is not None):
                        # the indices go up inside the chunks' launch graphs (as a spill's)
                        verdicts.upload_slots(len(todo) * self.layout.page_size)
                    if not pending[-1][4].done():  # earlier calls' counters (see _writing)
                        self._ledger.settle(wait=False)
                if verdicts is not None:  # its launches made while its read runs
                    verdicts.plan(drain, part, k * self._chunk_pages, [i for i, _, _ in chunk],
                                  last=k == len(chunks) - 1)
            while pending:
                finish_oldest()
            if stream is not None:
                stream.enter()  # (nothing read: the argument checks below may use the GPU)
                gpu = stream.stream
            if isinstance(drain, DeferredCopier):  # nothing read: the arguments still count
                drain = drain.make()
            if verdicts is not None:
                verdicts.read_back()
            # Every read has ended (the pages are in staging or their regions): the slots may
            # go while the GPU still scatters, so unpin now, not after the sync.
            self._drop_unreadable(unreadable)  # (while pinned: the slots are still theirs)
            pinned = False
            self._unpin(todo)
            self._copies_done(gpu)
            while synced_parts:  # nothing reads them now: no event for their next user
                self._staging.give_back(synced_parts.pop())
            if verdicts is not None:
                self._settle(keys, todo, verdicts, results, unreadable, tally)
            settled = True
        finally:
            if held is not None:
                self._staging.give_back(held)
            for i in synced_parts:  # an exception before the sync: the GPU may still read it
                self._staging.give_back(i, gpu)
            for item in pending:  # not drained: its part is free once its read has ended
                item[4].exception()
                if item[2] is not None:
                    self._staging.give_back(item[2])
            if pinned:
                self._drop_unreadable(unreadable)
                self._unpin(todo)
            self._drop_unreadable(unreadable)  # those the GPU's verdicts found, after the sync
            if not settled:  # an exception: what the finished chunks moved still counts
                self._stats.add(**tally)
        hits = sum(results)
        tally.update(get_pages=len(keys), hits=hits, misses=len(keys) - hits)
        self._ledger.record(tally, None)
        return results

    def _unpin(self, todo: list) -> None:
        """Unpin a restore's slots (its reads have ended); journal the evictions that waited."""
        self._persist.journal_evictions(self.directory.unpin([s for _, s, _ in todo]))

    def _drop_unreadable(self, pages: list) -> None:
        """Drop the pages a restore could not read, ``(key, slot)`` pairs (then empties the
        list): a checksum mismatch, or a read that failed and was not worth or did not succeed
        trying again (:meth:`_read_again`). From now on they are misses for every caller, so an
        engine's existence check answers MISS and it stops loading them (a page it kept hitting
        would be loaded and fail again forever); the journal says so too (vLLM's scheduler and
        followers read it). A page still pinned, by this call or another, goes at its last
        unpin."""
        if pages:
            self._persist.journal_evictions(self.directory.remove([k for k, _ in pages],
                                                                  [s for _, s in pages]))
            pages.clear()

    def _read_again(self, buffer: torch.Tensor | None, extents: list[Extent],
                    outcome: IOOutcome,
                    forget: Callable[[list[int]], None] | None = None) -> IOOutcome:
        """Read again, up to ``READ_RETRIES`` times, the extents whose read failed for a reason
        that may pass (an EIO, a NIXL transfer error): ``outcome`` with their last result. A
        read that lasts -- the file ended (a truncated slab), or is gone (ENOENT, ESTALE) -- is
        not tried again. ``forget(positions)``: told the chunk positions read again first (an
        in-place read forgets what it hashed of them)."""
        sb = self.layout.slot_bytes
        for _ in range(self.READ_RETRIES):
            again = [i for i, exc in outcome.errors.items() if _may_read_later(exc)]
            if not again:
                break
            if forget is not None:
                forget(sorted({p for i in again for p in range(
                    extents[i].buffer_offset // sb,
                    -(-(extents[i].buffer_offset + extents[i].length) // sb))}))
            # (without the ``moved`` hints: a piece read twice would count its bytes twice)
            retry = self.backend.start("read", buffer, [dataclasses.replace(extents[i],
                                                                            moved=None)
                                                        for i in again], True).result()
            for j, i in enumerate(again):
                del outcome.errors[i]
                outcome.failed.pop(i, None)
                if j in retry.errors:
                    outcome.errors[i] = retry.errors[j]
                    if j in retry.failed:
                        outcome.failed[i] = retry.failed[j]
            outcome.nbytes += retry.nbytes
        return outcome

    def _finish_read(self, keys, chunk, first: int, part_index: int, extents, fut: Future,
                     t0: float, drain: PageCopier, results: list[bool], unreadable: list,
                     verdicts: GpuVerdicts | None, tally: dict, synced_parts: list[int],
                     gpu: torch.cuda.Stream | None) -> None:
        """Verify and drain one chunk (its read ended or ends now); ``first`` is the chunk's
        first position in the call's read order. With ``verdicts``, a chunk whose I/O moved
        every page is verified and scattered in one launch, and its hits are counted when the
        call settles (:meth:`_settle`); the call's last such chunk leaves its part in
        ``synced_parts``, for the call to give back after its sync (one event fewer to record
        here and for the part's next user to wait for). ``gpu``: the call's stream."""
        part = self._staging[part_index]
        good: list[int] = []
        after_sync = False
        try:
            outcome: IOOutcome = fut.result()
            lost: set[int] = set()
            if outcome.errors:
                outcome = self._read_again(part, extents, outcome)
                failed = self._failed_positions(outcome, extents, "read", lost)
                self._lost_reads(keys, chunk, lost, unreadable, tally)
            else:
                failed = set()
            if verdicts is not None and not failed:
                last = first + len(chunk) == verdicts.pages
                verdicts.scatter(drain, part, first, [i for i, _, _ in chunk], last=last)
                tally["read_seconds"] += time.perf_counter() - t0
                after_sync = last
                return
            if self.config.verify:
                sums = self._verify_sums(part, chunk)
                bad = []
                for pos, (i, slot, want) in enumerate(chunk):
                    if pos not in failed and int(sums[pos]) != want:
                        failed.add(pos)
                        bad.append((keys[i], slot))
                self._corrupt(bad, unreadable, tally)
            good = [pos for pos in range(len(chunk)) if pos not in failed]
            if good and verdicts is not None:  # a plain scatter reads the uploaded indices
                verdicts.slots_uploaded()
            if good:
                if len(good) == len(chunk):
                    drain(part, [i for i, _, _ in chunk])
                else:  # only verified pages reach the engine: pack them to the front first
                    packed = torch.empty(len(good) * self.layout.slot_bytes, dtype=torch.uint8,
                                         device=part.device)
                    sb = self.layout.slot_bytes
                    for j, pos in enumerate(good):
                        packed[j * sb:(j + 1) * sb].copy_(part[pos * sb:(pos + 1) * sb])
                    drain(packed, [chunk[pos][0] for pos in good])
        finally:
            if after_sync:
                synced_parts.append(part_index)
            else:  # free as soon as the scatter is queued; its next user waits for this event
                self._staging.give_back(part_index, gpu)
        for pos in good:
            results[chunk[pos][0]] = True
        tally["bytes_read"] += len(good) * self.layout.page_bytes
        tally["read_seconds"] += time.perf_counter() - t0
        tally["read_failed"] += len(failed)

    def _finish_read_in_place(self, keys, chunk, _first: int, _part: None, extents,
                              fut: Future, t0: float, pages: InPlacePages, results: list[bool],
                              unreadable: list, tally: dict) -> None:
        """Complete an in-place read: the pages it did not move whole, or whose bytes (in the
        caller's regions) fail their checksum, are misses."""
        outcome: IOOutcome = fut.result()
        failed: set[int] = set()
        if outcome.errors:
            outcome = self._read_again(None, extents, outcome, lambda positions: (
                pages.forget_reads([chunk[pos][0] for pos in positions])))
            lost: set[int] = set()
            failed = self._failed_positions(outcome, extents, "read", lost)
            self._lost_reads(keys, chunk, lost, unreadable, tally)
        if self.config.verify:
            slots = [s for _, s, _ in chunk]
            if self.directory.all_use(slots, checksum.CRC32C):  # (the usual case: one pass)
                sums = pages.read_checksums([i for i, _, _ in chunk]).tolist()
            else:
                sums = self._mixed_read_sums(chunk, self.directory.algorithms(slots), pages)
            mismatched = [pos for pos, (_, _, want) in enumerate(chunk) if sums[pos] != want]
            if mismatched:
                self._corrupt([(keys[chunk[pos][0]], chunk[pos][1]) for pos in mismatched
                               if pos not in failed], unreadable, tally)
                failed.update(mismatched)
        good = [pos for pos in range(len(chunk)) if pos not in failed] if failed \
            else range(len(chunk))
        pages.complete([chunk[pos][0] for pos in good])
        for pos in good:
            results[chunk[pos][0]] = True
        tally["bytes_read"] += len(good) * self.layout.page_bytes
        tally["read_seconds"] += time.perf_counter() - t0
        tally["read_failed"] += len(failed)

    def _mixed_read_sums(self, chunk, algos: np.ndarray, pages: InPlacePages) -> list[int]:
        """The checksums of an in-place chunk whose pages were not all written with CRC-32C
        (by another tier): each page's with the algorithm that made it."""
        own = [pos for pos in range(len(chunk)) if algos[pos] == checksum.CRC32C]
        sums = np.zeros(len(chunk), dtype=np.uint64)
        sums[own] = pages.read_checksums([chunk[pos][0] for pos in own])
        for pos in sorted(set(range(len(chunk))) - set(own)):  # written by another tier
            algo = int(algos[pos])
            if algo not in self._verifiers:
                self._verifiers[algo] = checksum.checksummer(algo, self.layout)
            sums[pos] = self._verifiers[algo].compute(pages.as_slot(chunk[pos][0]), 1)[0]
        return sums.tolist()

    def _trailer_buffer(self) -> torch.Tensor | None:
        """This thread's pinned buffer for a chunk's slot trailers (GPU staging only): their
        upload is then asynchronous, finished by the sync that precedes the chunk's write."""
        if self._stream is None:
            return None
        buf = getattr(self._per_thread, "trailers", None)
        if buf is None:
            buf = self._per_thread.trailers = torch.empty(
                self._chunk_pages * slot_trailer.TRAILER_BYTES, dtype=torch.uint8,
                pin_memory=True)
        return buf

    def _thread_buffers(self) -> VerdictBuffers:
        buffers = getattr(self._per_thread, "buffers", None)
        if buffers is None:
            buffers = self._per_thread.buffers = VerdictBuffers(
                self.device, self._chunk_pages, self.layout.page_bytes, self.layout.page_size,
                graphs=self.config.launch_graphs)
        return buffers

    def _gpu_checked(self, copier: PageCopier) -> bool:
        """Whether a call's checksums are made or checked by the kernels on the GPU: staging on
        CUDA, pages moving to or from a KV pool through the kernels, verification on."""
        if not isinstance(copier, PoolCopier):
            return False
        # (worked out once per checksummer: the queries cost a cold host 7 µs a call,
        # bench/results/h200-2026-11-26/call-overhead-7/call6/put_lines2_after.txt)
        checks = self._checksums
        if self._gpu_checks[0] is not checks:
            self._gpu_checks = (checks, self._stream is not None and self.config.verify
                                and checks.algorithm == checksum.GPU_PAGE
                                and kd.uses_triton(self.device))
        return self._gpu_checks[1]

    def _gpu_spill(self, fill: PageCopier, order: list[int],
                   gpu: torch.cuda.Stream | None) -> GpuSpill | None:
        """The gather + checksum of this spill as graph replays (:mod:`.gpu_spill`), where it
        can: staging on CUDA, pages from a KV pool through the kernels, verification on.
        ``gpu``: the call's stream (current)."""
        if not self._gpu_checked(fill):
            return None
        return GpuSpill(fill, order, self._thread_buffers(),
                        self.layout.page_bytes, self.layout.slot_bytes, gpu)

    def _gpu_verdicts(self, drain: PageCopier, todo: list,
                      gpu: torch.cuda.Stream | None) -> GpuVerdicts | None:
        """Verdicts decided on the GPU for this restore, where it can: staging on CUDA, pages
        going to a KV pool through the kernels, verification on, and every page checksummed
        with this tier's GPU algorithm (pages an older configuration wrote are verified the
        plain way)."""
        if not todo or not self._gpu_checked(drain):
            return None
        if not self.directory.all_use([s for _, s, _ in todo], checksum.GPU_PAGE):
            return None
        return GpuVerdicts([want for _, _, want in todo], self._thread_buffers(),
                           self.layout.page_bytes, self.layout.slot_bytes, gpu)

    def _settle(self, keys, todo: list, verdicts: GpuVerdicts, results: list[bool],
                unreadable: list, tally: dict) -> None:
        """Hits and checksum misses of the chunks verified on the GPU (after the stream sync)."""
        bad, settled = [], verdicts.settle()
        for k, matched in settled:
            i, slot, _ = todo[k]
            if matched:
                results[i] = True
            else:
                bad.append((keys[i], slot))
        self._corrupt(bad, unreadable, tally)
        tally["bytes_read"] += (len(settled) - len(bad)) * self.layout.page_bytes
        tally["read_failed"] += len(bad)

    def _verify_sums(self, part: torch.Tensor, chunk) -> np.ndarray:
        """Checksums of the chunk's pages, each made with the algorithm its stored one used."""
        algos = self.directory.algorithms([s for _, s, _ in chunk])
        if (algos == self._checksums.algorithm).all():
            return self._checksums.compute(part, len(chunk))
        sums = np.zeros(len(chunk), dtype=np.uint64)
        for algo in np.unique(algos).tolist():
            if algo not in self._verifiers:
                self._verifiers[algo] = checksum.checksummer(algo, self.layout)
            mask = algos == algo
            sums[mask] = np.asarray(self._verifiers[algo].compute(part, len(chunk)))[mask]
        return sums

    def _corrupt(self, bad: list, unreadable: list, tally: dict) -> None:
        """Pages ``(key, slot)`` whose checksum did not match: misses, dropped."""
        if bad:
            unreadable.extend(bad)
            tally["corrupt_pages"] += len(bad)
            self._log_once("corrupt", "checksum mismatch: %d pages dropped as misses "
                           "(first key %r)", len(bad), bad[0][0])

    def _lost_reads(self, keys, chunk, lost: set[int], unreadable: list, tally: dict) -> None:
        """Pages (chunk positions ``lost``) whose read failed for good: misses, dropped."""
        if lost:
            unreadable.extend((keys[chunk[pos][0]], chunk[pos][1]) for pos in sorted(lost))
            tally["unreadable_pages"] += len(lost)
            self._log_once("unreadable", "read failed: %d pages dropped as misses (first key "
                           "%r)", len(lost), keys[chunk[min(lost)][0]])

    def _failed_positions(self, outcome: IOOutcome, extents: list[Extent], op: str,
                          lost: set[int] | None = None) -> set[int]:
        """Positions (in the chunk) of the pages an I/O did not move whole. A page before the
        point where a short read or write stopped moved whole: it is not failed (and a read
        one is still verified). ``lost``: given the failed positions whose failure is an I/O
        error (an ``OSError``: the page's bytes could not be read, not a fault of this process
        such as a CUDA copy's)."""
        failed: set[int] = set()
        sb = self.layout.slot_bytes
        for idx, exc in outcome.errors.items():
            e = extents[idx]
            ranges = outcome.failed.get(idx) or [(e.buffer_offset, e.buffer_offset + e.length)]
            pages = {p for start, end in ranges for p in range(start // sb, -(-end // sb))}
            failed |= pages
            if lost is not None and isinstance(exc, OSError):
                lost |= pages
            self._log_once(f"{op}:{type(exc).__name__}", "%s of %d pages failed: %s", op,
                           len(pages), exc)
        return failed

    # -- read-only follower ---------------------------------------------------------------------
    def _follow_if_idle(self) -> None:
        """Catch up before a metadata query, unless data calls are in flight (they catch up
        themselves): a query never waits behind I/O."""
        if self._closed or not self._follow_due() or not self._gate.enter_alone(blocking=False):
            return
        try:
            if self._follow_due():  # a data call may have caught up meanwhile
                self._follow()
        finally:
            self._gate.leave_alone()

    def _follow_due(self) -> bool:
        return time.monotonic() - self._followed_at >= self.FOLLOW_INTERVAL

    def _follow(self) -> int:
        """Catch up with the writer's journal now (alone: no data call in flight)."""
        self._followed_at = time.monotonic()
        return self._persist.catch_up()

    def _refuse_put(self, keys) -> list[bool]:
        keys = self._check_keys(keys)
        if self._lost:
            self._stats.add(put_pages=len(keys), put_refused=len(keys))
        else:
            self._log_once("read-only", "read-only tier: puts store nothing (the writer's "
                           "process owns the store)")
        return [False] * len(keys)

    def _lost_files(self) -> bool:
        """Whether a store file was removed (unlinked) under this writer. Checked for every
        chunk written, while its write runs (a few fstat calls): a page written to a removed
        file would be acknowledged and then be gone at the next start, so from then on no put
        is acknowledged."""
        if not self._lost:
            gone = self.store.removed_files() + self._persist.removed_files()
            if not gone:
                return False
            self._lost = (f"store files removed while open: {', '.join(gone)}; pages written "
                          "from now on could not be found again. Close the tier and open the "
                          "store again (its surviving files) or a new store")
            self._stats.add(store_files_removed=len(gone))
            self._metrics.fallback("puts", "refused: store files removed while open")
            log.error("gdskv: %s", self._lost)
        return True

    def _stored(self, key: Hashable) -> bool:
        return self.directory.contains(key)
