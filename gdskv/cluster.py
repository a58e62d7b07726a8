"""A cluster store: one KV store shared by several nodes over a shared file system.

Each node (an engine process: a host's GPU, a DP rank) writes only its own **namespace**,
``<directory>/<node_id>`` under each of ``config.directories``: an ordinary writer :class:`Tier`
with its own lock, journal, capacity and eviction, recovered by that node after a restart as
any store is. Every other namespace there is opened as a read-only follower tier: it follows
that node's journal and verifies every page it reads, so a slot its writer reuses under it is a
miss, never wrong bytes. The first directory is listed every ``cluster_discovery_ms`` (in the
background, started by the calls): a new namespace is opened, one whose manifest changed (its writer made the store again or cleared it)
is reopened, one that vanished (reclaimed: ``gdskv cluster reclaim``) is closed. A namespace
of another model or sharding (its layout fingerprint differs) is skipped.

Lookups ask this node's store first, then the others in name order; a read goes to whichever
namespace holds the page, and a page that misses there (checksum, I/O) is tried at the next
namespace holding it. A put skips keys another node holds (``cluster_dedup``). Nodes never talk
to each other: the file system is the only channel, so a node sees the others' pages as soon
as the mount shows their journals' new bytes (``docs/cluster.md``: what each file system needs).
"""

from __future__ import annotations

import collections
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from . import namespaces
from .config import ConfigError, TierConfig, check_node_id
from .layout import PageLayout
from .log_once import LogOnce
from .memory import check_device, cuda_available
from .staging import StagingParts
from .store import (MANIFEST, StoreError, StoreLockedError, StoreMismatchError,
                    manifest_geometry, read_manifest)
from .tier import Tier, TierClosedError

log = logging.getLogger("gdskv.cluster")

#: per-namespace read counters summed into a cluster store's top-level stats
_SUMMED = ("get_pages", "hits", "misses", "corrupt_pages", "read_failed", "bytes_read",
           "read_seconds")


