"""gdskv's vLLM connector: vLLM's ``OffloadingConnector`` plus failed loads turned into
recomputes, for the GPU-direct spec (:mod:`.spec`).

Loaded as an out-of-tree connector (no vLLM patch)::

    --kv-transfer-config '{"kv_connector": "GdskvOffloadingConnector",
        "kv_connector_module_path": "gdskv.adapters.vllm.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"gdskv": {"directories": "/mnt/nvme0/kv"}}}'

Everything else is the stock connector's: its scheduler side looks blocks up in the spec's
manager and plans store/load jobs; its worker side submits them to the spec's worker. What it
adds is the one thing the stock connector lacks: when a load did not bring every block back (a
checksum mismatch, an I/O error, a page evicted since the lookup), those blocks are reported to
vLLM's scheduler, which recomputes them (``kv_load_failure_policy: "recompute"``):

- one KV group: as block ids, through ``get_block_ids_with_load_errors`` (sync and async loads;
  the request keeps the blocks before the first failed one);
- several KV groups (hybrid models): block ids are not unique across groups, so vLLM takes
  only whole requests there: an asynchronous load with a failed block reports its request in
  ``failed_recving`` and it is recomputed from its first token. Sync loads
  (``sync_load_budget_bytes``) cannot be reported that way and are refused at start-up.
"""

from __future__ import annotations

import logging

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    get_offloading_group_ids)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from .spec import GdskvOffloadingWorker, built_by_gdskv_connector

log = logging.getLogger("gdskv.vllm")

SPEC_NAME = "GdskvOffloadingSpec"
SPEC_MODULE = "gdskv.adapters.vllm.spec"


class GdskvOffloadingConnector(OffloadingConnector):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config) -> None:
        transfer = vllm_config.kv_transfer_config
        extra = transfer.kv_connector_extra_config
        for key, want in (("spec_name", SPEC_NAME), ("spec_module_path", SPEC_MODULE)):
            if extra.setdefault(key, want) != want:
                raise ValueError(f"GdskvOffloadingConnector runs gdskv's spec only; "
                                 f"kv_connector_extra_config {key}={extra[key]!r} (leave it out)")
        if transfer.kv_load_failure_policy != "recompute":
            raise ValueError(f"GdskvOffloadingConnector needs \"kv_load_failure_policy\": "
                             f"\"recompute\" in --kv-transfer-config (got "
                             f"{transfer.kv_load_failure_policy!r}): a block that fails its "
                             f"checksum is then recomputed instead of failing the request")
        self._num_groups = len(get_offloading_group_ids(kv_cache_config))
        if self._num_groups > 1 and int(extra.get("sync_load_budget_bytes", 0)):
            raise ValueError("GdskvOffloadingConnector: sync_load_budget_bytes is not supported "
                             f"with {self._num_groups} KV groups (vLLM cannot recompute a "
                             "failed synchronous load there); leave it out")
        with built_by_gdskv_connector():
            super().__init__(vllm_config, role, kv_cache_config)
        self._load_reqs: dict[int, str | None] = {}  # load job -> its request (None: sync)
        self._invalid_blocks: set[int] = set()

    def _worker(self) -> GdskvOffloadingWorker:
        worker = self.connector_worker.worker
        assert isinstance(worker, GdskvOffloadingWorker)
        return worker

    def start_load_kv(self, forward_context, **kwargs) -> None:
        for job_id, entry in self._connector_metadata.load_jobs.items():
            self._load_reqs[job_id] = None if entry.sync else entry.req_id
        super().start_load_kv(forward_context, **kwargs)

    def get_transfer_results(self, finished_req_ids: set[str]):
        results = super().get_transfer_results(finished_req_ids)
        for job_id, block_ids in self._worker().take_load_errors().items():
            req_id = self._load_reqs.pop(job_id, None)
            log.warning("gdskv: %d block(s) of load job %d did not load (request %s); vLLM "
                        "recomputes them", len(block_ids), job_id, req_id)
            if self._num_groups == 1:
                self._invalid_blocks.update(block_ids)
            elif req_id is not None:
                results.failed_recving.add(req_id)
        for job_id in [j for j in self._load_reqs if j not in self._pending_loads()]:
            del self._load_reqs[job_id]
        return results

    def _pending_loads(self) -> set[int]:
        return set(self.connector_worker._load_jobs)

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid
