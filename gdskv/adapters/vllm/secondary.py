"""gdskv as a secondary tier below vLLM's CPU tier (``TieringOffloadingSpec``).

Loaded by vLLM's ``SecondaryTierFactory`` from a tier config, no registration needed::

    "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 17179869184,
        "secondary_tiers": [{"type": "GdskvSecondaryTier",
                             "module_path": "gdskv.adapters.vllm.secondary",
                             "directories": "/mnt/nvme0/kv", "capacity": "1TiB"}]}

vLLM's tiering manager keeps blocks in a CPU primary tier (an mmap in /dev/shm) and cascades
stores down to this tier and promotes loads up from it. A block here is one row of the primary
(``primary_kv_view`` is ``(num_chunks, row_bytes)``; with TP > 1 a row holds every worker's
share), stored as one gdskv page: ``put_pages``/``get_pages`` move the row in place (the primary
is a page-aligned mmap: one ``pwritev``/``preadv`` straight between the row and the slab file,
checksum on the row, :mod:`gdskv.host_pages`) with coalesced I/O, fdatasync and checksums,
instead of vLLM's fs tier's one file per block. A failed load may leave part of a block in its
row; its key is not in ``successful_keys``, so vLLM drops that row. Every other key of the tier config is a
:class:`~gdskv.config.TierConfig` field; ``GDSKV_*`` variables fill in the rest.

This runs in vLLM's scheduler process and must never block it: submits hand the job to a
thread pool and return; :meth:`GdskvSecondaryTier.get_finished_jobs` collects what finished.
A failure is a failed job (a load's failed keys are left out of ``successful_keys``), never an
exception into vLLM; a page that fails its checksum is a miss, and vLLM recomputes it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ClassVar

import torch

from vllm.v1.kv_offload.base import (Locality, LookupResult, Medium, OffloadingEvent, OffloadKey,
                                     ReqContext, RequestOffloadingContext)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from ...cluster import open_tier
from ...config import ConfigError
from ...log_once import LogOnce
from ...tier_protocol import TierLike
from ..common import tier_config
from .mapping import Shard

log = logging.getLogger("gdskv.vllm")


class GdskvSecondaryTier(SecondaryTierManager):
    """A :class:`SecondaryTierManager` whose blocks live in a gdskv slab store.

    Args (from the tier config; vLLM passes ``offloading_spec``, ``primary_kv_view``,
    ``tier_type`` and ``backpressure_detector`` itself):
        enable_kv_events: emit KV events for blocks stored here (when vLLM's KV events are on).
        locality: ``"LOCAL"`` or ``"REMOTE"``, as for vLLM's fs tier.
        jobs: transfer jobs run at once (default: ``io_threads``).
        **options: :class:`~gdskv.config.TierConfig` fields (``directories``, ``capacity``...).
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector=None, enable_kv_events: bool = False,
                 locality: str | None = None, jobs: int | None = None, **options) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        where = f"secondary tier {tier_type!r} config"
        self.config = tier_config(options, where=where)
        self.locality = Locality(locality) if locality is not None else None
        jobs = self.config.io_threads if jobs is None else jobs
        if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
            raise ConfigError(f"{where}: jobs must be a positive integer, got {jobs!r}")
        view = primary_kv_view.cast("B") if primary_kv_view.ndim != 1 else primary_kv_view
        row = self.block_size_bytes
        if row <= 0 or len(view) % row:
            raise ValueError(f"{where}: the primary tier's view of {len(view)} B is not a whole "
                             f"number of {row} B rows")
        self._rows = torch.frombuffer(view, dtype=torch.uint8).view(-1, row)
        cfg = offloading_spec.config
        # The primary's rows hold every worker's share of a block (one copy when replicated):
        # the store belongs to that whole set of workers and that row format.
        shard = Shard(model=cfg.model.name, kv_dtype=str(cfg.model.dtype),
                      dp_index=cfg.parallel.data_parallel_index)
        what = (f"cpu-rows-w{cfg.parallel.world_size}-c{offloading_spec.blocks_per_chunk}"
                f"{'-replicated' if offloading_spec.replicated_layout else ''}")
        # with "cluster": true, a cluster store (every replica's and host's blocks readable)
        self.tier: TierLike = open_tier(
            shard.layout(num_layers=1, row_bytes=row, what=what),
            self.config.replace(directories=shard.directories(self.config, what, all_ranks=True,
                                                              create=True)),
            device="cpu", node_ranks=shard.node_ranks)
        # vLLM hands over many small jobs (a few blocks each) and runs its own fs tier's on one
        # thread per job; each job here is one tier call, and calls from many threads overlap,
        # so as many run at once as the tier has I/O threads (with pipeline_depth, 4, jobs at
        # once, reads from the H100's /dev/shm stayed near 4 GB/s).
        self._pool = ThreadPoolExecutor(jobs, thread_name_prefix="gdskv-vllm-tier")
        self._jobs: dict[int, tuple[Future, list, bool, float]] = {}
        self._events: list[OffloadingEvent] | None = None
        if enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events:
            self._events = []
        self._log_once = LogOnce(log)
        log.info("gdskv secondary tier %r: %d B blocks in %s", tier_type, row,
                 ", ".join(self.tier.store.directories))

    # -- lookups --------------------------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        # The directory is in this process: the answer is immediate (no RETRY round trip).
        return LookupResult.HIT if self.tier.contains(key) else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    # -- transfers ------------------------------------------------------------------------------
    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self.tier.put_pages, is_load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self.tier.get_pages, is_load=True)

    def _submit(self, job: TransferJob, call, *, is_load: bool) -> None:
        keys = list(job.keys)
        chunk_ids = [int(c) for c in job.chunk_ids]
        self._jobs[job.job_id] = (self._pool.submit(self._run, call, keys, chunk_ids), keys,
                                  is_load, time.perf_counter())

    def _run(self, call, keys: list, chunk_ids: list[int]) -> list[bool]:
        try:
            if len(keys) != len(chunk_ids):
                raise ValueError(f"{len(keys)} keys for {len(chunk_ids)} primary chunks")
            return call(keys, [[self._rows[c]] for c in chunk_ids])
        except Exception as exc:  # a failed job, never an exception into vLLM
            self._log_once(type(exc).__name__, "gdskv secondary tier: a job of %d blocks "
                           "failed: %s", len(keys), exc)
            return [False] * len(keys)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        for job_id in [j for j, (fut, *_rest) in self._jobs.items() if fut.done()]:
            fut, keys, is_load, t0 = self._jobs.pop(job_id)
            oks = fut.result()  # _run never raises
            done = [k for k, ok in zip(keys, oks) if ok]
            success = len(done) == len(keys)
            if not is_load and done and self._events is not None:
                self._events.append(OffloadingEvent(done, self.medium, removed=False,
                                                    locality=self.locality))
            results.append(JobResult(
                job_id=job_id, success=success,
                successful_keys=tuple(done) if is_load and not success else None,
                transfer_time=time.perf_counter() - t0,
                transfer_bytes=len(done) * self.block_size_bytes))
        return results

    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    def drain_jobs(self) -> None:
        for fut, *_rest in list(self._jobs.values()):
            fut.exception()

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events:
            events, self._events = self._events, []
            yield from events

    def stats(self) -> dict:
        return self.tier.stats()

    def shutdown(self) -> None:
        self.drain_jobs()
        self._pool.shutdown(wait=True)
        self.tier.close()
