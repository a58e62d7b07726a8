"""What an engine adapter may call on the tier it opened: :class:`TierLike`.

:func:`gdskv.open_tier` returns a :class:`~gdskv.tier.Tier` (one store) or, with ``cluster``
on, a :class:`~gdskv.cluster.ClusterStore` (this node's store and every other node's). The
adapters use either through this protocol only, so each of them works in cluster mode too;
``tests/test_tier_protocol.py`` checks that both classes have every member here with the same
parameters.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from concurrent.futures import Future
from typing import Any, Optional, Protocol

import torch

from .config import TierConfig
from .directory import PageDirectory
from .layout import PageLayout
from .store import SlabStore


class TierLike(Protocol):
    """A tier of pages as the engine adapters use it (see :class:`~gdskv.tier.Tier` for what
    each call does). Pin handles are opaque: give each back to :meth:`unpin` of the tier that
    made it."""

    layout: PageLayout
    config: TierConfig
    device: torch.device
    read_only: bool

    @property
    def store(self) -> Optional[SlabStore]:
        """This process's own slab store (None on a read-only cluster node)."""

    @property
    def directory(self) -> Optional[PageDirectory]:
        """The page directory of this process's own store (None on a read-only cluster
        node)."""

    @property
    def backend(self) -> Any:
        """The I/O backend of this process's own store (None on a read-only cluster node)."""

    def put(self, keys: Sequence[Hashable], kv_pool, token_slots) -> list[bool]: ...

    def get(self, keys: Sequence[Hashable], kv_pool, token_slots) -> list[bool]: ...

    def put_async(self, keys, kv_pool, token_slots) -> Future: ...

    def get_async(self, keys, kv_pool, token_slots) -> Future: ...

    def put_pages(self, keys: Sequence[Hashable], pages) -> list[bool]: ...

    def get_pages(self, keys: Sequence[Hashable], pages) -> list[bool]: ...

    def put_pages_async(self, keys: Sequence[Hashable], pages) -> Future: ...

    def get_pages_async(self, keys: Sequence[Hashable], pages) -> Future: ...

    def pin(self, keys: Sequence[Hashable]) -> list[Any]: ...

    def unpin(self, handles: Sequence[Any]) -> None: ...

    def contains(self, key: Hashable) -> bool: ...

    def match_prefix(self, keys: Sequence[Hashable]) -> int: ...

    def refresh(self) -> int: ...

    def evict(self, keys: Sequence[Hashable]) -> int: ...

    def clear(self) -> None: ...

    def compact(self) -> None: ...

    def stats(self) -> dict: ...

    def close(self) -> None: ...
