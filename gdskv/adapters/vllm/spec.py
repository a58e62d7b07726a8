"""gdskv as vLLM's GPU-direct offloading spec: blocks go from the GPU KV cache to NVMe and back.

Loaded by vLLM's ``OffloadingSpecFactory`` (``spec_name``/``spec_module_path``), always through
gdskv's connector (:mod:`.connector`), which sets both; see docs/vllm.md for the command line.

- Scheduler side: :class:`GdskvOffloadingManager` tracks no state of its own beyond the stores
  in flight; what is on disk it reads from the stores' journals (:mod:`.index`), so it agrees
  with the workers' tiers across processes and restarts. Evictions are the tiers' (LRU); they
  reach the manager, and vLLM's KV events, through the journals.
- Worker side: :class:`GdskvOffloadingWorker` hands each job to :class:`.blocks.BlockTransfers`
  (Triton gather/scatter between vLLM's blocks and staging, kvikio/cuFile to the slab store).

A load that misses (a checksum mismatch, an I/O error, a page evicted since the lookup) must
become a recompute of those blocks. vLLM's stock ``OffloadingConnector`` cannot do that (its
worker asserts every transfer succeeded), so the worker reports every job as finished and keeps
the blocks that did not load for gdskv's connector, which reports them to vLLM's scheduler
through ``get_block_ids_with_load_errors`` (policy ``kv_load_failure_policy: "recompute"``).
That is why this spec refuses to be built by any other connector.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import Collection, Iterable

import torch

from vllm.v1.kv_offload.base import (CanonicalKVCaches, GPULoadStoreSpec, LoadStoreSpec,
                                     LookupResult, Medium, OffloadingEvent, OffloadingManager,
                                     OffloadingSpec, OffloadingWorker, OffloadKey,
                                     PrepareStoreOutput, ReqContext, RequestOffloadingContext,
                                     TransferResult, get_offload_group_idx)
from vllm.v1.kv_offload.config import OffloadingConfig

from .blocks import BlockTransfers
from .index import KeyIndex
from ..common import tier_config
from .mapping import Shard, group_geometry, group_store_name

log = logging.getLogger("gdskv.vllm")

#: the key of ``kv_connector_extra_config`` holding gdskv's options (TierConfig fields)
OPTIONS_KEY = "gdskv"
#: seconds between the manager's journal reads during lookups (stores and step ends force one)
REFRESH_INTERVAL_S = 0.01

_BUILT_BY_CONNECTOR: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "gdskv_vllm_connector", default=False)


@contextlib.contextmanager
def built_by_gdskv_connector():
    """Within this block :class:`GdskvOffloadingSpec` may be created: gdskv's connector (which
    turns failed loads into recomputes) creates its spec here; so do tests of the spec alone."""
    token = _BUILT_BY_CONNECTOR.set(True)
    try:
        yield
    finally:
        _BUILT_BY_CONNECTOR.reset(token)


def shard_of(config: OffloadingConfig) -> Shard:
    p = config.parallel
    return Shard(model=config.model.name, kv_dtype=str(config.model.dtype), rank=p.rank,
                 world_size=p.world_size, tp_size=p.tp_size, dp_index=p.data_parallel_index)


class GdskvKeysSpec(LoadStoreSpec):
    """Where offloaded blocks live: gdskv pages named by their vLLM keys (the tiers place
    them; the scheduler needs no slot numbers)."""

    def __init__(self, keys: Iterable[OffloadKey]) -> None:
        self.keys = list(keys)

    def __repr__(self) -> str:
        return f"GdskvKeysSpec({len(self.keys)} keys)"


class GdskvOffloadingManager(OffloadingManager):
    """The scheduler's view of the gdskv stores (one :class:`KeyIndex` per KV group)."""

    def __init__(self, indexes: dict[int, KeyIndex], *, enable_events: bool = False) -> None:
        self._indexes = indexes
        self._storing: set[OffloadKey] = set()
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._refreshed = float("-inf")
        self.refresh(force=True)

    def refresh(self, force: bool = False) -> None:
        """Read what the workers' tiers journaled since the last call."""
        now = time.monotonic()
        if not force and now - self._refreshed < REFRESH_INTERVAL_S:
            return
        self._refreshed = now
        for index in self._indexes.values():
            added, removed = index.refresh()
            if self._events is not None:
                if added:
                    self._events.append(OffloadingEvent(added, Medium.STORAGE, removed=False))
                if removed:
                    self._events.append(OffloadingEvent(removed, Medium.STORAGE, removed=True))

    def _stored(self, key: OffloadKey) -> bool:
        index = self._indexes.get(get_offload_group_idx(key))
        return index is not None and key in index

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self.refresh()
        return LookupResult.HIT if self._stored(key) else LookupResult.MISS

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext
                     ) -> LoadStoreSpec:
        return GdskvKeysSpec(keys)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext
                      ) -> PrepareStoreOutput | None:
        self.refresh()
        todo = [k for k in keys if k not in self._storing and not self._stored(k)]
        self._storing.update(todo)
        # Room is made by the tiers' own LRU; its evictions come back through the journals.
        return PrepareStoreOutput(keys_to_store=todo, store_spec=GdskvKeysSpec(todo),
                                  evicted_keys=[])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        self._storing.difference_update(keys)
        self.refresh(force=True)  # the stored pages are in the journals now

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_schedule_end(self, context) -> None:
        self.refresh()

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events:
            events, self._events = self._events, []
            yield from events

    def shutdown(self) -> None:
        for index in self._indexes.values():
            index.close()


