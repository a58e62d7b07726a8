"""The tier: spill KV pages from an engine pool to the slab store and restore them.

Each data call is an object over the tier's shared :class:`CallContext` (:mod:`.data_call`):
a spill (``put``) is a :class:`SpillCall` (:mod:`.spill_call`: reserve slots -> gather into a
staging part -> checksum -> write -> fdatasync per sync policy -> journal COMMIT -> READY), a
restore (``get``) a :class:`RestoreCall` (:mod:`.restore_call`: pin -> read into staging parts
-> verify -> scatter -> unpin). A page that is missing, fails I/O or fails its checksum is a
miss (``False``), never an exception and never wrong bytes; one that could not be read is
dropped (journaled as evicted), after ``READ_RETRIES`` more reads in the call for an error
that may pass (EIO). This module keeps the public API, argument checks, the call gate, which
stream a call's GPU work goes on, warm-up, and the read-only follower.

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
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from . import checksum, native
from . import kernels as kd
from . import slot_trailer, yielding_lock
from .admission import AdmissionFilter
from .backends import backend_class, create_backend
from .call_combiner import CallCombiner, CallRequest
from .call_gate import CallGate
from .config import ConfigError, SyncPolicy, TierConfig
from .copiers import DeferredCopier, PageCopier, PoolCopier, RegionCopier
from .data_call import READ_RETRIES, CallContext, copies_done
from .directory import PageDirectory, PageState
from .host_pages import HostPagePath
from .journal import Journal, JournalFollower, check_key, keys_fit
from .ledger import CallLedger
from .log_once import LogOnce
from .layout import BytePageLayout, KVLayout, PageLayout
from .memory import check_device, cuda_available
from .metrics import TierMetrics
from .persistence import PersistentDirectory
from .pool import KVPool, PoolCache
from .quick_calls import QuickCall, QuickRestore, QuickSpill
from .restore_call import RestoreCall
from .spill_call import SpillCall
from .staging import StagingParts, staging_part_pages
from .streams import CallStream, StreamPool, current_stream
from .stats import TierStats
from .store import SlabStore, StoreError

log = logging.getLogger("gdskv.tier")


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


def _pool_id(kv_pool) -> tuple | int:
    """Which tensors a pool call moves between (calls combine only on the same ones): the
    engine's (K, V) tensors, as it passes them, or the object it passes."""
    return tuple(map(id, kv_pool)) if type(kv_pool) in (tuple, list) else id(kv_pool)


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
    #: before its pages are dropped (:mod:`.data_call`)
    READ_RETRIES = READ_RETRIES

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
        self._stats = TierStats()
        self._log_once = LogOnce(log)  # one line per kind of failure
        self.read_only = bool(self.config.read_only)
        part_bytes = self._chunk_pages * layout.slot_bytes
        # refused before the store is touched: a bad option changes nothing on disk
        StagingParts.check_fits(part_bytes * depth, self.device)
        backend_class(self.config, self.device)
        self._persist: PersistentDirectory | None = None
        self.backend = None
        self._host_pages: HostPagePath | None = None
        #: "get"/"put": the tier's quick path for small in-place host calls, where it has one
        self._quick: dict[str, QuickCall] = {}
        self._worker: ThreadPoolExecutor | None = None
        self.store = SlabStore(layout, self.config)
        try:  # whatever fails from here releases all it acquired: lock, files, threads
            # host page I/O and checksums: the native page engine, or the Python path
            self._engine = native.engine(self.config.native)
            self._persist = PersistentDirectory(self.store, self.config, self._stats,
                                                self._log_once, scan_headers=scan_headers,
                                                scan_progress=scan_progress)
            self._followed_at = time.monotonic()
            self.backend = create_backend(self.config, self.device)
            self.backend.attach(self.store.files)
            self._staging = StagingParts(part_bytes, depth, self.device)
            # what every data call works with (SpillCall, RestoreCall)
            self._calls = CallContext(
                layout=layout, config=self.config, store=self.store, backend=self.backend,
                staging=self._staging, persist=self._persist,
                checksums=checksum.default_for(self.device, layout, self._engine),
                stats=self._stats, log_once=self._log_once, chunk_pages=self._chunk_pages,
                device=self.device, has_stream=self.device.type == "cuda",
                admission=AdmissionFilter(self.config.admit_after, self._stored,
                                          max_tracked=4 * self.store.num_slots),
                sync_data=self.config.sync == SyncPolicy.DATA)
            # per thread: its VerdictBuffers ("buffers"), engine event for synchronous calls
            # ("engine") and pinned slot-trailer buffer ("trailers")
            self._per_thread = self._calls.per_thread
            self._verifiers = self._calls.verifiers
            self._host_pages = HostPagePath(
                layout, self._in_place_why_not(),
                any(f.direct for f in self.store.files) or bool(self._direct_io()[0]),
                self.config.io_threads, self._engine)
            # small in-place restores and spills in one engine call each (and why not)
            self._quick_why_not = {}
            for kind in (QuickRestore, QuickSpill):
                why = self._quick_why_not[kind.op] = kind.why_not(self._calls, self._host_pages)
                if not why:
                    self._quick[kind.op] = kind(self._calls, self._host_pages)
            # A call whose GPU work cannot go on its caller's stream takes a stream of its own
            # from this pool (:class:`CallStream`): calls in flight never queue behind each
            # other's copies and kernels, nor wait for each other's syncs.
            self._streams = StreamPool(self.device) if self.device.type == "cuda" else None
            if self._streams is not None:
                self._warm_up_kernels()
                self._warm_up_backend()
            self._gate = CallGate()
            self._worker = ThreadPoolExecutor(depth, thread_name_prefix="gdskv-tier")
            self._pools = PoolCache(layout)
            # data calls arriving while others of their kind run wait and are combined into one
            # call (:mod:`.call_combiner`)
            self._combiner = CallCombiner(self._run_batch,
                                          running=self.config.calls_at_once) \
                if self.config.combine_calls else None
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
        self._ledger_calls: dict = {}  # op -> (pages, seconds) of ended calls, not yet observed
        self._ledger = CallLedger(self._apply_counts, flush=self._flush_counts)
        self._calls.ledger, self._calls.metrics = self._ledger, self._metrics
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

    @property
    def _checksums(self):
        """How this tier checksums the pages it writes (and verifies its own)."""
        return self._calls.checksums

    @_checksums.setter
    def _checksums(self, checksummer) -> None:
        self._calls.checksums = checksummer

    @property
    def _lost(self) -> str:
        """Why puts are refused now ("" while they are not): a store file removed under us."""
        return self._calls.lost

    # -- public API -----------------------------------------------------------------------------
    def put(self, keys: Sequence[Hashable], kv_pool, token_slots) -> list[bool]:
        """Store pages (gathered from ``kv_pool`` at ``token_slots``) under ``keys``.

        Returns per page whether it is stored: True means readable, and durable as the sync
        policy says (``sync``). A key already stored is True without a write; a key another call
        is writing now gets that write's outcome (this call waits for it, after its own
        writes); a key being evicted while a reader holds it is False.
        """
        self._check_open()
        if self.read_only or self._calls.lost:
            return self._refuse_put(keys)
        self._refuse_byte_pages()
        keys = self._check_keys(keys)

        def fill() -> PoolCopier:
            return self._copier_for(keys, kv_pool, token_slots, kd.gather_pages)
        return self._combined(("put", _pool_id(kv_pool)), keys, fill,
                              lambda: self._run(self._put, keys, fill(), op="put"))

    def get(self, keys: Sequence[Hashable], kv_pool, token_slots) -> list[bool]:
        """Restore pages into ``kv_pool`` at ``token_slots``; per-page hit (True) or miss."""
        self._check_open()
        self._refuse_byte_pages()
        keys = self._check_keys(keys)
        # The pool and slot checks run while the call's first read is under way (host work
        # the read hides); a bad argument still raises before anything reaches the pool.
        drain = DeferredCopier(lambda: self._copier_for(keys, kv_pool, token_slots,
                                                        kd.scatter_pages))
        return self._combined(("get", _pool_id(kv_pool)), keys, drain.make,
                              lambda: self._run(self._get, keys, drain, op="get"))

    def put_async(self, keys, kv_pool, token_slots) -> Future:
        self._check_open()
        if self.read_only or self._calls.lost:
            fut: Future = Future()
            fut.set_result(self._refuse_put(keys))
            return fut
        keys, fill = self._pool_copier(keys, kv_pool, token_slots, kd.gather_pages)
        event = self._engine_event()
        return self._worker.submit(self._combined, ("put", _pool_id(kv_pool)), keys,
                                   lambda: fill, lambda: self._run(self._put, keys, fill, event,
                                                                   op="put"), event)

    def get_async(self, keys, kv_pool, token_slots) -> Future:
        self._check_open()
        keys, drain = self._pool_copier(keys, kv_pool, token_slots, kd.scatter_pages)
        event = self._engine_event()
        return self._worker.submit(self._combined, ("get", _pool_id(kv_pool)), keys,
                                   lambda: drain, lambda: self._run(self._get, keys, drain,
                                                                    event, op="get"), event)

    def put_pages(self, keys: Sequence[Hashable], pages: Sequence[Sequence[torch.Tensor]]
                  ) -> list[bool]:
        """Store pages given as page-format byte regions: ``pages[i]`` is a list of 1-D uint8
        tensors whose concatenation is page i's payload (``layout.page_bytes``). The only way
        in for a :class:`BytePageLayout` tier.

        On a tier staging in host memory, host regions are written in place where they allow
        it (4 KiB aligned under O_DIRECT: see :mod:`gdskv.host_pages`), else through staging."""
        self._check_open()
        if self.read_only or self._calls.lost:
            return self._refuse_put(keys)
        return self._pages_call("put", keys, pages)

    def get_pages(self, keys: Sequence[Hashable], pages: Sequence[Sequence[torch.Tensor]]
                  ) -> list[bool]:
        """Restore pages into page-format byte regions (see :meth:`put_pages`); per page a
        hit (True) or a miss. The regions of a missed page hold undefined bytes afterwards
        (a read in place may have landed part of the page there): never use them."""
        self._check_open()
        return self._pages_call("get", keys, pages)

    def put_pages_async(self, keys: Sequence[Hashable],
                        pages: Sequence[Sequence[torch.Tensor]]) -> Future:
        """:meth:`put_pages` on the tier's workers; the regions are checked here, now (a bad
        one raises in the caller), and must stay untouched until the future is done."""
        self._check_open()
        if self.read_only or self._calls.lost:
            fut: Future = Future()
            fut.set_result(self._refuse_put(keys))
            return fut
        return self._pages_async("put", keys, pages)

    def get_pages_async(self, keys: Sequence[Hashable],
                        pages: Sequence[Sequence[torch.Tensor]]) -> Future:
        """:meth:`get_pages` on the tier's workers (see :meth:`put_pages_async`)."""
        self._check_open()
        return self._pages_async("get", keys, pages)

    def _pages_async(self, op: str, keys, pages) -> Future:
        """A put_pages/get_pages call (``op``: "put"/"get") submitted to the tier's workers,
        its arguments checked now."""
        keys = self._check_keys(keys)
        quick = self._quick_regions(op, keys, pages)
        event = self._engine_event()
        if quick is not None:  # checked by QuickCall.regions() (combined as in _pages_call)
            if quick[0].not_combined(len(keys)):
                return self._worker.submit(self._run, self._quick_call, keys, quick, event,
                                           op=op)
        else:
            keys, parts = self._region_calls(keys, pages, to_staging=op == "put")

        def alone():
            if quick is not None:
                return self._run(self._quick_call, keys, quick, event, op=op)
            return self._run_parts(self._put if op == "put" else self._get, keys, parts, event)
        return self._worker.submit(self._combined, (op + "_pages",), keys, lambda: pages,
                                   alone, event)

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
                 quick_restore=self._quick_describe("get"),
                 quick_spill=self._quick_describe("put"),
                 page_engine=self._engine.path, page_engine_detail=self._engine.describe(),
                 data_path_locks=yielding_lock.IMPLEMENTATION,
                 read_only=self.read_only, state=self._state())
        c = self._combiner
        # calls combined into one (:mod:`.call_combiner`): the combined calls run, and the
        # callers' calls they served
        s.update(combined_calls=c.batches if c else 0, calls_combined=c.batched_calls if c else 0)
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
        if not keys_fit(keys):  # hex digests and the like pass in C loops; others one by one
            for k in keys:
                if not isinstance(k, (str, bytes)):
                    raise TypeError(f"page keys must be str or bytes, got "
                                    f"{type(k).__name__}: {k!r}")
                check_key(k)  # before any I/O: a key the journal cannot record fails the call
        if len(keys) > 1 and len(set(keys)) != len(keys):
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
        """Check a put_pages/get_pages call; returns its keys and its parts (see
        :meth:`_region_parts`)."""
        keys = self._check_keys(keys)
        self._check_regions(keys, pages, to_staging=to_staging)
        return keys, self._region_parts(pages, to_staging=to_staging)

    def _check_regions(self, keys: list, pages, *, to_staging: bool) -> None:
        """A put_pages/get_pages call's regions, checked (``keys`` already are)."""
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

    def _region_parts(self, pages, *, to_staging: bool) -> list:
        """A checked region call's parts: (positions in the call, the pages' mover), one part
        for the pages moved in place and one for those going through staging (either may be
        absent)."""
        direct = [i for i, regions in enumerate(pages) if self._host_pages.in_place(regions)]
        staged = [] if len(direct) == len(pages) else sorted(set(range(len(pages))) - set(direct))
        parts = []
        if direct:
            parts.append((direct, self._host_pages.call([pages[i] for i in direct])))
        if staged or not direct:  # an empty call is one (empty) staged part
            parts.append((staged, RegionCopier([pages[i] for i in staged], self.layout.slot_bytes,
                                               to_staging=to_staging)))
        return parts

    def _run_parts(self, fn, keys: list, parts: list, engine_event=None, *,
                   op: str | None = "", after: tuple = ()) -> list[bool]:
        """Run a put_pages/get_pages call (:meth:`_region_calls`) as one tier call, its parts
        one after the other; the per-page results in call order. ``op``: as :meth:`_run`'s
        ("": from ``fn``)."""
        def run(keys: list, parts: list, stream: CallStream | None) -> list[bool]:
            if len(parts) == 1:  # (every page in one part, in call order: its results are)
                return fn(keys, parts[0][1], stream)
            results = [False] * len(keys)
            for positions, mover in parts:
                for pos, ok in zip(positions, fn([keys[p] for p in positions], mover, stream)):
                    results[pos] = ok
            return results

        if op == "":
            op = "put" if fn == self._put else "get"
        return self._run(run, keys, parts, engine_event, op=op, after=after)

    def _pages_call(self, op: str, keys, pages) -> list[bool]:
        """A synchronous put_pages/get_pages call (``op``: "put"/"get"), combined with others
        in flight where it waits (:mod:`.call_combiner`)."""
        keys = self._check_keys(keys)
        quick = self._quick_regions(op, keys, pages)
        if quick is not None and quick[0].not_combined(len(keys)):
            # A quick restore is not combined: a read that releases the GIL (a preadv, a
            # copy of 1 MiB or more) overlaps the other calls in flight, where a batch would
            # read on one thread (16 threads of 2 MiB restores, H100 host: 0.24-0.28x raw
            # alone, 0.13-0.16x combined); a shorter one is shorter than a GIL hand-over.
            # Nor is a large quick spill (QuickSpill.not_combined)
            return self._run(self._quick_call, keys, quick, op=op)
        fn, to_staging = (self._put, True) if op == "put" else (self._get, False)

        def checked():
            self._check_regions(keys, pages, to_staging=to_staging)
            return pages
        # A quick spill runs where a call runs alone; spills that wait are combined (one
        # fdatasync and journal append for the batch: 16 threads of 64 KiB spills, H100 host,
        # ran 2.5x the pages/s combined as quick spills each on its own), the batch itself one
        # quick spill (_run_combined)
        def alone():
            if quick is not None:
                return self._run(self._quick_call, keys, quick, op=op)
            return self._run_parts(fn, keys, self._region_parts(checked(),
                                                                to_staging=to_staging))
        return self._combined((op + "_pages",), keys, checked, alone)

    def _quick_regions(self, op: str, keys: list, pages) -> tuple | None:
        """(quick path, the call's regions, its pages) where a put_pages/get_pages call
        (``op``: "put"/"get") can take the tier's quick path (:mod:`.quick_calls`), else None
        (also where pages and keys differ in number: the general path's check says so)."""
        quick = self._quick.get(op)
        if quick is None or len(pages) != len(keys):
            return None
        regions = quick.regions(pages)
        return None if regions is None else (quick, regions, pages)

    @staticmethod
    def _quick_call(keys: list, call: tuple, stream: CallStream | None) -> list[bool]:
        quick, regions, pages = call
        return quick.run(keys, regions, pages, stream)

    def _quick_describe(self, op: str) -> dict:
        quick = self._quick.get(op)
        return quick.describe() if quick is not None else \
            {"enabled": False, "reason": self._quick_why_not.get(op, "")}

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
        stream = self._streams.take()
        stream.wait_event(self._engine_event())
        with torch.cuda.stream(stream):
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
        copies_done(stream)
        self._streams.give_back(stream)

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
        if self._streams is None:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def _call_stream(self, engine_event, after: tuple = ()) -> CallStream | None:
        """The call's stream, chosen when it first needs one (:class:`CallStream`; None for a
        tier without a stream). ``engine_event``: an asynchronous call's
        (:meth:`_engine_event`); None: a synchronous call, which runs on the caller's own stream
        where it can, else on a stream of its own from the tier's pool, its thread reusing one
        event (a new event costs host time to create, record and destroy)."""
        if self._streams is None:
            return None
        if engine_event is not None:
            return CallStream(self._streams, engine_event, record=False, after=after)
        return CallStream(self._streams, self._thread_event(), record=True, after=after)

    def _thread_event(self) -> torch.cuda.Event:
        """This thread's one event for its synchronous calls (a new event costs host time to
        create, record and destroy)."""
        ev = getattr(self._per_thread, "engine", None)
        if ev is None:
            ev = self._per_thread.engine = torch.cuda.Event()
        return ev

    def _run(self, fn, keys, copier, engine_event=None, *, op: str | None,
             after: tuple = ()) -> list[bool]:
        """Run a data call (``op``: "put" or "get", for the metrics; None: its callers record
        themselves): ``fn(keys, copier, stream)``, where ``stream`` is the call's
        :class:`CallStream`, which ``fn`` enters before its first GPU work and this leaves.
        ``after``: events of other callers' streams the call's GPU work waits for."""
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
            stream = self._call_stream(engine_event, after)
            results = fn(keys, copier, stream)
        finally:
            if stream is not None:
                stream.leave()
            self._gate.leave_shared()
        if op is not None:
            self._ledger.record(None, (op, len(keys), time.perf_counter() - t0))
        return results

    def _combined(self, group: tuple, keys: list, make, alone, event=None) -> list[bool]:
        """A data call through the combiner (:mod:`.call_combiner`), or ``alone()`` where there
        is none. ``group``: (operation, what it moves between: a pool's tensors) -- calls
        combine only within one; ``make()``: the call's checked mover ingredient (a
        :class:`PoolCopier`, or a region call's pages), run by the thread that runs the batch
        (a bad argument fails this call only); ``event``: after the caller's queued GPU work
        (an asynchronous call's, recorded when it was submitted; None: a synchronous call,
        whose thread's event is recorded when it waits)."""
        if self._combiner is None:
            return alone()
        return self._combiner.call(group, alone,
                                   lambda: self._request(group, keys, make, event))

    def _request(self, group: tuple, keys: list, make, event) -> CallRequest:
        """A call to be combined with others, made in its caller's thread with as little host
        work as can be: its arguments are checked by the thread that runs the batch, so
        waiting callers do not take the interpreter lock from it. It carries an event after
        its caller's queued GPU work, which the combined call's stream waits for. A
        synchronous caller's is its thread's event and its current stream, recorded by the
        batch's thread (:meth:`_run_combined`): the caller is blocked meanwhile, so nothing
        more reaches its stream, and its thread makes no CUDA call while the batch runs."""
        if event is None and self._streams is not None:
            event = (self._thread_event(), current_stream(self.device.index))
        return CallRequest(group, keys, (make, event))

    def _run_batch(self, batch: list[CallRequest]) -> None:
        """Run combined calls of one group (disjoint keys) as one data call; each request gets
        its own pages' results (or the error its arguments raise) and is recorded as its own
        call in the metrics. Pool requests whose pool view or slot indices' device differ from
        the first's (an engine passing one pool's tensors in other shapes) run on their own."""
        op = batch[0].group[0]
        made = []
        for r in batch:
            make, event = r.payload
            try:
                made.append((r, make(), event))
            except Exception as exc:  # noqa: BLE001 - that caller's own bad argument
                r.error = exc
        if not made:
            return
        if op.endswith("_pages"):
            self._run_combined(op[:-6], made)
            return
        first = made[0][1]
        together = [m for m in made if m[1].pool is first.pool and
                    m[1].flat_slots.device == first.flat_slots.device]
        self._run_combined(op, together)
        for m in made:
            if m not in together:
                self._run_combined(op, [m])

    def _run_combined(self, op: str, made: list) -> None:
        """``made``: (request, its mover ingredient, its event) of one group: one data call for
        all. ``op``: "put"/"get"; ingredients: PoolCopiers of one pool, or pages lists."""
        keys = made[0][0].keys if len(made) == 1 else [k for r, _, _ in made for k in r.keys]
        fn = self._put if op == "put" else self._get
        events = []
        for _, _, e in made:
            if type(e) is tuple:  # a synchronous caller's event, recorded here (see _request)
                e[0].record(e[1])
                e = e[0]
            if e is not None:
                events.append(e)
        events = tuple(events)
        first = made[0][1]
        if isinstance(first, PageCopier):
            copier = first
            if len(made) > 1:
                # (each request's slots were checked against the pool; a restore's are distinct
                # within each call -- two calls in flight restoring into one slot race with or
                # without combining)
                copier = PoolCopier(first.pool, self.layout,
                                    torch.cat([c.flat_slots for _, c, _ in made]), first.kernel)
            results = self._run(fn, keys, copier, op=None, after=events)
        else:
            pages = first if len(made) == 1 else [p for _, ps, _ in made for p in ps]
            # a batch of quick calls' pages is one quick call (one engine call for the batch's
            # checksums, trailers and write), not the general path's page-by-page steps
            quick = self._quick_regions(op, keys, pages)
            if quick is not None:
                results = self._run(self._quick_call, keys, quick, op=None, after=events)
            else:
                results = self._run_parts(fn, keys, self._region_parts(
                    pages, to_staging=op == "put"), op=None, after=events)
        at = 0
        now = time.perf_counter()
        for r, _, _ in made:
            r.result = results[at:at + len(r.keys)]
            at += len(r.keys)
            self._ledger.record(None, (op, len(r.keys), now - r.t0))

    def _put(self, keys: list, fill: PageCopier, stream: CallStream | None = None) -> list[bool]:
        return SpillCall(self._calls, keys, fill, stream).run()

    def _get(self, keys: list, drain: PageCopier | DeferredCopier,
             stream: CallStream | None = None) -> list[bool]:
        return RestoreCall(self._calls, keys, drain, stream).run()

    def _apply_counts(self, amounts: dict | tuple | None, call: tuple | None) -> None:
        """Apply what a data call recorded in the ledger: its counters (``amounts``: a dict,
        or a quick call's ``(tally, values)``, :class:`~gdskv.quick_calls.RestoreTally` and
        ``SpillTally``), or the ``(op, pages, seconds)`` of a call that has ended (the
        metrics)."""
        if amounts is not None:  # (added up once per settle: :meth:`_flush_counts`)
            if amounts.__class__ is tuple:
                amounts[0].add(*amounts[1])
            else:
                counts = self._ledger_counts
                for key, value in amounts.items():
                    counts[key] = counts.get(key, 0) + value
        if call is not None:  # (observed once per settle, by the thousand: :meth:`_flush_counts`)
            op, pages, seconds = call
            calls = self._ledger_calls.get(op)
            if calls is None:
                calls = self._ledger_calls[op] = ([], [])
            calls[0].append(pages)
            calls[1].append(seconds)

    def _flush_counts(self) -> None:
        """Add the counters :meth:`_apply_counts` gathered in this settle to the stats."""
        for quick in self._quick.values():
            if quick.tally is not None:
                counts = self._ledger_counts
                for key, value in quick.tally.take().items():
                    counts[key] = counts.get(key, 0) + value
        if self._ledger_counts:
            counts, self._ledger_counts = self._ledger_counts, {}
            self._stats.add(**counts)
        if self._ledger_calls:
            calls, self._ledger_calls = self._ledger_calls, {}
            for op, (pages, seconds) in calls.items():
                self._metrics.calls(op, pages, seconds)
            self._metrics.stored(len(self.directory))  # (most restores change nothing stored)

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

    def _stored(self, key: Hashable) -> bool:
        return self.directory.contains(key)
