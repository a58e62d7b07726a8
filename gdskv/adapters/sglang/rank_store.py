"""This rank's tier for one SGLang pool: a store of its own, or a read-only follower of the store
the writer rank owns.

A pool whose pages are the same on every TP rank (MLA KV, the DSA indexer, DeepSeek-V4's
compressed pools) is stored once, by the writer rank. The other ranks read it through a
read-only follower tier (``TierConfig.read_only``), opened lazily: the writer may create the
store after them, so until it exists their reads are misses and the open is retried at most
every ``FOLLOWER_RETRY_S`` seconds.

With ``TierConfig.cluster`` the tier is a :class:`~gdskv.cluster.ClusterStore` (this rank's
namespace plus every other engine's), its node id built from the engine's ranks
(``node_ranks``); a follower rank then reads every namespace and writes none.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional, Sequence

import torch

from ...config import TierConfig
from ...layout import PageLayout
from ...store import StoreError
from ...cluster import open_tier
from ...tier_protocol import TierLike

log = logging.getLogger("gdskv.sglang")

#: seconds between a non-writer rank's attempts to open the writer's store
FOLLOWER_RETRY_S = 1.0


class RankStore:
    """The tier of one pool on this rank.

    Args:
        what: the pool, for log lines (``"KV"``, ``"mamba"``...).
        layout / config / device: the tier's (``config.directories`` already name the shard).
        follower: this rank reads the writer rank's store and writes nothing.
        log_once: the adapter's once-per-kind logger (a follower waiting for the writer).
        node_ranks: the engine's ranks for a cluster store's default node id (``("dp1",)``).
    """

    def __init__(self, what: str, layout: PageLayout, config: TierConfig, device: torch.device,
                 *, follower: bool, log_once: Callable[..., None],
                 node_ranks: Sequence[str] = ()) -> None:
        self.what = what
        self.layout = layout
        self.follower = follower
        self._device = device
        self._node_ranks = tuple(node_ranks)
        self._log_once = log_once
        self.tier: Optional[TierLike] = None
        self._follower_config: Optional[TierConfig] = None  # until the follower is open
        self._tried = float("-inf")
        self._lock = threading.Lock()
        dirs = ", ".join(config.directories)
        if not follower:
            self.tier = open_tier(layout, config, device=device, node_ranks=node_ranks)
            log.info("gdskv: %s store %s (%s), backend %s", what, dirs, layout.fingerprint,
                     self.tier.backend.name)
        elif not config.verify:
            log.warning("gdskv: this rank does not write the %s store and verify is off: a "
                        "read-only follower needs verify, so this rank reports %s misses",
                        what, what)
        else:
            self._follower_config = config.replace(read_only=True)
            log.info("gdskv: this rank does not write the %s store: reads follow the writer's "
                     "store in %s", what, dirs)
            self.open()

    def open(self) -> Optional[TierLike]:
        """The tier, or None while a follower's writer has not made the store yet."""
        if self.tier is not None or self._follower_config is None:
            return self.tier
        now = time.monotonic()
        if now - self._tried < FOLLOWER_RETRY_S or not self._lock.acquire(blocking=False):
            return None
        try:
            if self.tier is None:
                self._tried = now
                try:
                    self.tier = open_tier(self.layout, self._follower_config,
                                          device=self._device, node_ranks=self._node_ranks)
                except (StoreError, FileNotFoundError) as exc:
                    self._log_once(f"follower-wait:{self.what}", "%s follower: writer's store "
                                   "not readable yet (%s); misses until it is, retrying",
                                   self.what, exc, level=logging.INFO)
                else:
                    self._follower_config = None
                    where = ", ".join(self.tier.store.directories) if self.tier.store \
                        is not None else "every cluster node's namespace"
                    log.info("gdskv: %s follower opened %s (%d pages)", self.what, where,
                             self.tier.stats()["pages_stored"])
            return self.tier
        finally:
            self._lock.release()

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()
            self.tier = None
        self._follower_config = None