class GdskvOffloadingWorker(OffloadingWorker):
    """Moves blocks between this rank's KV cache and its gdskv stores.

    Every job is reported finished (``success=True``: the job is over); the blocks of a load that
    did not arrive wait in :meth:`take_load_errors` for gdskv's connector.
    """

    def __init__(self, spec: "GdskvOffloadingSpec", kv_caches: CanonicalKVCaches) -> None:
        groups = spec.config.groups
        if len(kv_caches.group_data_refs) != len(groups):
            raise ValueError(f"gdskv: vLLM passed {len(kv_caches.group_data_refs)} KV groups' "
                             f"layers for {len(groups)} offloaded groups")
        geometries = []
        for group, refs in zip(groups, kv_caches.group_data_refs):
            tensors = []
            for ref in refs:
                t = kv_caches.tensors[ref.tensor_idx]
                tensor = t.tensor
                if tensor.dim() != 2 or tensor.element_size() != 1:
                    tensor = tensor.view(torch.int8).view(-1, t.page_size_bytes)
                tensors.append(tensor)
            geometries.append(group_geometry(group.group_id, group.tokens_per_block, tensors,
                                             [ref.page_size_bytes for ref in refs]))
        self.transfers = BlockTransfers(spec.shard, spec.gdskv_config, geometries)
        self._load_errors: dict[int, list[int]] = {}
        log.info("gdskv: offloading %d KV group(s) of rank %d to %s (%s)", len(geometries),
                 spec.shard.rank, ", ".join(spec.gdskv_config.directories),
                 "; ".join(f"group {g.group_id}: {len(g.rows)} layers x {g.row_bytes} B per "
                           f"block" for g in geometries))

    def _parts(self, gpu_spec: GPULoadStoreSpec, keys: list):
        """(group position, keys, block ids) per group: vLLM orders both group by group. A job
        whose keys and blocks disagree (in count, or a key of another group) moves nothing."""
        groups = self.transfers.groups
        if sum(gpu_spec.group_sizes) != len(keys) or len(gpu_spec.group_sizes) != len(groups):
            yield 0, keys, []
            return
        offset = 0
        for pos, size in enumerate(gpu_spec.group_sizes):
            part = keys[offset:offset + size]
            if any(get_offload_group_idx(k) != groups[pos].group_id for k in part):
                yield pos, part, []
            else:
                yield pos, part, gpu_spec.block_ids[offset:offset + size]
            offset += size

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
                     ) -> bool:
        self.transfers.submit(job_id, True, self._parts(src_spec, list(dst_spec.keys)))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        self.transfers.submit(job_id, False, self._parts(dst_spec, list(src_spec.keys)))
        return True

    def get_finished(self) -> list[TransferResult]:
        results = []
        for r in self.transfers.poll():
            if not r.is_store and r.failed_block_ids:
                self._load_errors[r.job_id] = r.failed_block_ids
            results.append(TransferResult(job_id=r.job_id, success=True,
                                          transfer_size=r.bytes_moved, transfer_time=r.seconds))
        return results

    def take_load_errors(self) -> dict[int, list[int]]:
        """Block ids of finished loads that did not arrive, by job id (then forgotten)."""
        errors, self._load_errors = self._load_errors, {}
        return errors

    def wait(self, job_ids: set[int]) -> None:
        self.transfers.wait(job_ids)

    def shutdown(self) -> None:
        self.transfers.close()


class GdskvOffloadingSpec(OffloadingSpec):
    """The spec vLLM builds once per process: the manager in the scheduler, the worker in each
    worker. Unsupported geometries are refused here, at start-up."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        if not _BUILT_BY_CONNECTOR.get():
            raise ValueError(
                "GdskvOffloadingSpec must be loaded through gdskv's connector: set "
                "\"kv_connector\": \"GdskvOffloadingConnector\", \"kv_connector_module_path\": "
                "\"gdskv.adapters.vllm.connector\" and \"kv_load_failure_policy\": \"recompute\" "
                "in --kv-transfer-config (vLLM's OffloadingConnector cannot recompute a block "
                "whose load failed)")
        if self.blocks_per_chunk != 1:
            raise ValueError(f"gdskv: offloaded chunks of several GPU blocks are not supported "
                             f"(blocks_per_chunk={self.blocks_per_chunk}); leave "
                             f"\"block_size\" out of kv_connector_extra_config or set it to "
                             f"the GPU block size")
        if config.canonical_layout:
            raise ValueError("gdskv: the canonical host layout (\"canonical_layout\": true) is "
                             "not supported; leave it out of kv_connector_extra_config")
        if len({g.group_id for g in config.groups}) != len(config.groups):
            raise ValueError(f"gdskv: KV group ids repeat: {[g.group_id for g in config.groups]}")
        # Every rank stores its own bytes, MLA's identical ones too (one writer per store).
        self.replicated_layout = False
        self.gdskv_config = tier_config(self.extra_config.get(OPTIONS_KEY, {}),
                                        where=f"kv_connector_extra_config[{OPTIONS_KEY!r}]")
        self.shard = shard_of(config)
        self._manager: GdskvOffloadingManager | None = None
        self._worker: GdskvOffloadingWorker | None = None

    def store_dirs(self, group) -> list[str]:
        """The first directory of each rank's store of ``group`` (where its journal is; in a
        cluster store, where each node's namespace of that rank is)."""
        what = group_store_name(group.group_id, group.tokens_per_block)
        return [self.shard.directories(self.gdskv_config, what, rank=r)[0]
                for r in range(self.shard.world_size)]

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = GdskvOffloadingManager(
                {g.group_id: KeyIndex(self.store_dirs(g), cluster=self.gdskv_config.cluster,
                                      discovery_s=self.gdskv_config.cluster_discovery_ms / 1000)
                 for g in self.config.groups},
                enable_events=self.kv_events_config.enable_kv_cache_events)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = GdskvOffloadingWorker(self, kv_caches)
        return self._worker
