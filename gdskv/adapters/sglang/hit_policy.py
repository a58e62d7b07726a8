"""SGLang's per-pool hit policies for ``batch_exists_v2``, as pure functions of page presence.

SGLang 0.5.23 (``sglang/srt/mem_cache/hicache_storage.py``, ``PoolHitPolicy`` and
``HiCacheStorage.batch_exists_v2``) defines them; its file and Mooncake backends fold them the
same way, which is what this module does:

- The KV prefix: ``kv_pages`` = leading KV pages stored. The candidate stop points are the prefix
  lengths ``1..kv_pages`` (``restorable``).
- ``ALL_PAGES`` (e.g. the DSA indexer): every page in ``[0, kv_pages)`` must exist in the pool.
  Its boundary is the first missing page; it keeps the stop points up to it.
- ``TRAILING_PAGES`` (Mamba states, sliding-window KV): only the last ``N`` pages before a stop
  point must exist, ``N = len(transfer.keys)`` (at least 1). It keeps every stop point whose
  window is complete, so the set can have holes (5 restorable while 4 and 3 are not); its
  boundary is the largest one.
- ``BLOCK_GROUPS`` (compressed blocks): the pool's keys come in groups of ``group_pages`` keys,
  group ``g`` covering FULL pages ``[g * block_pages, (g + 1) * block_pages)`` from the span
  start. The pool's verdict is the pages its leading complete groups cover (capped at the span);
  it never gates the KV hit, so it keeps every stop point.

The result: ``final_pages`` = the largest stop point every gating pool kept (0 if none), the
per-pool boundaries (reported only when non-zero, as SGLang's backends do), and the stop points
themselves (``restorable_prefix_pages``, which SGLang intersects across ranks). Once no stop
point is left, later pools are not evaluated (they carry no verdict), as in SGLang's backends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ALL_PAGES = "all_pages"
TRAILING_PAGES = "trailing_pages"
BLOCK_GROUPS = "block_groups"
POLICIES = (ALL_PAGES, TRAILING_PAGES, BLOCK_GROUPS)


@dataclass(frozen=True)
class PoolPresence:
    """One pool's part of a query.

    ``present[i]``: whether the pool holds the page of ``keys[i]`` (for ``ALL_PAGES`` and
    ``TRAILING_PAGES``, the KV keys of the span, at least the first ``kv_pages``; for
    ``BLOCK_GROUPS``, the pool's own group keys). ``trailing``: the window of a
    ``TRAILING_PAGES`` pool. ``block_pages`` / ``group_pages``: a ``BLOCK_GROUPS`` pool's geometry.
    """

    name: object  # the engine's pool name, used as the key of its verdict
    policy: str
    present: Sequence[bool]
    trailing: int = 1
    block_pages: int = 0
    group_pages: int = 0


@dataclass(frozen=True)
class Verdict:
    final_pages: int
    pool_hits: dict
    restorable: list[int]


def all_pages_stops(present: Sequence[bool], kv_pages: int) -> set[int]:
    boundary = next((i for i in range(kv_pages) if not present[i]), kv_pages)
    return set(range(1, boundary + 1))


def trailing_pages_stops(present: Sequence[bool], kv_pages: int, trailing: int) -> set[int]:
    """Stop points ``p`` whose window ``[max(0, p - trailing), p)`` is complete; O(kv_pages)."""
    trailing = max(1, trailing)
    stops, run = set(), 0  # run: consecutive present pages ending at the current one
    for p in range(1, kv_pages + 1):
        run = run + 1 if present[p - 1] else 0
        if run >= min(trailing, p):
            stops.add(p)
    return stops


def block_groups_pages(present: Sequence[bool], span_pages: int, block_pages: int,
                       group_pages: int) -> int:
    """FULL pages covered by the leading complete key groups (0 for an invalid geometry)."""
    if block_pages < 1 or group_pages < 1:
        return 0
    groups = 0
    while (groups + 1) * group_pages <= len(present) and \
            all(present[groups * group_pages:(groups + 1) * group_pages]):
        groups += 1
    return min(groups * block_pages, span_pages)


def fold(kv_pages: int, span_pages: int, pools: Sequence[PoolPresence],
         kv_name: object = "kv") -> Verdict:
    """Fold the KV prefix and every pool's presence into SGLang's ``PoolTransferResult`` fields.

    A pool with a policy not in :data:`POLICIES` cannot be judged: it keeps no stop point (no
    hit rather than a guess)."""
    hits = {kv_name: kv_pages} if kv_pages else {}
    restorable = set(range(1, kv_pages + 1))
    for pool in pools:
        if not restorable:
            break
        if pool.policy == BLOCK_GROUPS:
            covered = block_groups_pages(pool.present, span_pages, pool.block_pages,
                                         pool.group_pages)
            if covered:
                hits[pool.name] = covered
            continue
        if pool.policy == ALL_PAGES:
            stops = all_pages_stops(pool.present, kv_pages)
        elif pool.policy == TRAILING_PAGES:
            stops = trailing_pages_stops(pool.present, kv_pages, pool.trailing)
        else:
            stops = set()
        if stops:
            hits[pool.name] = max(stops)
        restorable &= stops
    ordered = sorted(restorable)
    return Verdict(ordered[-1] if ordered else 0, hits, ordered)
