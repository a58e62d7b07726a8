"""gdskv as an LMCache L2 storage adapter (LMCache's ``plugin`` adapter type).

LMCache loads it without patching (its plugin loader, ``L2AdapterConfigBase`` discovery)::

    {"type": "plugin", "module_path": "gdskv.adapters.lmcache",
     "class_name": "GdskvL2Adapter",
     "adapter_params": {"directories": ["/nvme0/lmcache"], "capacity": "64GiB",
                        "object_bytes": 2097152},
     "eviction": {"eviction_policy": "LRU"}}

``adapter_params``: ``object_bytes`` (the largest object LMCache stores: one full chunk,
``chunk_size`` tokens of the model's KV), ``create_directories`` and any
:class:`~gdskv.config.TierConfig` field; ``GDSKV_*`` variables fill in the rest. An unknown key
or a bad value stops LMCache at start-up with one :class:`~gdskv.config.ConfigError`; a missing
store directory with a :class:`~gdskv.adapters.common.StoreDirectoryError` (one of those).
The store is the configured directories themselves (one LMCache process owns it); with
``"cluster": true`` several LMCache processes on a shared mount read each other's objects
(:mod:`gdskv.cluster`).

Objects are byte pages (:class:`~gdskv.layout.BytePageLayout` of ``object_bytes``): one object,
one page, whatever its size. An object's logical bytes (``get_size()``; a short last chunk has
fewer) are the front of its page; a store pads the rest with zeros and a load drops it, so an
object is read back exactly as it was stored and the bytes after its logical size in LMCache's
buffer are never touched. An object larger than ``object_bytes`` fails its store task.

Keys: an :class:`ObjectKey` is the gdskv key ``model@kv_rank@group@hash@salt`` (ranks and group
in hex, hash hex, salt possibly empty; ``@`` cannot appear in a model or salt), so
``list_l2_keys`` parses the stored keys back, after a restart too.

Asynchrony: a store or load is one ``Tier.put_pages_async`` / ``get_pages_async`` call; the
future's done-callback records the result and signals LMCache's eventfd (no thread of ours).
Lookup-and-lock is metadata only and completes in the submit: it pins each found page
(``Tier.pin``), so nothing evicts it before its load; ``submit_unlock`` gives the pin back. A
``delete`` of a locked object is deferred to its last unlock (it stays loadable and counted).

Eviction belongs to LMCache: the tier runs with ``eviction=none`` and the adapter declares its
capacity (``capacity_pages x object_bytes``), so LMCache's L2 eviction controller (the spec's
``eviction`` block) calls :meth:`GdskvL2Adapter.delete` before the store is full. Every object
is accounted at ``object_bytes`` (what it occupies in gdskv), in ``_notify_keys_stored`` when
its store commits and ``_notify_keys_deleted`` when ``delete`` drops it, and once per key:
LMCache's usage is exactly the tier's ``pages_stored x object_bytes``. Without an ``eviction``
block a full store fails further stores (LMCache then keeps them in L1 only).

Objects whose L1 buffer allows it (4 KiB aligned under O_DIRECT) move in place, straight
between LMCache's buffer and the slab files (:mod:`gdskv.host_pages`); others through staging.

Failures never raise into LMCache's controllers: a bad call, an I/O error or a failed checksum
is a failed store task or a miss in the load bitmap, and is logged once. A missed object's
buffer holds undefined bytes (a read in place may have landed there); LMCache deletes the L1
object of every key whose bit is 0.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from concurrent.futures import Future

import torch

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import EncodedObjectKey, KeyEntry, KeyListPage, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

from ..cluster import open_tier
from ..config import ConfigError, Eviction, TierConfig, parse_int
from ..layout import BytePageLayout
from ..log_once import LogOnce
from ..tier_protocol import TierLike
from .common import tier_config

log = logging.getLogger("gdskv.lmcache")

#: the page kind in the store's fingerprint: a store of LMCache objects is never read as
#: anything else of the same size
PAGE_KIND = "lmcache/l2-object"
#: adapter_params keys besides TierConfig fields and create_directories
ADAPTER_KEYS = frozenset({"object_bytes"})
_SEP = "@"


class GdskvL2AdapterConfig(L2AdapterConfigBase):
    """The adapter's settings, checked when LMCache parses its config (start-up)."""

    def __init__(self, object_bytes: int, tier_config: TierConfig) -> None:
        self.object_bytes = object_bytes
        self.tier_config = tier_config

    @classmethod
    def from_dict(cls, d: dict) -> "GdskvL2AdapterConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"gdskv: adapter_params must be a JSON object, got {d!r}")
        config = tier_config(d, where="adapter_params", adapter_keys=ADAPTER_KEYS)
        if "object_bytes" not in d:
            raise ConfigError("gdskv: adapter_params needs \"object_bytes\": the bytes of one "
                              "full LMCache chunk (chunk_size tokens of the model's KV; the bench's "
                              "--data-size-kb x 1024)")
        object_bytes = parse_int(d["object_bytes"], "adapter_params object_bytes")
        if object_bytes < 1:
            raise ConfigError(f"gdskv: adapter_params object_bytes must be positive, got "
                              f"{object_bytes}")
        if "eviction" in d and config.eviction != Eviction.NONE:
            raise ConfigError(f"gdskv: adapter_params eviction={d['eviction']!r}: LMCache "
                              "owns eviction of its L2 (its accounting must see every drop); "
                              "leave eviction out and add \"eviction\": {\"eviction_policy\": "
                              "\"LRU\"} to the adapter spec instead")
        return cls(object_bytes, config.replace(eviction=Eviction.NONE))

    @classmethod
    def help(cls) -> str:
        return ("gdskv L2 adapter (type plugin, module_path gdskv.adapters.lmcache, class_name "
                "GdskvL2Adapter) adapter_params:\n"
                "- object_bytes (int, required): bytes of one full chunk\n"
                "- any gdskv TierConfig field (directories, capacity, sync, backend, "
                "direct_io, cluster, ...); GDSKV_* variables fill in the rest\n"
                "- create_directories (bool): make a missing store directory. See "
                "docs/lmcache.md")


