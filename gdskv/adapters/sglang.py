"""SGLang HiCache L3 storage backend on a gdskv tier.

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

Sharding: each rank owns a store under ``<directory>/<model>/<shard>``; the shard name and the
store fingerprint carry model, TP/PP (and CP/DP where used) ranks, and keys get SGLang's
``_<model>_<tp_rank>_<tp_size>`` style suffix, so pages of another sharding never hit. For MLA the
KV is the same on every TP rank: only the writer rank (``storage_config.is_storage_writer``) writes;
the others answer ``batch_set_v1`` with success and store nothing, as SGLang's controller expects,
and read the writer's store through a read-only follower tier (``TierConfig.read_only``), opened
lazily: the writer may create the store after them, so until it exists their reads are misses
and the open is retried at most every ``FOLLOWER_RETRY_S`` seconds.

Data-path calls never raise and never return ``None``: a failure is logged once per kind and
becomes a miss (``False`` / a shorter prefix), because an exception would kill SGLang's prefetch or
backup thread and silently switch L3 off.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
import time
from typing import Any, List, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from ..config import ConfigError, TierConfig, parse_bool
from ..layout import KVLayout
from ..memory import check_device
from ..store import StoreError
from ..tier import Tier

log = logging.getLogger("gdskv.sglang")

#: extra_config keys that SGLang's dynamic loader itself reads.
LOADER_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
#: extra_config keys this adapter reads besides TierConfig fields.
ADAPTER_KEYS = frozenset({"device", "create_directories"})
_TIER_FIELDS = frozenset(f.name for f in dataclasses.fields(TierConfig))
_LAYOUTS = ("page_first_direct", "page_first", "layer_first")
# One-byte KV types SGLang stores as raw bytes (fp8 caches): copies are byte-wise, so they are
# carried under gdskv's one-byte dtype name.
_BYTE_DTYPES = (torch.uint8, torch.int8)
#: seconds between a non-writer MLA rank's attempts to open the writer's store
FOLLOWER_RETRY_S = 1.0


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "model"


class GdskvHiCacheStorage(HiCacheStorage):
    """A :class:`HiCacheStorage` whose pages live in a gdskv slab store on NVMe.

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
        unknown = sorted(set(extra) - LOADER_KEYS - ADAPTER_KEYS - _TIER_FIELDS)
        if unknown:
            log.warning("gdskv: ignoring extra_config keys %s (known: %s, %s)", unknown,
                        sorted(_TIER_FIELDS), sorted(ADAPTER_KEYS))
        overrides = {k: v for k, v in extra.items() if k in _TIER_FIELDS}
        if isinstance(overrides.get("directories"), list):
            overrides["directories"] = tuple(overrides["directories"])
        # Validates GDSKV_* and the overrides now, so a bad option stops SGLang at start-up
        # rather than on the first request.
        self.config = TierConfig.from_env(**overrides)
        if not self.config.directories:
            raise ValueError("gdskv: no store directory: set \"directories\" in "
                             "--hicache-storage-backend-extra-config or GDSKV_DIRECTORIES")
        self.device = check_device(extra.get("device", "cpu"), "device")
        # An unmounted drive's mount point must not silently become a store on the root disk:
        # the configured directories must exist unless the user says to create them.
        self.create_directories = parse_bool(extra.get("create_directories", False),
                                             "create_directories")
        self._check_directories()

        sc = storage_config
        self.model_name = _safe_name(sc.model_name or "")
        self.is_mla = bool(sc.is_mla_model)
        self.is_writer = bool(sc.is_storage_writer)
        shard = ""
        if sc.pp_size > 1:
            shard += f"_pp{sc.pp_rank}-{sc.pp_size}"
        if sc.attn_cp_size > 1:
            shard += f"_cp{sc.attn_cp_rank}-{sc.attn_cp_size}"
        if sc.dcp_size > 1:
            raise ValueError("gdskv: decode context parallel (dcp_size > 1) is not supported")
        # MLA KV is identical on every TP rank (one store, written by the writer rank); MHA KV
        # is split by heads, so each TP rank has its own.
        tp = "" if self.is_mla else f"_tp{sc.tp_rank}-{sc.tp_size}"
        self.key_suffix = f"_{self.model_name}{tp}{shard}"
        # Separate processes cannot share one store (it is flock-ed): DP groups get their own.
        self.shard_dir = ("mla" if self.is_mla else f"tp{sc.tp_rank}-{sc.tp_size}") + shard + \
            (f"_dp{sc.dp_rank}" if sc.dp_rank else "")
        self.enable_metrics = bool(sc.enable_storage_metrics)
        self.tier: Optional[Tier] = None
        self._follower_config: Optional[TierConfig] = None  # non-writer MLA ranks, until open
        self._follower_tried = float("-inf")
        self._follower_lock = threading.Lock()
        self.mem_pool_host = None
        self._pool_views = None
        self._logged: set[str] = set()
        self._metrics_lock = threading.Lock()
        self._metrics = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                         "backup_bandwidth": []}

    # -- set-up ---------------------------------------------------------------------------------
    def _check_directories(self) -> None:
        for d in self.config.directories:
            if os.path.isdir(d):
                continue
            if os.path.lexists(d):
                raise ConfigError(f"directories: {d!r} exists but is not a directory; give "
                                  "the store's directory (one per drive)")
            if not self.create_directories:
                raise ConfigError(f"directories: {d!r} does not exist (an unmounted drive?); "
                                  "create it (mount the drive), or set \"create_directories\": "
                                  "true to have gdskv create it")
            os.makedirs(d, mode=0o700, exist_ok=True)

    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Open this rank's store for the host pool's KV geometry (SGLang calls this once,
        right after construction). Unsupported pools raise here, at start-up."""
        super().register_mem_pool_host(mem_pool_host)
        layout_name = getattr(mem_pool_host, "layout", None)
        if layout_name not in _LAYOUTS:
            raise ValueError(f"gdskv: host pool layout {layout_name!r} is not supported; use "
                             f"--hicache-mem-layout {' or '.join(_LAYOUTS)}")
        self.layout_name = layout_name
        self.page_size = int(mem_pool_host.page_size)
        buf = mem_pool_host.kv_buffer
        if not isinstance(buf, torch.Tensor):
            raise TypeError(f"gdskv: host pool kv_buffer must be one tensor, got "
                            f"{type(buf).__name__}")
        if buf.dtype in _BYTE_DTYPES:
            buf = buf.view(torch.float8_e4m3fn)
        pool_is_mla = hasattr(mem_pool_host, "kv_cache_dim")
        if pool_is_mla != self.is_mla:
            raise ValueError(f"gdskv: storage_config.is_mla_model={self.is_mla} but the host "
                             f"pool is {type(mem_pool_host).__name__}")
        sc = self.storage_config
        if self.is_mla:
            heads, head_dim = 1, int(mem_pool_host.kv_cache_dim)
            # One leading K/V axis of size 1, so both pool kinds index the same way below.
            buf = buf.unsqueeze(0)
        else:
            heads, head_dim = int(mem_pool_host.head_num), int(mem_pool_host.head_dim)
            v_dim = int(getattr(mem_pool_host, "v_head_dim", head_dim))
            if v_dim != head_dim:
                raise ValueError(f"gdskv: K and V head dims differ ({head_dim} vs {v_dim})")
        self.kv_layout = KVLayout(
            num_layers=int(mem_pool_host.layer_num), page_size=self.page_size, head_dim=head_dim,
            kv_heads=heads, dtype=buf.dtype, mla=self.is_mla, model_name=self.model_name,
            tp_rank=0 if self.is_mla else sc.tp_rank, tp_size=1 if self.is_mla else sc.tp_size,
            pp_rank=sc.pp_rank, pp_size=sc.pp_size)
        self._kv = buf  # [kv, ...layout dims...] in the layout's dtype
        if layout_name == "page_first_direct":
            self._pool_views = None  # pages are addressed whole, see _page_regions
        elif layout_name == "page_first":  # [kv, tokens, layers, heads, dim]
            self._pool_views = self._as_pool(buf.transpose(1, 2))
        else:  # layer_first: [kv, layers, tokens, heads, dim]
            self._pool_views = self._as_pool(buf)
        dirs = []
        for d in self.config.directories:  # each exists (checked at construction)
            sub = os.path.join(d, self.model_name, self.shard_dir)
            os.makedirs(sub, mode=0o700, exist_ok=True)
            dirs.append(sub)
        if self.is_mla and not self.is_writer:
            # Nothing is written from here; the writer rank owns the store and this rank
            # follows it read-only (opened on first use: the writer may not have made it yet).
            if not self.config.verify:
                log.warning("gdskv: MLA rank %d is not the storage writer and verify is off: a "
                            "read-only follower needs verify, so this rank reports misses",
                            sc.tp_rank)
                return
            self._follower_config = self.config.replace(directories=tuple(dirs), read_only=True)
            log.info("gdskv: MLA rank %d is not the storage writer: backups are skipped here, "
                     "reads follow the writer's store in %s", sc.tp_rank, ", ".join(dirs))
            self._open_follower()
            return
        self.tier = Tier(self.kv_layout, self.config.replace(directories=tuple(dirs)),
                         device=self.device)
        log.info("gdskv: %s pool (%s, %s), store %s, backend %s", layout_name,
                 "MLA" if self.is_mla else "MHA", self.kv_layout.fingerprint, ", ".join(dirs),
                 self.tier.backend.name)

    def _open_follower(self) -> Optional[Tier]:
        """The read-only tier over the writer rank's store, opened when the store exists."""
        if self.tier is not None or self._follower_config is None:
            return self.tier
        now = time.monotonic()
        if now - self._follower_tried < FOLLOWER_RETRY_S or \
                not self._follower_lock.acquire(blocking=False):
            return None
        try:
            if self.tier is None:
                self._follower_tried = now
                try:
                    self.tier = Tier(self.kv_layout, self._follower_config, device=self.device)
                except (StoreError, FileNotFoundError) as exc:
                    self._log_once("follower-wait", "MLA follower: writer's store not "
                                   "readable yet (%s); misses until it is, retrying", exc,
                                   level=logging.INFO)
                else:
                    self._follower_config = None
                    log.info("gdskv: MLA follower opened the writer's store %s (%d pages)",
                             ", ".join(self.tier.store.directories), len(self.tier.directory))
            return self.tier
        finally:
            self._follower_lock.release()

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
        idx = host_indices.reshape(-1).to("cpu", torch.int64)
        if idx.numel() != n * ps:
            raise ValueError(f"{idx.numel()} host indices for {n} pages of {ps} tokens")
        num_pages = self._kv.shape[1]
        if n and (int(idx.min()) < 0 or int(idx.max()) >= num_pages * ps):
            raise ValueError(f"host index out of range: [{int(idx.min())}, {int(idx.max())}] "
                             f"not within the host pool's {num_pages * ps} token slots")
        first = idx[::ps]
        if n and (bool((first % ps).any()) or not torch.equal(
                idx.view(n, ps) - first[:, None], torch.arange(ps).expand(n, ps))):
            raise ValueError("host indices are not whole host-pool pages")
        pages = (first // ps).tolist()
        kv = self._kv
        return [[kv[c, p].reshape(-1).view(torch.uint8) for c in range(kv.shape[0])]
                for p in pages]

    def _flat_page_view(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat page as SGLang's get_data_page(flat=True) gives it, viewed in page format
        ``[kv][layer][token][row]`` (a strided view for page_first)."""
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
            if self.tier is None and self._open_follower() is None:
                return 0
            return int(self.tier.match_prefix(self._storage_keys(keys)))
        except Exception as exc:  # noqa: BLE001 - the data path never raises
            self._log_once("exists", "batch_exists failed, reported as a miss: %r", exc)
            return 0

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info=None) -> List[bool]:
        """Read pages into the host pool at ``host_indices``; per-page hit or miss."""
        if self.tier is None and self._open_follower() is None:
            return [False] * len(keys)
        return self._transfer("get", keys, host_indices)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info=None) -> List[bool]:
        """Write host-pool pages at ``host_indices``; per-page success."""
        if self.is_mla and not self.is_writer:
            return [True] * len(keys)  # the writer rank stores this (identical) MLA page
        return self._transfer("set", keys, host_indices)

    def _transfer(self, op: str, keys: List[str], host_indices: torch.Tensor) -> List[bool]:
        """One v1 batch through the tier; any failure is a miss / not stored, never raised."""
        n = len(keys)
        try:
            if self.tier is None:
                return [False] * n
            t0 = time.perf_counter()
            skeys = self._storage_keys(keys)
            if self._pool_views is None:
                pages = self._page_regions(host_indices, n)
                res = (self.tier.get_pages if op == "get" else self.tier.put_pages)(skeys, pages)
            else:
                res = (self.tier.get if op == "get" else self.tier.put)(
                    skeys, self._pool_views, host_indices)
            self._record("prefetch" if op == "get" else "backup", sum(res),
                         time.perf_counter() - t0)
            return [bool(r) for r in res]
        except Exception as exc:  # noqa: BLE001 - the data path never raises
            self._log_once(op, "batch_%s_v1 of %d pages failed, reported as %s: %r", op, n,
                           "misses" if op == "get" else "not stored", exc)
            return [False] * n

    # -- the older per-page interface (SGLang's generic path) -----------------------------------
    def exists(self, key: str) -> bool:
        try:
            if self.tier is None and self._open_follower() is None:
                return False
            return self.tier.contains(self._storage_keys([key])[0])
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
            if target_locations is None or (self.tier is None and
                                            self._open_follower() is None):
                return [None] * n
            views = [self._flat_page_view(t) for t in target_locations]
            # Read into contiguous page-format buffers, then into the (maybe strided) targets.
            bufs = [torch.empty(v.shape, dtype=torch.uint8) for v in views]
            res = self.tier.get_pages(self._storage_keys(keys), [[b.view(-1)] for b in bufs])
            out: List[torch.Tensor | None] = []
            for hit, v, b, t in zip(res, views, bufs, target_locations):
                if hit:
                    v.copy_(b)
                out.append(t if hit else None)
            return out
        except Exception as exc:  # noqa: BLE001
            self._log_once("get", "batch_get of %d pages failed, reported as misses: %r", n, exc)
            return [None] * n

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
            if self.tier is None or values is None:
                return False
            pages = [[self._flat_page_view(v).contiguous().view(-1)] for v in values]
            return all(self.tier.put_pages(self._storage_keys(keys), pages))
        except Exception as exc:  # noqa: BLE001
            self._log_once("set", "batch_set of %d pages failed, reported as not stored: %r",
                           len(keys), exc)
            return False

    # -- management -----------------------------------------------------------------------------
    def clear(self) -> None:
        if self.tier is not None:
            self.tier.clear()

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

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()
            self.tier = None

    # -- helpers --------------------------------------------------------------------------------
    def _record(self, kind: str, pages: int, seconds: float) -> None:
        if not self.enable_metrics or not pages:
            return
        gbps = pages * self.kv_layout.page_bytes / seconds / 1e9 if seconds > 0 else 0.0
        with self._metrics_lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(gbps)

    def _log_once(self, tag: str, msg: str, *args, level: int = logging.ERROR) -> None:
        if tag not in self._logged:
            self._logged.add(tag)
            log.log(level, "gdskv: " + msg, *args)


__all__ = ["GdskvHiCacheStorage"]
