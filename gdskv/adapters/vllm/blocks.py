"""The GPU-direct data path: offloaded blocks move between vLLM's KV cache and gdskv stores.

One :class:`~gdskv.tier.Tier` per KV group (a group's page size is its own). A job is a list of
(group, keys, block ids); each group's part runs as one ``put_async``/``get_async`` of the
tier, which gathers the blocks' rows of every layer straight from the KV cache into staging
(Triton on CUDA), writes them to the slab store (kvikio/cuFile on a GPU, GDS where the platform
has it) and, for a load, reads, verifies and scatters them back into the blocks vLLM named.
No host copy of the KV cache in between, and no extra copy: the rows are views of vLLM's tensors
and the block ids are the gather's slot indices (one "token" per page, see :mod:`.mapping`).

Imports no vLLM code: the vLLM-facing worker (:mod:`.spec`) wraps it, and the GPU test drives it
directly on a CUDA KV cache laid out as vLLM lays it out.

Nothing here raises into the caller once a job is submitted: a job's failure (bad input, I/O
error, checksum mismatch, missing page) is a failed :class:`BlockJobResult` naming the keys and
block ids that did not move.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ...cluster import open_tier
from ...config import TierConfig
from ...log_once import LogOnce
from ...tier_protocol import TierLike
from .mapping import GroupGeometry, Shard, group_store_name

log = logging.getLogger("gdskv.vllm")


@dataclass
class BlockJobResult:
    job_id: int
    is_store: bool
    success: bool
    #: keys / block ids that did not move (a load's are to be recomputed)
    failed_keys: list = field(default_factory=list)
    failed_block_ids: list[int] = field(default_factory=list)
    bytes_moved: int = 0
    seconds: float = 0.0


@dataclass
class _Job:
    job_id: int
    is_store: bool
    parts: list  # (group position, keys, block ids, Future[list[bool]] or an exception)
    started: float


class BlockTransfers:
    """Asynchronous block stores and loads for one vLLM worker (one rank), one tier per group.

    Args:
        shard: whose bytes these are (model, rank, world size).
        config: gdskv settings; each group's store lives in its own sub-directory.
        groups: the KV groups, in vLLM's group order.
    """

    def __init__(self, shard: Shard, config: TierConfig, groups: Sequence[GroupGeometry]) -> None:
        self.groups = list(groups)
        self.tiers: list[TierLike] = []
        self._jobs: dict[int, _Job] = {}
        self._log_once = LogOnce(log)
        try:
            for g in self.groups:
                what = group_store_name(g.group_id, g.tokens_per_block)
                layout = shard.layout(num_layers=len(g.rows), row_bytes=g.row_bytes, what=what)
                cfg = config.replace(directories=shard.directories(config, what, create=True))
                self.tiers.append(open_tier(layout, cfg, device=g.rows[0].device,
                                            node_ranks=shard.node_ranks))
        except BaseException:
            self.close()
            raise

    # -- submitting -----------------------------------------------------------------------------
    def submit(self, job_id: int, is_store: bool,
               parts: Iterable[tuple[int, Sequence[bytes], Sequence[int]]]) -> None:
        """Start a job: for each (group position, keys, block ids), store those blocks under
        those keys or load those keys into those blocks. Returns at once."""
        job = _Job(job_id, is_store, [], time.perf_counter())
        for pos, keys, block_ids in parts:
            keys = list(keys)
            block_ids = [int(b) for b in block_ids]
            try:
                if len(keys) != len(block_ids):
                    raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks")
                tier, g = self.tiers[pos], self.groups[pos]
                slots = torch.tensor(block_ids, dtype=torch.int64)
                call = tier.put_async if is_store else tier.get_async
                outcome: object = call(keys, list(g.rows), slots) if keys else None
            except Exception as exc:  # a bad job fails; it never reaches vLLM as an exception
                outcome = exc
            job.parts.append((pos, keys, block_ids, outcome))
        self._jobs[job_id] = job

    # -- completion -----------------------------------------------------------------------------
    def poll(self) -> list[BlockJobResult]:
        """Results of the jobs that finished since the last call."""
        done = [job for job in self._jobs.values()
                if all(not isinstance(o, Future) or o.done() for *_, o in job.parts)]
        return [self._finish(self._jobs.pop(job.job_id)) for job in done]

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until these jobs have finished (their results still come from :meth:`poll`)."""
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            for *_, outcome in job.parts if job is not None else ():
                if isinstance(outcome, Future):
                    outcome.exception()

    def pending(self) -> int:
        return len(self._jobs)

    def _finish(self, job: _Job) -> BlockJobResult:
        result = BlockJobResult(job.job_id, job.is_store, True)
        for pos, keys, block_ids, outcome in job.parts:
            if outcome is None:
                continue
            if isinstance(outcome, Future):
                exc = outcome.exception()
                oks = outcome.result() if exc is None else [False] * len(keys)
            else:
                exc, oks = outcome, [False] * len(keys)
            if exc is not None:
                self._log_once(f"{type(exc).__name__}", "gdskv: %s job %d failed in group %d: "
                               "%s", "store" if job.is_store else "load", job.job_id,
                               self.groups[pos].group_id, exc)
            row_bytes = self.tiers[pos].layout.page_bytes
            for key, block_id, ok in zip(keys, block_ids, oks):
                if ok:
                    result.bytes_moved += row_bytes
                else:
                    result.failed_keys.append(key)
                    result.failed_block_ids.append(block_id)
        result.success = not result.failed_keys
        result.seconds = time.perf_counter() - job.started
        return result

    # -- the rest -------------------------------------------------------------------------------
    def stats(self) -> list[dict]:
        return [t.stats() for t in self.tiers]

    def close(self) -> None:
        for job_id in list(self._jobs):
            self.wait([job_id])
        self._jobs.clear()
        for tier in self.tiers:
            tier.close()
        self.tiers = []