def object_key_string(key: ObjectKey) -> str:
    """The gdskv key of an LMCache object (parsed back by :func:`parse_object_key`)."""
    return _SEP.join((key.model_name, f"{key.kv_rank:x}", f"{key.object_group_id:x}",
                      key.chunk_hash.hex(), key.cache_salt))


def parse_object_key(text: str) -> EncodedObjectKey:
    model, rank, group, chunk_hash, salt = text.split(_SEP)
    return EncodedObjectKey(chunk_hash_hex=chunk_hash, model_name=model, kv_rank=int(rank, 16),
                            object_group_id=int(group, 16), cache_salt=salt)


def _object_bytes(obj) -> torch.Tensor:
    """The object's logical bytes (``get_size()``) as a 1-D uint8 view of its buffer."""
    raw = obj.raw_data
    if not raw.is_contiguous():
        raise ValueError(f"memory object buffer is not contiguous (strides {raw.stride()})")
    size = obj.get_size()
    if raw.dtype == torch.uint8 and raw.dim() == 1 and raw.numel() == size:
        return raw  # already what the tier takes: three tensor ops per object saved
    return raw.reshape(-1).view(torch.uint8)[:size]


class GdskvL2Adapter(L2AdapterInterface):
    """LMCache L2 adapter over one gdskv tier of byte pages (see the module docstring).

    Args:
        config: the checked settings (LMCache's plugin loader builds it from adapter_params).
        device: where the tier stages pages (LMCache's L1 is host memory: ``cpu``).
        kwargs: what LMCache's factory adds (``l1_memory_desc``); unused.
    """

    config_class_name = "GdskvL2AdapterConfig"

    def __init__(self, config: GdskvL2AdapterConfig, *, device: str = "cpu", **kwargs) -> None:
        if isinstance(config, dict):  # built directly from adapter_params
            config = GdskvL2AdapterConfig.from_dict(config)
        self.layout = BytePageLayout(page_bytes=config.object_bytes, kind=PAGE_KIND)
        # a cluster store with "cluster": true: every node's objects load here, while LMCache's
        # capacity, usage and listing are this node's own store (the pages it can delete)
        self.tier: TierLike = open_tier(self.layout, config.tier_config, device=device)
        own = self.tier.store  # None on a read-only cluster node: it stores nothing
        super().__init__(max_capacity_bytes=(own.num_slots if own is not None else 0)
                         * config.object_bytes)
        self.object_bytes = config.object_bytes
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._lock = threading.Lock()
        self._next_task = 0
        self._stores: dict[L2TaskId, L2StoreResult] = {}
        self._lookups: dict[L2TaskId, Bitmap] = {}
        self._loads: dict[L2TaskId, Bitmap] = {}
        #: pin handles (slots) held per key by lookups not yet unlocked
        self._pins: dict[str, list[int]] = defaultdict(list)
        #: locked keys LMCache deleted: dropped at their last unlock
        self._doomed: set[str] = set()
        #: keys LMCache has been told are stored (each once), for exact usage accounting
        self._accounted: set[str] = set()
        # zeros after a short object's bytes on store; where a load drops them
        self._zeros = torch.zeros(self.object_bytes, dtype=torch.uint8)
        self._sink = torch.empty(self.object_bytes, dtype=torch.uint8)
        self._log_once = LogOnce(log)
        self._closed = False
        # pages of an earlier run are LMCache's again: accounted as stored
        self._account_stored(self._own_names())

    # -- event fds ------------------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    # -- store ----------------------------------------------------------------------------------
    def submit_store_task(self, keys: list[ObjectKey], objects: list) -> L2TaskId:
        return self._submit("store", self.tier.put_pages_async, keys, objects, self._zeros,
                            self._store_done)

    def _submit(self, op: str, call, keys: list[ObjectKey], objects: list, filler: torch.Tensor,
                done) -> L2TaskId:
        """One tier call for a store or load task; ``done(task, keys, future)`` completes it
        (with ``None`` when the call was refused: every object failed)."""
        task = self._new_task()
        try:
            names = [object_key_string(k) for k in keys]
            fut = call(names, [self._regions(o, filler) for o in objects])
        except Exception as exc:  # noqa: BLE001 - a bad call is a failed task, never a raise
            self._log_once(f"{op}:{type(exc).__name__}", "gdskv: %s task failed: %s", op, exc)
            done(task, keys, None)
            return task
        fut.add_done_callback(lambda f: done(task, keys, f))
        return task

    def _regions(self, obj, filler: torch.Tensor) -> list[torch.Tensor]:
        """An object's page: its logical bytes, then ``filler`` up to ``object_bytes`` (zeros
        a store writes, or a sink a load drops)."""
        data = _object_bytes(obj)
        if data.numel() > self.object_bytes:
            raise ValueError(f"object of {data.numel()} B is larger than object_bytes "
                             f"{self.object_bytes}: raise adapter_params object_bytes to the "
                             "bytes of one full chunk")
        pad = self.object_bytes - data.numel()
        return [data, filler[:pad]] if pad else [data]

    def _store_done(self, task: L2TaskId, keys: list[ObjectKey], fut: Future | None) -> None:
        stored = self._outcome(fut, "store", len(keys))
        # (in a cluster store, a key another node holds is stored there, not here: not counted)
        new = self._account_stored([n for n in (object_key_string(k) for k, ok in
                                                zip(keys, stored) if ok) if self._holds(n)])
        with self._lock:
            self._stores[task] = L2StoreResult(all(stored), new * self.object_bytes)
        self._signal(self._store_efd)

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._stores = self._stores, {}
        return done

    # -- lookup and lock ------------------------------------------------------------------------
    def submit_lookup_and_lock_task(self, keys: list[ObjectKey], group_layout_descs=None
                                    ) -> L2TaskId:
        task = self._new_task()
        bitmap = Bitmap(len(keys))
        try:
            names = [object_key_string(k) for k in keys]
            handles = self.tier.pin(names)
            with self._lock:
                for i, (name, handle) in enumerate(zip(names, handles)):
                    if handle is not None:
                        bitmap.set(i)
                        self._pins[name].append(handle)
        except Exception as exc:  # noqa: BLE001 - a failed lookup is all misses
            self._log_once(f"lookup:{type(exc).__name__}", "gdskv: lookup failed: %s", exc)
            bitmap = Bitmap(len(keys))
        with self._lock:
            self._lookups[task] = bitmap
        self._signal(self._lookup_efd)
        return task

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._lookups.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        handles, due = [], []
        with self._lock:
            for key in keys:
                name = object_key_string(key)
                held = self._pins.get(name)
                if held:
                    handles.append(held.pop())
                    if not held:
                        del self._pins[name]
                        if name in self._doomed:
                            self._doomed.discard(name)
                            due.append(name)
        if handles and not self._closed:
            self.tier.unpin(handles)
            if due:
                self._drop(due)

    # -- load -----------------------------------------------------------------------------------
    def submit_load_task(self, keys: list[ObjectKey], objects: list) -> L2TaskId:
        return self._submit("load", self.tier.get_pages_async, keys, objects, self._sink,
                            self._load_done)

    def _load_done(self, task: L2TaskId, keys: list[ObjectKey], fut: Future | None) -> None:
        loaded = self._outcome(fut, "load", len(keys))
        bitmap = Bitmap(len(keys))
        for i, ok in enumerate(loaded):
            if ok:
                bitmap.set(i)
        with self._lock:
            self._loads[task] = bitmap
        hits = [k for k, ok in zip(keys, loaded) if ok]
        if hits:
            self._notify_keys_accessed(hits)
        # a page that failed its checksum is dropped by the tier: LMCache must stop counting it
        self._account_deleted([object_key_string(k) for k, ok in zip(keys, loaded)
                               if not ok and not self._closed
                               and not self._holds(object_key_string(k))])
        self._signal(self._load_efd)

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._loads.pop(task_id, None)

    # -- eviction, listing, status --------------------------------------------------------------
    def delete(self, keys: list[ObjectKey]) -> None:
        """Drop objects: now, or a locked one at its last unlock (it stays loadable and
        counted until then)."""
        if not keys or self._closed:
            return
        with self._lock:
            names = []
            for name in map(object_key_string, keys):
                if name in self._pins:
                    self._doomed.add(name)
                else:
                    names.append(name)
        self._drop(names)

    def _drop(self, names: list[str]) -> None:
        try:
            self.tier.evict(names)
        except Exception as exc:  # noqa: BLE001 - nothing dropped: nothing to account
            self._log_once(f"delete:{type(exc).__name__}", "gdskv: delete failed: %s", exc)
            return
        self._account_deleted([n for n in names if not self._holds(n)])

    def list_l2_keys(self, model_name: str | None = None, page_size: int = 500,
                     cursor: str | None = None) -> KeyListPage:
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        names = sorted(self._own_names())
        if cursor is not None:
            names = [n for n in names if n > cursor]
        entries = []
        for name in names:
            key = parse_object_key(name)
            if model_name is None or key.model_name == model_name:
                entries.append(KeyEntry(key=key, size_bytes=self.object_bytes))
                if len(entries) == page_size:
                    break
        more = bool(entries) and len(entries) == page_size and name != names[-1]
        return KeyListPage(entries=tuple(entries), next_page_token=name if more else None)

    def report_status(self) -> dict:
        stats = self.tier.stats()
        state = stats.get("state", "read-only cluster node")
        return {"is_healthy": state in ("ok", "read-only follower", "read-only cluster node"),
                "type": "GdskvL2Adapter", "state": state,
                "object_bytes": self.object_bytes, "objects_stored": stats["pages_stored"],
                "capacity_objects": stats.get("capacity_pages", 0),
                "backend": stats.get("backend"), "o_direct": stats.get("o_direct"),
                "sync": self.tier.config.sync.value,
                "locked_objects": sum(len(v) for v in self._pins.values()),
                "in_place": stats.get("in_place"),
                **{k: stats.get(k, 0) for k in ("hits", "misses", "corrupt_pages",
                                                "read_failed", "write_failed",
                                                "read_gbps", "write_gbps",
                                                "pages_written_in_place", "pages_read_in_place",
                                                "region_pages_written_staged",
                                                "region_pages_read_staged")}}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            held = [h for hs in self._pins.values() for h in hs]
            self._pins.clear()
        try:
            if held:
                self.tier.unpin(held)
        finally:
            self.tier.close()  # waits for the calls in flight: their callbacks run first
            for efd in (self._store_efd, self._lookup_efd, self._load_efd):
                efd.close()

    # -- helpers --------------------------------------------------------------------------------
    def _signal(self, efd) -> None:
        if not self._closed:  # a submit after close() fails its task with no fd to signal
            efd.notify()

    def _new_task(self) -> L2TaskId:
        with self._lock:
            self._next_task += 1
            return self._next_task

    def _account_stored(self, names: list[str]) -> int:
        """Tell LMCache about stored keys it does not count yet; returns how many."""
        with self._lock:
            new = [n for n in dict.fromkeys(names) if n not in self._accounted]
            self._accounted.update(new)
        if new:
            self._notify_keys_stored([parse_object_key(n).to_object_key() for n in new],
                                     [self.object_bytes] * len(new))
        return len(new)

    def _account_deleted(self, names: list[str]) -> None:
        """Tell LMCache about counted keys the tier no longer holds."""
        with self._lock:
            gone = [n for n in dict.fromkeys(names) if n in self._accounted]
            self._accounted.difference_update(gone)
        if gone:
            self._notify_keys_deleted([parse_object_key(n).to_object_key() for n in gone],
                                      [self.object_bytes] * len(gone))

    def _own_names(self) -> list[str]:
        """The keys of this process's own store (LMCache's usage; in a cluster store, this
        node's namespace)."""
        directory = self.tier.directory
        return [k for k, _, _ in directory.ready_items()] if directory is not None else []

    def _holds(self, name: str) -> bool:
        """Is ``name`` in this process's own store (see :meth:`_own_names`)?"""
        directory = self.tier.directory
        return directory is not None and directory.contains(name)

    def _outcome(self, fut: Future | None, op: str, n: int) -> list[bool]:
        if fut is None:
            return [False] * n
        exc = fut.exception()
        if exc is not None:
            self._log_once(f"{op}:{type(exc).__name__}", "gdskv: %s task failed: %s", op, exc)
            return [False] * n
        return fut.result()
