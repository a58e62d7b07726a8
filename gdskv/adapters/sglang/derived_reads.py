"""KV-derived sidecar pools read alongside the KV batch they derive from.

SGLang's cache controller reads a hybrid model's L3 pages one 128-page batch at a time
(``CacheController._page_transfer_kv_batch``): ``batch_get_v1`` of the KV pages, then, for every
sidecar pool whose host indices are the KV pool's (``PoolTransfer.indices_from_pool == KV``:
the DSA indexer, draft SWA...), ``batch_get_v2`` of the *same keys into the same host indices*.
Run one after the other, the sidecar's call pays a whole call's fixed cost for a tenth of the
bytes (bench/RESULTS.md, "Hybrid models": +27 % time for +11.5 % bytes on /dev/shm).

So the adapter starts those sidecar reads when the KV batch's ``batch_get_v1`` starts, runs them
beside the KV read, and waits for both before ``batch_get_v1`` returns; the ``batch_get_v2``
that follows finds its answer ready (:meth:`DerivedReads.take`) when its pool, keys and host
indices match, and reads as before when they do not. Why this is safe:

- the sidecar pages land in the sidecar pool's slots at the KV batch's host indices, which the
  prefetch operation owns while ``batch_get_v1`` runs (the controller allocated them for it);
  nothing is written after ``batch_get_v1`` returns;
- a prepared answer is what the same read would have answered a moment later: the pages were
  read and verified into exactly the memory ``batch_get_v2`` names, and only the controller
  writes that memory;
- answers nobody takes (a pool the controller did not ask for this time) are dropped, oldest
  first, past :data:`KEPT_ANSWERS`.

Which pools are KV-derived is learned from the transfers SGLang passes to ``batch_exists_v2``
and ``batch_set_v2`` (their ``indices_from_pool``); until then every sidecar read runs alone.
This module needs no sglang: the benchmark (``bench/experiments/hybrid_read.py``) drives it as
the adapter does.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

log = logging.getLogger("gdskv.sglang")

#: prepared answers kept for a ``batch_get_v2`` that has not come yet (per adapter); more than
#: the controller's batches in flight at once
KEPT_ANSWERS = 16

Read = Callable[[], list]


class DerivedReads:
    """The adapter's KV-derived sidecar reads: which pools they are, and answers prepared for
    the ``batch_get_v2`` calls to come.

    Args:
        enabled: False turns read-alongside off (every sidecar read runs when asked).
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._pools: set[str] = set()
        self._answers: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    @property
    def pools(self) -> frozenset:
        """Names of the pools known to be KV-derived."""
        return frozenset(self._pools)

    def learn(self, name: str) -> None:
        """``name`` is a KV-derived pool (its transfers take the KV batch's host indices)."""
        if name not in self._pools:
            self._pools.add(name)
            log.info("gdskv: sidecar pool %s is KV-derived: read alongside each KV batch%s",
                     name, "" if self.enabled else " (off: sidecar_with_kv is false)")

    def read_with_kv(self, keys: Sequence[str], host_indices: torch.Tensor, kv_read: Read,
                     sidecar_reads: dict[str, Read]) -> list:
        """``kv_read()`` on this thread with every ``sidecar_reads[name]()`` beside it; returns
        the KV read's answer once all are done, and keeps each sidecar's answer for
        :meth:`take`. A sidecar read that raises keeps no answer (its pool is read when asked)."""
        if not (self.enabled and sidecar_reads):
            return kv_read()
        if self._executor is None:
            with self._lock:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(max(4, len(sidecar_reads)),
                                                        thread_name_prefix="gdskv-sidecar")
        futures = {name: self._executor.submit(read) for name, read in sidecar_reads.items()}
        try:
            return kv_read()
        finally:
            # Never return while a sidecar read may still write the pool: wait for all.
            indices = host_indices.clone()
            for name, fut in futures.items():
                try:
                    answer = fut.result()
                except Exception as exc:  # noqa: BLE001 - read again when asked
                    log.debug("read-alongside of %s failed: %r", name, exc)
                    continue
                self._keep(name, tuple(keys), indices, answer)

    def take(self, name: str, keys: Sequence[str], host_indices: torch.Tensor):
        """The answer prepared for reading ``keys`` of pool ``name`` into ``host_indices``, or
        None (read them now). An answer is taken once."""
        with self._lock:
            entry = self._answers.pop((name, tuple(keys)), None)
        if entry is None:
            return None
        indices, answer = entry
        if indices.shape != host_indices.shape or not torch.equal(indices,
                                                                  host_indices.cpu()):
            return None
        return answer

    def _keep(self, name: str, keys: tuple, indices: torch.Tensor, answer: list) -> None:
        with self._lock:
            self._answers[(name, keys)] = (indices, answer)
            self._answers.move_to_end((name, keys))
            while len(self._answers) > KEPT_ANSWERS:
                self._answers.popitem(last=False)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        with self._lock:
            self._answers.clear()
