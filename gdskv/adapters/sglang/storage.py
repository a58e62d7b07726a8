"""SGLang HiCache L3 storage backend on gdskv tiers.

Loaded by SGLang's own dynamic-backend mechanism (``StorageBackendFactory``)::

    --enable-hierarchical-cache --hicache-mem-layout page_first_direct \\
    --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "gdskv",
        "module_path": "gdskv.adapters.sglang", "class_name": "GdskvHiCacheStorage",
        "interface_v1": 1, "directories": "/mnt/nvme0/kv:/mnt/nvme1/kv", "capacity": "512GiB"}'

SGLang builds it as ``cls(storage_config, kwargs)`` and then calls
:meth:`register_mem_pool_host`; ``"interface_v1": 1`` makes the cache controller use the
zero-copy calls (``batch_exists`` / ``batch_get_v1`` / ``batch_set_v1``) on host-pool pages.

Every key of ``extra_config`` that names a :class:`~gdskv.config.TierConfig` field is a tier
option (``directories``, ``capacity``, ``backend``, ``io_threads``...); ``GDSKV_*`` environment
variables fill in the rest (extra_config wins). ``device`` picks where the tier stages pages
(``"cpu"``, the default, since SGLang hands us host memory; ``"cuda"`` stages on the GPU for the
kvikio backend). ``capacity`` is per rank.

How host-pool pages reach the tier (gdskv page format ``[kv][layer][token][row]``):

- ``page_first_direct``: a page's K block and V block (one block for MLA) are already in that
  order, so they go to :meth:`Tier.put_pages` / :meth:`Tier.get_pages` as tensor views of the
  pool's ``kv_buffer``: no copy besides the one into the staging buffer.
- ``page_first`` (token-major within a page) and ``layer_first``: the pool is handed to
  :meth:`Tier.put` / :meth:`Tier.get` as per-layer strided views of ``kv_buffer``; the tier's
  gather/scatter kernels do the reorder while filling or draining staging.
- any other host pool (another layout, a pool class SGLang adds later): its pages go through
  SGLang's generic page calls (``get_data_page(flat=True)`` / ``set_from_flat_data_page``, a
  copy each way) into a store of byte pages under ``<directory>/<model>/kv/<shard>``; a KV
  transfer of the v2 calls goes to the KV store like the v1 calls' pages.

Sharding: each rank owns a KV store under ``<directory>/<model>/kv/<shard>`` (the naming all
adapters share: :mod:`gdskv.adapters.common`, docs/adapters.md); the shard name and the
store fingerprint carry model, TP/PP (and CP/DP where used) ranks, and keys get SGLang's
``_<model>_<tp_rank>_<tp_size>`` style suffix, so pages of another sharding never hit. For MLA the
KV is the same on every TP rank: only the writer rank (``storage_config.is_storage_writer``) writes;
the others answer ``batch_set_v1`` with success and store nothing, as SGLang's controller expects,
and read the writer's store through a read-only follower tier (``TierConfig.read_only``), opened
lazily (:mod:`.rank_store`).

Cluster store (``"cluster": true`` or ``GDSKV_CLUSTER=true``; :mod:`gdskv.cluster`): several
SGLang servers (or DP ranks) on one shared mount share each shard's store. Each is a node with
its own namespace under the shard directory, its node id the host name, ``dp<rank>`` and the
GPU (or ``node_id``); reads find pages any node wrote, and DP ranks share the shard directory.

Hybrid models (SGLang's v2 interface): ``HybridCacheController`` registers every other host pool
(Mamba states, sliding-window KV, DSA indexer, DeepSeek-V4 compressed pools, draft KV) with
:meth:`register_mem_host_pool_v2` and moves them with ``batch_exists_v2`` / ``batch_get_v2`` /
``batch_set_v2``. Each such *sidecar* pool gets a store of its own, of byte pages
(:class:`~gdskv.layout.BytePageLayout`; how a pool's pages become bytes: :mod:`.sidecar`), under
``<directory>/<model>/<pool>/<shard>``: pools differ in page size, so one shared store would
pad every slot to the largest page. Keys are the same page hashes as KV's, scoped by the store.
A sidecar store's ``capacity`` is the KV ``capacity`` times the pool's host memory over the KV
host pool's (``pool_capacity`` overrides it per pool). Stores evict independently; what keeps a
KV page whose sidecar pages were evicted from counting as a hit is ``batch_exists_v2``, which
checks every pool under its hit policy (:mod:`.hit_policy`), and every read, which reports each
page it did not read and verify as a miss.

The exception: a pool whose host slots SGLang declares to be the KV's own
(:func:`.sidecar.rides_on_kv_slots`: the DSA indexer) *rides in the KV page* where the KV page
moves whole and zero-copy (``interface_v1``, ``page_first_direct``) and the pool is registered
before the KV store opens (:meth:`on_host_pools_registered`, or the first call): the KV store's
page is then the KV page followed by the rider's (``<directory>/<model>/kv+<riders>/<shard>``),
``batch_set_v2`` of the rider writes the whole page (SGLang sends it before the KV's
``batch_set_v1``, which then reports what is stored), ``batch_get_v1`` reads it whole into both
pools' host slots, and the rider's ``batch_get_v2`` that follows on the same thread is answered
from that read (:class:`.sidecar.LastRead`). One slot, one checksum: the rider is never evicted
apart from its KV, and a prefetch reads each page once.

For MLA models a sidecar pool that is the same on every TP rank (everything but Mamba states and
MHA-shaped pools) is written by the writer rank and followed by the others, like MLA KV.

Data-path calls never raise and never return ``None``: a failure is logged once per kind and
becomes a miss (``False`` / a shorter prefix), because an exception would kill SGLang's prefetch or
backup thread and silently switch L3 off.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any, List, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolName,
    PoolTransferResult,
)

from ...config import ConfigError, parse_bool, parse_size
from ...layout import KVLayout
from ...log_once import LogOnce
from ...memory import check_device
from ...tier_protocol import TierLike
from ..common import safe_name, shard_name, store_directories, tier_config
from . import hit_policy
from .rank_store import RankStore
from .sidecar import (
    REGIONS,
    LastRead,
    PagesOnly,
    SidecarPool,
    kv_slot_config,
    kv_slot_layout,
    page_starts,
    pool_name as _pool_name,
    rides_on_kv_slots,
    store_config,
)

log = logging.getLogger("gdskv.sglang")

#: extra_config keys that SGLang's dynamic loader itself reads.
LOADER_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
#: extra_config keys this adapter reads besides TierConfig fields and create_directories.
ADAPTER_KEYS = frozenset({"device", "pool_capacity", "sidecar_in_kv_page"})
#: extra_config keys SGLang itself adds for every backend (``--file-storage-path``, 0.5.23).
SGLANG_KEYS = frozenset({"file_storage_path"})
_LAYOUTS = ("page_first_direct", "page_first", "layer_first")
# One-byte KV types SGLang stores as raw bytes (fp8 caches): copies are byte-wise, so they are
# carried under gdskv's one-byte dtype name.
_BYTE_DTYPES = (torch.uint8, torch.int8)
#: pages a rider reads at a time when no KV read just brought them in (bounds the scratch that
#: takes their KV bytes)
RIDER_ALONE_PAGES = 8


def _parse_pool_capacity(value) -> dict[str, int]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"gdskv: extra_config \"pool_capacity\" must map pool names to "
                          f"sizes, e.g. {{\"mamba\": \"64GiB\"}}; got {value!r}")
    return {str(k): parse_size(v, what=f"extra_config pool_capacity[{k!r}]")
            for k, v in value.items()}


@dataclasses.dataclass
class _Sidecar:
    """A registered sidecar pool, its store on this rank and its key suffix. A pool that rides
    in the KV page (``in_kv_page``) has the KV store as its store, set when that opens."""

    pool: SidecarPool
    store: Optional[RankStore]
    key_suffix: str
    in_kv_page: bool = False

    def storage_keys(self, keys: List[str]) -> List[str]:
        return [f"{k}{self.key_suffix}" for k in keys]


class GdskvHiCacheStorage(HiCacheStorage):
    """A :class:`HiCacheStorage` whose pages live in gdskv slab stores on NVMe: one for the KV
    pool, one per sidecar pool of a hybrid model.

    Args:
        storage_config: what SGLang passes (ranks, MLA flag, model name, ``extra_config``).
        kwargs: the factory's extra keyword arguments (SGLang passes none today); unused.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        if not isinstance(storage_config, HiCacheStorageConfig):
            raise TypeError(f"storage_config must be a HiCacheStorageConfig, got "
                            f"{type(storage_config).__name__}")
        self.storage_config = storage_config
        extra = dict(storage_config.extra_config or {})
        # Validates GDSKV_*, the options and the store directories now, so a bad option stops
        # SGLang at start-up rather than on the first request.
        self.config = tier_config(extra, where="--hicache-storage-backend-extra-config",
                                  adapter_keys=ADAPTER_KEYS, engine_keys=LOADER_KEYS | SGLANG_KEYS)
        self.device = check_device(extra.get("device", "cpu"), "device")
        self.pool_capacity = _parse_pool_capacity(extra.get("pool_capacity"))
        # KV-derived pools ride in the KV page where SGLang moves KV pages whole and zero-copy
        # (interface_v1 and page_first_direct, checked at registration); see _kv_page_riders.
        self.sidecar_in_kv_page = parse_bool(extra.get("sidecar_in_kv_page", True),
                                             "sidecar_in_kv_page")
        self._interface_v1 = bool(extra.get("interface_v1", 0))  # as SGLang reads it

        sc = storage_config
        self.model_name = safe_name(sc.model_name or "")
        self.is_mla = bool(sc.is_mla_model)
        self.is_writer = bool(sc.is_storage_writer)
        shard = ""
        if sc.pp_size > 1:
            shard += f"_pp{sc.pp_rank}-{sc.pp_size}"
        if sc.attn_cp_size > 1:
            shard += f"_cp{sc.attn_cp_rank}-{sc.attn_cp_size}"
        if sc.dcp_size > 1:
            raise ValueError("gdskv: decode context parallel (dcp_size > 1) is not supported")
        self._shard = shard  # in the keys' suffix (and the stores' earlier names)
        # MLA KV is identical on every TP rank (one store, written by the writer rank); MHA KV
        # is split by heads, so each TP rank has its own.
        self.key_suffix = self._key_suffix(replicated=self.is_mla)
        self.enable_metrics = bool(sc.enable_storage_metrics)
        self.kv_layout: Optional[KVLayout] = None
        self._kv_store: Optional[RankStore] = None
        #: the KV pool when its pages go through SGLang's generic page calls (not in place)
        self._kv_generic: Optional[SidecarPool] = None
        self._kv_store_lock = threading.Lock()
        self._kv_host_bytes = 0
        self._last_read = LastRead()
        #: sidecar pools (register_mem_host_pool_v2) by name
        self.sidecars: dict[str, _Sidecar] = {}
        self.mem_pool_host = None
        self._pool_views = None
        self._log_once = LogOnce(log, logging.ERROR, prefix="gdskv: ")
        self._metrics_lock = threading.Lock()
        self._metrics = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                         "backup_bandwidth": []}

    @property
    def tier(self) -> Optional[TierLike]:
        """The KV tier on this rank (None until open, or while a follower waits for the
        writer's store)."""
        store = self._open_kv_store()
        return store.tier if store is not None else None

    def _kv_tier(self) -> Optional[TierLike]:
        store = self._open_kv_store()
        return store.open() if store is not None else None

    @property
    def _kv_page_riders(self) -> list[_Sidecar]:
        """The sidecar pools stored in the KV page, in registration order."""
        return [side for side in self.sidecars.values() if side.in_kv_page]

    def _key_suffix(self, *, replicated: bool) -> str:
        """What this rank appends to the page hashes of a pool that is the same on every TP
        rank (``replicated``) or split by TP rank."""
        sc = self.storage_config
        tp = "" if replicated else f"_tp{sc.tp_rank}-{sc.tp_size}"
        return f"_{self.model_name}{tp}{self._shard}"

    def _node_ranks(self) -> tuple[str, ...]:
        """What this engine process adds to a cluster store's default node id (host name and
        GPU come first and last): its DP rank. The TP/PP rank is in the shard directory."""
        return (f"dp{self.storage_config.dp_rank or 0}",)

    def _store_dirs(self, store: str, *, replicated: bool) -> tuple[str, ...]:
        """This rank's directories of ``store`` (``kv``, ``kv+<riders>`` or a sidecar pool's
        name), made: ``<directory>/<model>/<store>/<shard>`` (:func:`.common.shard_name`).
        A store under its earlier name (``<model>/[<pool>/]<tp<r>-<n>|mla>...``) stays in use."""
        sc = self.storage_config
        # Separate processes cannot share one store (it is flock-ed): DP ranks get their own,
        # except in a cluster store, where each one is a node (its own namespace, node id
        # from the DP rank) and all of them share the shard's directory.
        dp = sc.dp_rank or 0
        shard = shard_name(tp_rank=sc.tp_rank, tp_size=sc.tp_size, pp_rank=sc.pp_rank,
                           pp_size=sc.pp_size, cp_rank=sc.attn_cp_rank, cp_size=sc.attn_cp_size,
                           dp_rank=dp, same_on_tp_ranks=replicated, cluster=self.config.cluster)
        earlier = ("mla" if replicated else f"tp{sc.tp_rank}-{sc.tp_size}") + self._shard + \
            (f"_dp{dp}" if dp and not self.config.cluster else "")
        if store != "kv":
            earlier = os.path.join(store, earlier)
        return store_directories(self.config.directories, self.model_name, store, shard,
                                 earlier=[os.path.join(self.model_name, earlier)], create=True)

    # -- set-up ---------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Open this rank's store for the host pool's KV (SGLang calls this once, right after
        construction). A pool gdskv moves in place (:meth:`_kv_in_place`) has its pages moved
        as views of its ``kv_buffer``; any other pool's pages go through SGLang's generic page
        calls (``get_data_page`` / ``set_from_flat_data_page``), a copy each way. A pool that
        offers neither raises here, at start-up."""
        super().register_mem_pool_host(mem_pool_host)
        if self._kv_store is not None:
            raise RuntimeError("gdskv: the KV store is open already (for pages of "
                               f"{self._kv_store.layout.page_bytes} B): register_mem_pool_host "
                               "comes before any data call")
        why_not = self._kv_in_place(mem_pool_host)
        if why_not is not None:
            self._kv_through_page_calls(mem_pool_host, why_not)
        if not self._riders_possible():
            self._open_kv_store()
        # else the store opens at on_host_pools_registered (or first use), once the pools
        # that ride in its pages are known

    def _kv_in_place(self, mem_pool_host) -> Optional[str]:
        """Take ``mem_pool_host`` as a KV pool whose pages move in place (SGLang's MHA and MLA
        token pools in a layout of ``_LAYOUTS``), or say why it is not one (nothing is set
        then). Raises where the pool contradicts the storage config."""
        layout_name = getattr(mem_pool_host, "layout", None)
        if layout_name not in _LAYOUTS:
            return f"has layout {layout_name!r} (in place: {', '.join(_LAYOUTS)})"
        buf = getattr(mem_pool_host, "kv_buffer", None)
        if not isinstance(buf, torch.Tensor):
            return f"has a kv_buffer of {type(buf).__name__}, not one tensor"
        if buf.dtype in _BYTE_DTYPES:
            buf = buf.view(torch.float8_e4m3fn)
        pool_is_mla = hasattr(mem_pool_host, "kv_cache_dim")
        if pool_is_mla != self.is_mla:
            raise ValueError(f"gdskv: storage_config.is_mla_model={self.is_mla} but the host "
                             f"pool is {type(mem_pool_host).__name__}")
        sc = self.storage_config
        try:
            page_size = int(mem_pool_host.page_size)
            if self.is_mla:
                heads, head_dim = 1, int(mem_pool_host.kv_cache_dim)
                # One leading K/V axis of size 1, so both pool kinds index the same way below.
                buf = buf.unsqueeze(0)
            else:
                heads, head_dim = int(mem_pool_host.head_num), int(mem_pool_host.head_dim)
                v_dim = int(getattr(mem_pool_host, "v_head_dim", head_dim))
                if v_dim != head_dim:
                    return f"has K and V head dims that differ ({head_dim} vs {v_dim})"
            kv_layout = KVLayout(
                num_layers=int(mem_pool_host.layer_num), page_size=page_size, head_dim=head_dim,
                kv_heads=heads, dtype=buf.dtype, mla=self.is_mla, model_name=self.model_name,
                tp_rank=0 if self.is_mla else sc.tp_rank,
                tp_size=1 if self.is_mla else sc.tp_size, pp_rank=sc.pp_rank, pp_size=sc.pp_size)
        except (AttributeError, TypeError, ValueError) as exc:
            return f"has no KV geometry gdskv's page format takes ({exc})"
        self.layout_name = layout_name
        self.page_size = page_size
        self.kv_layout = kv_layout
        self._kv = buf  # [kv, ...layout dims...] in the layout's dtype
        if layout_name == "page_first_direct":
            self._pool_views = None  # pages are addressed whole, see _page_regions
        elif layout_name == "page_first":  # [kv, tokens, layers, heads, dim]
            self._pool_views = self._as_pool(buf.transpose(1, 2))
        else:  # layer_first: [kv, layers, tokens, heads, dim]
            self._pool_views = self._as_pool(buf)
        self._kv_host_bytes = kv_layout.page_bytes * max(
            1, int(getattr(mem_pool_host, "size", 0) or 0) // page_size)
        return None

    def _kv_through_page_calls(self, mem_pool_host, why_not: str) -> None:
        """The KV pool's pages through SGLang's generic page calls: ``get_data_page(flat=True)``
        to store, ``set_from_flat_data_page`` to load, by host index and in the per-page calls
        alike (the same bytes), in a store of byte pages under ``<model>/kv/<shard>``."""
        what = f"{type(mem_pool_host).__name__} {why_not}"
        try:
            pool = SidecarPool(PoolName.KV, mem_pool_host, regions=False)
            # a layout SGLang has no page calls for fails here rather than on every call
            page = mem_pool_host.get_data_page(0, flat=True)
            if page.numel() * page.element_size() != pool.page_bytes:
                raise ValueError(f"get_data_page gives {page.numel() * page.element_size()} B, "
                                 f"get_dummy_flat_data_page {pool.page_bytes} B")
        except Exception as exc:  # noqa: BLE001 - any pool class: one clear start-up error
            raise ValueError(f"gdskv: the KV host pool {what}, and SGLang's generic page calls "
                             f"do not take it either: {exc}") from exc
        self._kv_generic = pool
        self.page_size = self._kv_generic.page_size
        self._kv_host_bytes = self._kv_generic.host_bytes
        log.warning("gdskv: the KV host pool %s: its pages go through SGLang's generic page "
                    "calls (get_data_page / set_from_flat_data_page), a copy each way, rather "
                    "than in place", what)

    def _riders_possible(self) -> bool:
        """Whether KV-derived pools may still join the KV page: the option is on, the KV store
        is not open yet, and SGLang moves KV pages whole and zero-copy (interface_v1 calls on a
        page_first_direct pool, the KV page being the tier's page)."""
        return self.sidecar_in_kv_page and self._kv_store is None and self._interface_v1 and \
            getattr(self, "layout_name", None) == "page_first_direct"

    def _open_kv_store(self) -> Optional[RankStore]:
        """This rank's KV store, opened on first need after register_mem_pool_host: a plain KV
        store, one whose pages carry the riders (:func:`.sidecar.kv_slot_layout`) in a
        directory of its own (``<model>/kv+<riders>/<shard>``), or, for a pool whose pages go
        through SGLang's page calls, a store of byte pages (``<model>/kv/<shard>``)."""
        if self._kv_store is not None or (self.kv_layout is None and self._kv_generic is None):
            return self._kv_store
        with self._kv_store_lock:
            if self._kv_store is None:
                riders = self._kv_page_riders
                if self._kv_generic is not None:
                    what = f"KV {self._kv_generic.describe()}"
                    layout = self._pool_layout(self._kv_generic, replicated=self.is_mla)
                    config = self.config.replace(
                        directories=self._store_dirs("kv", replicated=self.is_mla))
                elif riders:
                    names = "+".join(safe_name(_pool_name(side.pool.name)) for side in riders)
                    what = f"{self.layout_name} {'MLA' if self.is_mla else 'MHA'} KV + {names}"
                    layout = kv_slot_layout(self.kv_layout, self.layout_name,
                                            [(side.pool.describe(), side.pool.page_bytes)
                                             for side in riders])
                    config = kv_slot_config(self.config, layout, self.kv_layout.page_bytes,
                                            [side.pool.page_bytes for side in riders],
                                            directories=self._store_dirs(
                                                f"kv+{names}", replicated=self.is_mla))
                else:
                    what = f"{self.layout_name} {'MLA' if self.is_mla else 'MHA'} KV"
                    layout = self.kv_layout
                    config = self.config.replace(
                        directories=self._store_dirs("kv", replicated=self.is_mla))
                # On an MLA rank that does not write, nothing is written from here: the writer
                # rank owns the store and this rank follows it read-only.
                store = RankStore(what, layout, config, self.device,
                                  follower=self.is_mla and not self.is_writer,
                                  log_once=self._log_once, node_ranks=self._node_ranks())
                for side in riders:
                    side.store = store
                self._kv_store = store
        return self._kv_store

    def _pool_layout(self, pool: SidecarPool, *, replicated: bool):
        """The byte-page layout of ``pool``'s store, sharded like a pool that is the same on
        every TP rank (``replicated``) or split by TP rank."""
        sc = self.storage_config
        return pool.layout(model_name=self.model_name, tp_rank=0 if replicated else sc.tp_rank,
                           tp_size=1 if replicated else sc.tp_size, pp_rank=sc.pp_rank,
                           pp_size=sc.pp_size)

    def _as_pool(self, kv_layer_first: torch.Tensor):
        """(k, v) or the MLA tensor as the tier's KVPool takes it: [layers, tokens, heads, dim]."""
        if self.is_mla:
            return kv_layer_first[0]
        return kv_layer_first[0], kv_layer_first[1]

    # -- keys and pages -------------------------------------------------------------------------
    def _storage_keys(self, keys: List[str]) -> List[str]:
        return [f"{k}{self.key_suffix}" for k in keys]

    def _page_regions(self, host_indices: torch.Tensor, n: int) -> List[List[torch.Tensor]]:
        """page_first_direct: per page, its K and V blocks ([layers][tokens][row] each)."""
        ps = self.page_size
        pages = [start // ps for start in page_starts(host_indices, n, ps,
                                                      num_slots=self._kv.shape[1] * ps)]
        kv = self._kv
        return [[kv[c, p].reshape(-1).view(torch.uint8) for c in range(kv.shape[0])]
                for p in pages]

    def _flat_page_view(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat page as SGLang's get_data_page(flat=True) gives it, viewed in page format
        ``[kv][layer][token][row]`` (a strided view for page_first); the page's bytes as they
        are where pages go through SGLang's page calls."""
        if self.kv_layout is None:
            return flat.view(-1).view(torch.uint8)
        lay = self.kv_layout
        t = flat.view(torch.uint8)
        if self.layout_name == "page_first":  # flat order: [kv][token][layer][row]
            return t.view(lay.kv_count, lay.page_size, lay.num_layers, lay.row_bytes) \
                .transpose(1, 2)
        return t.view(lay.kv_count, lay.num_layers, lay.page_size, lay.row_bytes)

    # -- zero-copy data path (SGLang's interface_v1) --------------------------------------------
    def batch_exists(self, keys: List[str], extra_info=None) -> int:
        """How many leading keys are stored."""
        try:
            tier = self._kv_tier()
            return int(tier.match_prefix(self._storage_keys(keys))) if tier is not None else 0
        except Exception as exc:  # noqa: BLE001 - the data path never raises
            self._log_once("exists", "batch_exists failed, reported as a miss: %r", exc)
            return 0

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info=None) -> List[bool]:
        """Read pages into the host pool at ``host_indices``; per-page hit or miss."""
        return self._transfer("get", keys, host_indices)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info=None) -> List[bool]:
        """Write host-pool pages at ``host_indices``; per-page success."""
        return self._transfer("set", keys, host_indices)

    def _transfer(self, op: str, keys: List[str], host_indices: torch.Tensor,
                  call: str = "") -> List[bool]:
        """One batch of KV pages by host index through the tier (``batch_get_v1`` /
        ``batch_set_v1``, or a KV transfer of the v2 calls, named ``call``); any failure is a
        miss / not stored, never raised."""
        n = len(keys)
        if op == "set" and self.is_mla and not self.is_writer:
            return [True] * n  # the writer rank stores this (identical) MLA page
        try:
            tier = self._kv_tier()
            if tier is None:
                return [False] * n
            t0 = time.perf_counter()
            skeys = self._storage_keys(keys)
            riders = self._kv_page_riders
            if riders and op == "get":
                self._last_read.forget()
            if self._kv_generic is not None:  # a pool not moved in place: SGLang's page calls
                res = self._kv_generic.move(op, tier, skeys, host_indices, n)
            elif riders and op == "set":
                # A KV page carrying riders is written whole by a rider's batch_set_v2, which
                # SGLang's hybrid controller sends first with these keys and host indices; a KV
                # page written alone would carry whatever bytes the riders' slots held.
                res = [tier.contains(k) for k in skeys]
            elif self._pool_views is None:
                pages = self._with_riders(self._page_regions(host_indices, n), host_indices, n)
                res = (tier.get_pages if op == "get" else tier.put_pages)(skeys, pages)
                if riders and op == "get":
                    self._last_read.remember(skeys, host_indices, res)
            else:
                res = (tier.get if op == "get" else tier.put)(
                    skeys, self._pool_views, host_indices)
            if not (riders and op == "set"):  # that call moves no bytes
                self._record("prefetch" if op == "get" else "backup", sum(res),
                             self._kv_store.layout.page_bytes, time.perf_counter() - t0)
            return [bool(r) for r in res]
        except Exception as exc:  # noqa: BLE001 - the data path never raises
            call = call or f"batch_{op}_v1"
            self._log_once(call, "%s of %d KV pages failed, reported as %s: %r", call, n,
                           "misses" if op == "get" else "not stored", exc)
            return [False] * n

    def _with_riders(self, pages: List[List[torch.Tensor]], host_indices: torch.Tensor,
                     n: int) -> List[List[torch.Tensor]]:
        """KV pages' regions followed by each rider's regions at the same host indices."""
        for side in self._kv_page_riders:
            for page, extra in zip(pages, side.pool.write_pages(host_indices, n)):
                page.extend(extra)
        return pages

    def _read_rider_alone(self, tier: TierLike, side: _Sidecar, skeys: List[str],
                          host_indices: torch.Tensor, n: int) -> List[bool]:
        """One rider's pages when no KV read just brought them in: whole stored pages, the
        rider's bytes into its regions and the rest (the KV page, other riders) into scratch,
        ``RIDER_ALONE_PAGES`` pages at a time."""
        riders = self._kv_page_riders
        k = riders.index(side)
        before = self.kv_layout.page_bytes + sum(r.pool.page_bytes for r in riders[:k])
        after = sum(r.pool.page_bytes for r in riders[k + 1:])
        regions = side.pool.write_pages(host_indices, n)  # regions mode: the pool's memory
        res: List[bool] = []
        for first in range(0, n, RIDER_ALONE_PAGES):
            m = min(RIDER_ALONE_PAGES, n - first)
            scratch = torch.empty((m, before + after), dtype=torch.uint8)
            pages = [[scratch[j, :before], *regions[first + j]] +
                     ([scratch[j, before:]] if after else []) for j in range(m)]
            res += tier.get_pages(skeys[first:first + m], pages)
        return res

    # -- the older per-page interface (SGLang's generic path) -----------------------------------
    def exists(self, key: str) -> bool:
        try:
            tier = self._kv_tier()
            return tier is not None and tier.contains(self._storage_keys([key])[0])
        except Exception as exc:  # noqa: BLE001
            self._log_once("exists", "exists failed, reported as a miss: %r", exc)
            return False

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        """Read one page into ``target_location`` (a flat page, as SGLang's
        ``get_dummy_flat_data_page``); returns it, or ``None`` for a miss (the interface's
        convention for this older call)."""
        out = self.batch_get([key], [target_location])
        return out[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        n = len(keys)
        try:
            tier = self._flat_pages_tier(target_locations)
            if target_locations is None or tier is None or self._generic_refused():
                return [None] * n
            views = [self._flat_page_view(t) for t in target_locations]
            # Read into contiguous page-format buffers, then into the (maybe strided) targets.
            bufs = [torch.empty(v.shape, dtype=torch.uint8) for v in views]
            res = tier.get_pages(self._storage_keys(keys), [[b.view(-1)] for b in bufs])
            out: List[torch.Tensor | None] = []
            for hit, v, b, t in zip(res, views, bufs, target_locations):
                if hit:
                    v.copy_(b)
                out.append(t if hit else None)
            return out
        except Exception as exc:  # noqa: BLE001
            self._log_once("get", "batch_get of %d pages failed, reported as misses: %r", n, exc)
            return [None] * n

    def _flat_pages_tier(self, pages) -> Optional[Tier]:
        """The KV tier for the per-page calls. With no host pool registered (SGLang's own
        storage unit tests use a backend so) the KV store opens for pages of the first page's
        size (:class:`.sidecar.PagesOnly`)."""
        if pages and self.kv_layout is None and self._kv_generic is None:
            with self._kv_store_lock:
                if self.kv_layout is None and self._kv_generic is None:
                    self._kv_generic = SidecarPool(PoolName.KV, PagesOnly(pages[0]),
                                                   regions=False)
                    log.info("gdskv: no host pool registered: the KV store takes the per-page "
                             "calls' pages of %d B", self._kv_generic.page_bytes)
        return self._kv_tier()

    def _generic_refused(self) -> bool:
        """The per-page calls move KV pages alone, which a KV store whose pages carry riders
        cannot take (it exists only with interface_v1, whose calls SGLang uses instead)."""
        if self._kv_page_riders:
            self._log_once("generic-riders", "the per-page get/set calls are refused: the KV "
                           "pages carry %s; SGLang uses them with \"interface_v1\": 1",
                           ", ".join(self.sidecars_in_kv_page()))
            return True
        return False

    def sidecars_in_kv_page(self) -> list[str]:
        """Names of the sidecar pools stored in the KV page."""
        return [name for name, side in self.sidecars.items() if side.in_kv_page]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """Store flat pages (``get_data_page(flat=True)``); True if every one is stored."""
        if self.is_mla and not self.is_writer:
            return True
        try:
            tier = self._flat_pages_tier(values)
            if tier is None or values is None or self._generic_refused():
                return False
            pages = [[self._flat_page_view(v).contiguous().view(-1)] for v in values]
            return all(tier.put_pages(self._storage_keys(keys), pages))
        except Exception as exc:  # noqa: BLE001
            self._log_once("set", "batch_set of %d pages failed, reported as not stored: %r",
                           len(keys), exc)
            return False

    # -- hybrid models: SGLang's v2 interface (sidecar pools) ----------------------------------
    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """Open this rank's store for one sidecar pool. The KV pool, which SGLang also
        registers here under ``kv``, has its store from :meth:`register_mem_pool_host` (which
        this calls where the KV pool is registered here only). A pool that cannot be stored
        raises here: at start-up, or when SGLang adds a sidecar later."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = _pool_name(host_pool_name)
        if name == _pool_name(PoolName.KV):
            if self.kv_layout is None and self._kv_generic is None:
                self.register_mem_pool_host(host_pool)
            return
        if name in self.sidecars:
            raise ValueError(f"gdskv: sidecar pool {name!r} is already registered")
        pool = SidecarPool(host_pool_name, host_pool)
        # Mamba states and MHA-shaped pools are split by TP rank even in an MLA model; the
        # other sidecars of an MLA model are the same on every rank, like its KV.
        replicated = self.is_mla and name != _pool_name(PoolName.MAMBA) and \
            not hasattr(host_pool, "head_num")
        if self._riders_possible() and rides_on_kv_slots(host_pool) and \
                pool.mode == REGIONS and pool.page_size == self.page_size and \
                replicated == self.is_mla and name not in self.pool_capacity:
            # its page is stored after its KV page's, in the KV store (opened later)
            self.sidecars[name] = _Sidecar(pool, None, self.key_suffix, in_kv_page=True)
            return
        layout = self._pool_layout(pool, replicated=replicated)
        config = store_config(self.config, layout,
                              directories=self._store_dirs(safe_name(name),
                                                           replicated=replicated),
                              kv_capacity=self.config.capacity, pool_host_bytes=pool.host_bytes,
                              # before the KV host pool is known: the KV capacity
                              kv_host_bytes=self._kv_host_bytes or pool.host_bytes,
                              capacity=self.pool_capacity.get(name))
        store = RankStore(name, layout, config, self.device,
                          follower=replicated and not self.is_writer, log_once=self._log_once,
                          node_ranks=self._node_ranks())
        self.sidecars[name] = _Sidecar(pool, store, self._key_suffix(replicated=replicated))

    def on_host_pools_registered(self) -> None:
        """Open the KV store (its pages carry the pools that ride in them) and log what each
        sidecar pool takes on disk. SGLang calls this once all pools are registered; a pool
        registered later gets a store of its own."""
        self._open_kv_store()
        for name, side in self.sidecars.items():
            tier = side.store.tier if side.store is not None else None
            log.info("gdskv: sidecar pool %s: %d B pages (%s), %s; store %s", name,
                     side.pool.page_bytes, side.pool.mode,
                     "in the KV page" if side.in_kv_page else
                     f"{tier.store.num_slots} slots of {tier.layout.slot_bytes} B"
                     if tier is not None and tier.store is not None else "read-only follower",
                     side.store.layout.fingerprint if side.store is not None else "-")

    def batch_exists_v2(self, keys: List[str], pool_transfers=None,
                        extra_info=None) -> PoolTransferResult:
        """Usable prefix of ``keys`` given every pool's hit policy (see :mod:`.hit_policy`)."""
        try:
            tier = self._kv_tier()
            kv_pages = int(tier.match_prefix(self._storage_keys(keys))) if tier is not None \
                else 0
            pools = [self._presence(t, keys, kv_pages) for t in pool_transfers or []] \
                if kv_pages else []
            v = hit_policy.fold(kv_pages, len(keys), pools, kv_name=PoolName.KV)
            return PoolTransferResult(v.final_pages, v.pool_hits, v.restorable)
        except Exception as exc:  # noqa: BLE001 - the data path never raises
            self._log_once("exists-v2", "batch_exists_v2 failed, reported as a miss: %r", exc)
            return PoolTransferResult(0, {}, [])

    def _presence(self, transfer, keys: List[str], kv_pages: int) -> hit_policy.PoolPresence:
        policy = _pool_name(transfer.hit_policy)
        if policy not in hit_policy.POLICIES:
            self._log_once(f"policy:{policy}", "unknown hit policy %r for pool %s: no hits "
                           "with it", policy, _pool_name(transfer.name))
        if policy == hit_policy.BLOCK_GROUPS:
            wanted = list(transfer.keys) if transfer.keys is not None else list(keys)
        else:
            wanted = list(keys[:kv_pages])
        side = self.sidecars.get(_pool_name(transfer.name))
        tier = side.store.open() if side is not None else None
        if side is None:
            self._log_once(f"unregistered:{_pool_name(transfer.name)}", "pool %s was never "
                           "registered: none of its pages is stored", _pool_name(transfer.name))
        present = [tier.contains(k) for k in side.storage_keys(wanted)] if tier is not None \
            else [False] * len(wanted)
        return hit_policy.PoolPresence(
            name=transfer.name, policy=policy, present=present,
            trailing=max(1, len(transfer.keys) if transfer.keys else 1),
            block_pages=int(getattr(transfer, "block_pages", 0) or 0),
            group_pages=int(getattr(transfer, "group_pages", 0) or 0))

    def batch_get_v2(self, transfers, extra_info=None) -> dict:
        """Read each transfer's pages into its host pool; per pool, per page hit or miss."""
        return self._transfers_v2("get", transfers)

    def batch_set_v2(self, transfers, extra_info=None) -> dict:
        """Store each transfer's host pages; per pool, per page success."""
        return self._transfers_v2("set", transfers)

    def _transfers_v2(self, op: str, transfers) -> dict:
        """Every transfer's pool gets its list: SGLang takes a pool missing from the result as
        having nothing to say, which for a KV-derived pool would let its KV pages count."""
        results: dict = {}
        try:
            self._open_kv_store()  # riders use it (a failure to open: their transfers miss)
        except Exception as exc:  # noqa: BLE001 - the data path never raises
            self._log_once("open-kv", "the KV store did not open: %r", exc)
        try:
            for t in transfers or []:
                name = getattr(t, "name", None)
                res = self._transfer_v2(op, t)
                # Two transfers of one pool: one list, in order, so a failure in the first is
                # never hidden behind the second's success.
                results[name] = results.get(name, []) + res
        finally:
            if op == "get":  # what the last KV read brought in serves this call only
                self._last_read.forget()
        return results

    def _transfer_v2(self, op: str, transfer) -> List[bool]:
        """One pool's pages through its tier; any failure is a miss / not stored, never raised."""
        name = _pool_name(getattr(transfer, "name", None))
        n = len(getattr(transfer, "keys", None) or [])
        if not n:
            return []
        if name == _pool_name(PoolName.KV):  # the KV store, as batch_get_v1 / batch_set_v1 move it
            return self._transfer(op, list(transfer.keys), getattr(transfer, "host_indices", None),
                                  call=f"batch_{op}_v2")
        try:
            side = self.sidecars.get(name)
            if side is None:
                self._log_once(f"unregistered:{name}", "pool %s was never registered: none of "
                               "its pages is stored", name)
                return [False] * n
            if op == "set" and side.store.follower:
                return [True] * n  # the writer rank stores this (identical) page
            tier = side.store.open()
            if tier is None:
                return [False] * n
            if transfer.host_indices is None:
                raise ValueError("the transfer has no host indices")
            t0 = time.perf_counter()
            skeys = side.storage_keys(list(transfer.keys))
            # a page as its store holds it (a rider's with its KV page)
            moved_bytes = side.store.layout.page_bytes
            if side.in_kv_page and op == "set":  # the whole page: KV, then every rider
                res = tier.put_pages(skeys, self._with_riders(
                    self._page_regions(transfer.host_indices, n), transfer.host_indices, n))
            elif side.in_kv_page:
                res = self._last_read.hits(skeys, transfer.host_indices)
                if res is not None:
                    moved_bytes = 0  # the KV read brought them in (and counted them)
                else:
                    res = self._read_rider_alone(tier, side, skeys, transfer.host_indices, n)
            else:
                res = side.pool.move(op, tier, skeys, transfer.host_indices, n)
            if moved_bytes:
                self._record("prefetch" if op == "get" else "backup", sum(res), moved_bytes,
                             time.perf_counter() - t0)
            return [bool(r) for r in res]
        except Exception as exc:  # noqa: BLE001 - the data path never raises
            self._log_once(f"{op}-v2:{name}", "batch_%s_v2 of %d %s pages failed, reported as "
                           "%s: %r", op, n, name, "misses" if op == "get" else "not stored", exc)
            return [False] * n

    # -- management -----------------------------------------------------------------------------
    def _stores(self) -> list[RankStore]:
        return ([self._kv_store] if self._kv_store is not None else []) + \
            [side.store for side in self.sidecars.values()
             if side.store is not None and not side.in_kv_page]

    def clear(self) -> None:
        for store in self._stores():
            if store.tier is not None:
                store.tier.clear()

    def get_stats(self):
        """SGLang's ``StorageMetrics`` (pages and GB/s per call since the last call) when
        storage metrics are on, else ``None``. The tier's own counters: :meth:`tier_stats`."""
        if not self.enable_metrics:
            return None
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:
            return None
        m = StorageMetrics()
        with self._metrics_lock:
            for name, values in self._metrics.items():
                getattr(m, name).extend(values)
                values.clear()
        return m

    def tier_stats(self) -> dict:
        return self.tier.stats() if self.tier is not None else {}

    def pool_stats(self) -> dict:
        """Each sidecar pool's tier counters (empty while a follower waits for its store); a
        pool that rides in the KV page has the KV store's."""
        return {name: side.store.tier.stats()
                if side.store is not None and side.store.tier is not None else {}
                for name, side in self.sidecars.items()}

    def close(self) -> None:
        for store in self._stores():
            store.close()

    # -- helpers --------------------------------------------------------------------------------
    def _record(self, kind: str, pages: int, page_bytes: int, seconds: float) -> None:
        if not self.enable_metrics or not pages:
            return
        gbps = pages * page_bytes / seconds / 1e9 if seconds > 0 else 0.0
        with self._metrics_lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(gbps)


__all__ = ["GdskvHiCacheStorage"]