def default_node_id(*ranks: str, device: torch.device | str | None = None) -> str:
    """This process's node id: the host name, the engine's ``ranks`` (e.g. ``"dp1"``, given
    by the adapters) and the GPU this process works on (``device`` when it is one, else the
    current one if this process uses CUDA), as its index among all of the host's GPUs
    (``CUDA_VISIBLE_DEVICES`` resolved): engine processes on one host get distinct ids."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname().split(".")[0]).strip("-._")
    parts = [host or "node", *ranks]
    gpu = _physical_gpu(device)
    if gpu is not None:
        parts.append(f"gpu{gpu}")
    return check_node_id("-".join(parts)[:128])


def _physical_gpu(device) -> str | None:
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and dev.index is not None:
        index = dev.index
    elif cuda_available() and torch.cuda.is_initialized():  # never starts CUDA by itself
        index = torch.cuda.current_device()
    else:
        return None
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
               if v.strip()]
    return re.sub(r"[^A-Za-z0-9._-]", "-", visible[index]) if index < len(visible) \
        else str(index)


def open_tier(layout: PageLayout, config: TierConfig | None = None, *,
              device: torch.device | str | None = None, node_ranks: Sequence[str] = (),
              metrics_registry=None) -> "Tier | ClusterStore":
    """A :class:`ClusterStore` when ``config.cluster`` is on (its default node id built with
    the engine's ``node_ranks``), else a :class:`Tier`: what the engine adapters open."""
    config = config if config is not None else TierConfig.from_env()
    if config.cluster:
        return ClusterStore(layout, config, device=device, node_ranks=node_ranks,
                            metrics_registry=metrics_registry)
    return Tier(layout, config, device=device, metrics_registry=metrics_registry)


class _Peer:
    """Another node's namespace, open as a follower, and the manifest identity it was opened
    at (a new one means its writer made the store again or cleared it)."""

    def __init__(self, tier: Tier, identity: tuple) -> None:
        self.tier = tier
        self.identity = identity


class ClusterStore:
    """This node's namespace (a writer :class:`Tier`) and every other node's (followers).

    The same calls as :class:`Tier` where the engine adapters use them
    (:class:`~gdskv.tier_protocol.TierLike`): ``put``/``get``, ``put_pages``/``get_pages`` and
    their ``_async`` forms, ``contains``, ``match_prefix``, ``pin``/``unpin``,
    ``evict``/``clear``/``compact`` (this node's pages only), ``refresh``, ``stats``, ``close``;
    ``store``, ``directory`` and ``backend`` are this node's. Thread-safe.

    Args:
        layout: what every namespace of this cluster stores (namespaces of another layout are
            skipped).
        config: ``cluster`` must be on; ``directories`` are the shared directories (each must
            exist); ``node_id`` ("" = :func:`default_node_id`). With ``read_only`` this node
            writes nothing and only reads the others'.
        device: where staging lives (as for :class:`Tier`).
        node_ranks: the engine's ranks for the default node id (e.g. ``("dp1",)``).
    """

    def __init__(self, layout: PageLayout, config: TierConfig | None = None, *,
                 device: torch.device | str | None = None, node_ranks: Sequence[str] = (),
                 metrics_registry=None) -> None:
        config = config if config is not None else TierConfig.from_env()
        if not config.cluster:
            raise ConfigError("cluster: a ClusterStore needs cluster=true (GDSKV_CLUSTER=true); "
                              "gdskv.open_tier opens a Tier or a ClusterStore as configured")
        if not config.directories:
            raise StoreError("no store directory given (set GDSKV_DIRECTORIES or "
                             "TierConfig(directories=...))")
        for d in config.directories:
            if not os.path.isdir(d):
                raise StoreError(f"cluster directory {d!r} does not exist or is not a "
                                 "directory (an unmounted file system?): mount it or create it")
        self.layout = layout
        self.config = config
        self.node_id = config.node_id or default_node_id(*node_ranks, device=device)
        self.read_only = bool(config.read_only)
        self._registry = metrics_registry
        self._tier_config = config.replace(cluster=False, node_id="")
        self._peers: dict[str, _Peer] = {}
        self._skipped: dict[str, tuple] = {}   # namespace -> manifest identity it was skipped at
        self._log_once = LogOnce(log)  # one line per kind of event
        self._counts: collections.Counter = collections.Counter()
        self._counts_lock = threading.Lock()
        self._discovery = threading.Lock()
        self._discovered_at = float("-inf")
        self._closed = False
        self.own: Tier | None = None
        # each other namespace's follower tier stages this much on this node's device (a
        # writer's Tier defaults to the GPU, a read-only node to the CPU): refused before
        # anything is made on disk, naming this setting, not when each peer opens
        default = "cuda" if cuda_available() and not self.read_only else "cpu"
        StagingParts.check_fits(config.cluster_peer_staging_size,
                                check_device(device if device is not None else default),
                                "cluster_peer_staging_size")
        if not self.read_only:
            self.own = self._open_own(device)
        self.device = self.own.device if self.own is not None else \
            check_device(device if device is not None else "cpu")
        self._worker = ThreadPoolExecutor(config.pipeline_depth, thread_name_prefix="gdskv-cluster")
        self._lister = ThreadPoolExecutor(1, thread_name_prefix="gdskv-cluster-list")
        try:
            self.discover()
        except BaseException:
            self.close()
            raise
        log.info("gdskv cluster node %s in %s: %d other namespaces readable",
                 self.node_id, ", ".join(config.directories), len(self._peers))

    def _open_own(self, device) -> Tier:
        dirs = tuple(os.path.join(d, self.node_id) for d in self.config.directories)
        # a gdskv cluster reclaim of this namespace cannot run until the store holds its lock
        with namespaces.starting_writer(self.config.directories):
            for d in dirs:
                if os.path.islink(d) or os.path.lexists(d) and not os.path.isdir(d):
                    raise StoreError(f"{d!r} (node {self.node_id!r}'s namespace) exists but is "
                                     "not a directory of its own (a file, or a link, which the "
                                     "other nodes would not read); remove it or choose another "
                                     "node_id")
                os.makedirs(d, mode=0o700, exist_ok=True)
            try:
                return Tier(self.layout, self._tier_config.replace(directories=dirs),
                            device=device, metrics_registry=self._registry)
            except StoreLockedError as exc:
                raise StoreLockedError(f"{exc}: node id {self.node_id!r} is in use by another "
                                       "process; give each engine process its own node_id "
                                       "(GDSKV_NODE_ID)") from None

    # -- namespaces -----------------------------------------------------------------------------
    @property
    def peers(self) -> dict[str, Tier]:
        """The other nodes' namespaces open now, by node id."""
        return {name: p.tier for name, p in sorted(self._peers.copy().items())}

    @property
    def store(self):
        """This node's slab store (None on a read-only node)."""
        return self.own.store if self.own is not None else None

    @property
    def directory(self):
        """This node's page directory: the pages it stored (None on a read-only node)."""
        return self.own.directory if self.own is not None else None

    @property
    def backend(self):
        return self.own.backend if self.own is not None else None

    def discover(self) -> int:
        """List the shared directory now: open new namespaces, reopen re-made ones, close
        vanished ones (calls do this themselves every ``cluster_discovery_ms``). Returns the
        number of other namespaces open."""
        with self._discovery:
            self._discovered_at = time.monotonic()
            root = self.config.directories[0]
            try:
                names = sorted(e.name for e in os.scandir(root)
                               if e.name != self.node_id and e.is_dir(follow_symlinks=False)
                               and not e.name.startswith("."))
            except OSError as exc:  # the namespaces open stay readable
                self._log_once(f"list:{exc.errno}", "cannot list cluster directory %s: %s",
                               root, exc)
                return len(self._peers)
            for name in set(self._peers) - set(names):
                self._close_peer(name, "its namespace was removed")
            for name in names:
                identity = self._identity(name)
                peer = self._peers.get(name)
                if identity is None or peer is not None and peer.identity == identity or \
                        self._skipped.get(name) == identity:
                    continue  # not made yet, unchanged, or known to be another layout's
                if peer is not None:
                    self._close_peer(name, "its writer made the store again or cleared it")
                self._open_peer(name, identity)
            return len(self._peers)

    def _identity(self, name: str) -> tuple | None:
        try:
            st = os.stat(os.path.join(self.config.directories[0], name, MANIFEST))
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def _open_peer(self, name: str, identity: tuple) -> None:
        dirs = tuple(os.path.join(d, name) for d in self.config.directories)
        try:
            manifest = read_manifest(dirs[0])
            geometry = manifest_geometry(manifest, len(dirs))
            # one slot per pipeline part at least: peers' pages may be larger than ours
            staging = max(self.config.cluster_peer_staging_size,
                          self.config.pipeline_depth * int(manifest["slot_bytes"]))
            StagingParts.check_fits(staging, self.device, "cluster_peer_staging_size")
            cfg = self._tier_config.replace(directories=dirs, read_only=True, preallocate=False,
                                            staging_size=staging, **geometry)
            tier = Tier(self.layout, cfg, device=self.device, metrics_registry=self._registry)
            tier.FOLLOW_INTERVAL = self.config.cluster_follow_ms / 1000
        except StoreMismatchError as exc:  # another model, sharding or format: not ours
            self._skipped[name] = identity
            self._log_once(f"skip:{name}", "cluster: namespace %s skipped: %s", name, exc,
                           level=logging.INFO)
            return
        except ConfigError as exc:  # e.g. no memory left for its staging now
            self._log_once(f"open:{name}:{exc}", logging.WARNING, "cluster: namespace %s not "
                           "readable: %s; trying again at each listing", name, exc)
            return
        except (StoreError, OSError) as exc:
            # e.g. its writer is still creating the store: tried again at the next listing
            self._log_once(f"open:{name}:{exc}", "cluster: namespace %s not readable yet (%s); "
                           "trying again", name, exc, level=logging.INFO)
            return
        self._skipped.pop(name, None)
        self._peers[name] = _Peer(tier, identity)
        self._count(namespaces_opened=1)
        log.info("gdskv cluster: reading node %s's namespace (%d pages)", name,
                 len(tier.directory))

    def _close_peer(self, name: str, why: str) -> None:
        peer = self._peers.pop(name)
        log.info("gdskv cluster: closing node %s's namespace: %s", name, why)
        self._count(namespaces_closed=1)
        peer.tier.close()  # waits for its calls in flight; later ones find it closed (a miss)

    def _discover_if_due(self) -> None:
        """Start a listing in the background when one is due: opening a namespace (its files,
        staging, kernel warm-up on a GPU) must not stall the engine's call that noticed it."""
        if time.monotonic() - self._discovered_at < self.config.cluster_discovery_ms / 1000 \
                or self._discovery.locked():
            return
        self._discovered_at = time.monotonic()  # one listing per interval, not one per call
        try:
            self._lister.submit(self.discover)
        except RuntimeError:  # closing: no more listings
            pass

    def _tiers(self) -> list[Tier]:
        """This node's tier first, then the others' in name order."""
        peers = [p.tier for _, p in sorted(self._peers.copy().items())]
        return ([self.own] if self.own is not None else []) + peers

    # -- lookups --------------------------------------------------------------------------------
    def contains(self, key: Hashable) -> bool:
        self._start()
        return any(_holds(t, key) for t in self._tiers())

    def match_prefix(self, keys: Sequence[Hashable]) -> int:
        """How many leading keys are stored in some namespace (each run of keys is taken from
        the namespace holding the longest one)."""
        self._start()
        keys = list(keys)
        tiers = self._tiers()
        pos = 0
        while pos < len(keys):
            run = max((_safe(t.match_prefix, 0, keys[pos:]) for t in tiers), default=0)
            if run == 0:
                break
            pos += run
        return pos

    # -- reads ----------------------------------------------------------------------------------
    def get(self, keys: Sequence[Hashable], kv_pool, token_slots) -> list[bool]:
        """Restore pages from whichever namespace holds them (see :meth:`Tier.get`)."""
        keys = self._keys(keys)
        call = self._pool_call(keys, kv_pool, token_slots, "get_async")
        return self._read_rest(*self._read_first(keys, call))

    def get_async(self, keys, kv_pool, token_slots) -> Future:
        keys = self._keys(keys)
        call = self._pool_call(keys, kv_pool, token_slots, "get_async")
        return self._worker.submit(self._read_rest, *self._read_first(keys, call))

    def get_pages(self, keys: Sequence[Hashable], pages) -> list[bool]:
        keys = self._keys(keys)
        call = self._pages_call(keys, pages, "get_pages_async")
        return self._read_rest(*self._read_first(keys, call))

    def get_pages_async(self, keys: Sequence[Hashable], pages) -> Future:
        keys = self._keys(keys)
        call = self._pages_call(keys, pages, "get_pages_async")
        return self._worker.submit(self._read_rest, *self._read_first(keys, call))

    def _read_first(self, keys, call) -> tuple:
        """Check the call, find each key's holders and start the first round of reads here, in
        the caller (a bad argument raises here, as :meth:`Tier.get_async` does). Keys held
        nowhere go to this node's tier too: it counts them as misses."""
        holders: list[list[Tier]] = [[] for _ in keys]
        for tier in self._tiers():
            for h, held in zip(holders, _held_by(tier, keys)):
                if held:
                    h.append(tier)
        if self.own is not None:
            for h in holders:
                if not h:
                    h.append(self.own)
        results = [False] * len(keys)
        return keys, holders, results, call, self._issue(holders, range(len(keys)), call)

    def _read_rest(self, keys, holders, results, call, issued) -> list[bool]:
        """Collect a round of reads; a page that missed is asked of its next holder."""
        while issued:
            for tier, idx, fut in issued:
                try:
                    got = fut.result()
                except TierClosedError:  # its namespace vanished meanwhile: misses
                    got = [False] * len(idx)
                for i, ok in zip(idx, got):
                    results[i] = results[i] or ok
                if tier is not self.own:
                    self._count(peer_hits=sum(got))
            retry = [i for i in range(len(keys)) if not results[i] and holders[i]]
            self._count(peer_retries=len(retry))
            issued = self._issue(holders, retry, call)
        return results

    @staticmethod
    def _issue(holders, positions, call) -> list[tuple[Tier, list[int], Future]]:
        by_tier: dict[Tier, list[int]] = {}
        for i in positions:
            if holders[i]:
                by_tier.setdefault(holders[i].pop(0), []).append(i)
        issued = []
        for tier, idx in by_tier.items():
            try:
                issued.append((tier, idx, call(tier, idx)))
            except TierClosedError:
                pass  # a namespace closed since the lookup: its pages are misses
        return issued

    # -- writes (this node's namespace) ---------------------------------------------------------
    def put(self, keys: Sequence[Hashable], kv_pool, token_slots) -> list[bool]:
        """Store pages in this node's namespace, skipping keys another node holds (with
        ``cluster_dedup``): those count as stored."""
        keys = self._keys(keys)
        return self._write(keys, self._pool_call(keys, kv_pool, token_slots, "put_async")
                           ).result()

    def put_async(self, keys, kv_pool, token_slots) -> Future:
        keys = self._keys(keys)
        return self._write(keys, self._pool_call(keys, kv_pool, token_slots, "put_async"))

    def put_pages(self, keys: Sequence[Hashable], pages) -> list[bool]:
        keys = self._keys(keys)
        return self._write(keys, self._pages_call(keys, pages, "put_pages_async")).result()

    def put_pages_async(self, keys: Sequence[Hashable], pages) -> Future:
        keys = self._keys(keys)
        return self._write(keys, self._pages_call(keys, pages, "put_pages_async"))

    def _write(self, keys: list, call) -> Future:
        if self.own is None:
            self._log_once("read-only", "read-only cluster node: puts store nothing")
            return _done([False] * len(keys))
        results = [False] * len(keys)
        todo = list(range(len(keys)))
        if self.config.cluster_dedup:
            elsewhere = [any(h) for h in zip(*(_held_by(p, keys) for p in self._tiers()[1:]))]
            here = _held_by(self.own, keys)
            held = {i for i, (e, o) in enumerate(zip(elsewhere, here)) if e and not o}
            for i in held:
                results[i] = True
            todo = [i for i in todo if i not in held]
            self._count(dedup_skipped=len(held))
        if not todo:
            return _done(results)
        inner = call(self.own, todo)
        out: Future = Future()

        def merge(f: Future) -> None:
            try:
                for i, ok in zip(todo, f.result()):
                    results[i] = ok
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's future
                out.set_exception(exc)
            else:
                out.set_result(results)
        inner.add_done_callback(merge)
        return out

    # -- one call's sub-calls on one namespace --------------------------------------------------
    def _pool_call(self, keys, kv_pool, token_slots, method: str) -> Callable:
        """``call(tier, positions)``: the tier's ``method`` for those keys' pages of
        ``kv_pool`` (their token slots cut out of ``token_slots``)."""
        n, ps = len(keys), self.layout.page_size
        slots = (token_slots if isinstance(token_slots, torch.Tensor) else
                 torch.as_tensor(token_slots)).reshape(-1)
        if slots.numel() != n * ps:
            raise ValueError(f"got {slots.numel()} slot indices for {n} pages; expected pages "
                             f"x page_size = {n * ps}")
        by_page = slots.view(n, ps)

        def call(tier: Tier, positions: list[int]) -> Future:
            sub = slots if positions == list(range(n)) else by_page[
                torch.as_tensor(positions, device=slots.device)].reshape(-1)
            return getattr(tier, method)([keys[i] for i in positions], kv_pool, sub)
        return call

    @staticmethod
    def _pages_call(keys: list, pages, method: str) -> Callable:
        """``call(tier, positions)``: the tier's ``method`` for those keys' page regions."""
        if len(pages) != len(keys):
            raise ValueError(f"got {len(pages)} page buffers for {len(keys)} keys")

        def call(tier: Tier, positions: list[int]) -> Future:
            return getattr(tier, method)([keys[i] for i in positions],
                                         [pages[i] for i in positions])
        return call

    # -- pins, maintenance, stats ---------------------------------------------------------------
    def pin(self, keys: Sequence[Hashable]) -> list[tuple[str, int] | None]:
        """Hold pages for a later read where they are (see :meth:`Tier.pin`): per key a handle
        ``(node id, slot)`` or None; give each back to :meth:`unpin` once."""
        keys = self._keys(keys)
        named = ([(self.node_id, self.own)] if self.own is not None else []) + \
            sorted((n, p.tier) for n, p in self._peers.copy().items())
        handles: list[tuple[str, int] | None] = [None] * len(keys)
        for name, tier in named:
            held = _held_by(tier, keys)
            idx = [i for i, h in enumerate(handles) if h is None and held[i]]
            if idx:
                got = _safe(tier.pin, [None] * len(idx), [keys[i] for i in idx])
                for i, slot in zip(idx, got):
                    handles[i] = None if slot is None else (name, slot)
        return handles

    def unpin(self, handles: Sequence[tuple[str, int]]) -> None:
        self._check_open()
        by_node: dict[str, list[int]] = {}
        for name, slot in handles:
            by_node.setdefault(name, []).append(slot)
        for name, slots in by_node.items():
            tier = self.own if name == self.node_id else self.peers.get(name)
            if tier is not None:  # a namespace closed meanwhile dropped its pins with it
                _safe(tier.unpin, None, slots)

    def evict(self, keys: Sequence[Hashable]) -> int:
        """Drop pages from this node's namespace (the others' are their writers' to evict)."""
        self._check_open()
        return self.own.evict(keys) if self.own is not None else 0

    def clear(self) -> None:
        """Drop every page of this node's namespace."""
        self._check_open()
        if self.own is not None:
            self.own.clear()

    def compact(self) -> None:
        self._check_open()
        if self.own is not None:
            self.own.compact()

    def refresh(self) -> int:
        """List the namespaces and catch up with every other node's journal now; returns
        the records applied."""
        self._check_open()
        self.discover()
        return sum(_safe(t.refresh, 0) for t in self._tiers()[1 if self.own else 0:])

    def stats(self) -> dict:
        """This node's tier's stats, with the read counters summed over every namespace and
        ``cluster``: the node id, the cluster counters and each namespace's page count."""
        s = dict(self.own.stats()) if self.own is not None else {}
        peers = {name: t.stats() for name, t in self.peers.items()}
        for key in _SUMMED:
            s[key] = s.get(key, 0) + sum(p.get(key, 0) for p in peers.values())
        if self.own is None:  # a read-only node: what it can read
            s["pages_stored"] = sum(p["pages_stored"] for p in peers.values())
        s["read_gbps"] = s["bytes_read"] / s["read_seconds"] / 1e9 if s["read_seconds"] else 0.0
        with self._counts_lock:
            counts = dict(self._counts)
        s["cluster"] = dict(counts, node_id=self.node_id, read_only=self.read_only,
                            dedup=self.config.cluster_dedup, namespaces={
                                name: {"pages_stored": p["pages_stored"], "hits": p.get("hits", 0),
                                       "corrupt_pages": p.get("corrupt_pages", 0)}
                                for name, p in peers.items()})
        return s

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._worker.shutdown(wait=True)
        self._lister.shutdown(wait=True)
        with self._discovery:
            for name in list(self._peers):
                self._peers.pop(name).tier.close()
        if self.own is not None:
            self.own.close()

    def __enter__(self) -> "ClusterStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- helpers --------------------------------------------------------------------------------
    def _start(self) -> None:
        self._check_open()
        self._discover_if_due()

    def _keys(self, keys) -> list:
        """The call's keys, checked as :class:`Tier` checks them (before any routing)."""
        self._start()
        return Tier._check_keys(keys)

    def _check_open(self) -> None:
        if self._closed:
            raise TierClosedError("cluster store is closed: open a new one to use it again")

    def _count(self, **amounts: int) -> None:
        with self._counts_lock:
            self._counts.update(amounts)


def _holds(tier: Tier, key: Hashable) -> bool:
    return _safe(tier.contains, False, key)


def _held_by(tier: Tier, keys: list) -> list[bool]:
    """Which of ``keys`` a tier holds: its ``contains`` once (where a follower catches up
    with its writer's journal), then its directory for the rest (a dict lookup each)."""
    if not keys:
        return []
    try:
        first = tier.contains(keys[0])
        directory = tier.directory
    except TierClosedError:  # its namespace vanished meanwhile
        return [False] * len(keys)
    return [first] + [directory.contains(k) for k in keys[1:]]


def _safe(fn, default, *args):
    """``fn(*args)``, or ``default`` when its tier was closed meanwhile (its namespace
    vanished): the pages there are misses."""
    try:
        return fn(*args)
    except TierClosedError:
        return default


def _done(value) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut
