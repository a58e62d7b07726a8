"""SGLang's batch_exists_v2 hit policies (gdskv/adapters/sglang/hit_policy.py), against a direct
reading of SGLang 0.5.23's PoolHitPolicy docstrings: each stop point checked on its own, with no
shortcut. Needs no sglang."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gdskv.adapters.sglang.hit_policy import (
    ALL_PAGES,
    BLOCK_GROUPS,
    TRAILING_PAGES,
    PoolPresence,
    fold,
)


def reference(kv_pages, span, pools):
    """Every prefix length p in 1..kv_pages is a stop point unless a gating pool rules it out:
    ALL_PAGES needs pages [0, p) present, TRAILING_PAGES needs [p - N, p); BLOCK_GROUPS never
    rules one out and reports (leading complete groups) x block_pages, capped at the span."""
    hits = {"kv": kv_pages} if kv_pages else {}
    stops = list(range(1, kv_pages + 1))
    for pool in pools:
        if not stops:
            break
        if pool.policy == BLOCK_GROUPS:
            g = 0
            if pool.block_pages > 0 and pool.group_pages > 0:
                groups = [pool.present[i:i + pool.group_pages]
                          for i in range(0, len(pool.present), pool.group_pages)]
                for grp in groups:
                    if len(grp) < pool.group_pages or not all(grp):
                        break
                    g += 1
            if min(g * pool.block_pages, span):
                hits[pool.name] = min(g * pool.block_pages, span)
            continue
        if pool.policy == ALL_PAGES:
            ok = [p for p in range(1, kv_pages + 1) if all(pool.present[:p])]
        elif pool.policy == TRAILING_PAGES:
            n = max(1, pool.trailing)
            ok = [p for p in range(1, kv_pages + 1)
                  if all(pool.present[max(0, p - n):p])]
        else:
            ok = []
        if ok:
            hits[pool.name] = max(ok)
        stops = [p for p in stops if p in ok]
    return (stops[-1] if stops else 0), hits, stops


pool_strategy = st.builds(
    lambda name, policy, present, trailing, block, group: PoolPresence(
        name=name, policy=policy, present=present, trailing=trailing, block_pages=block,
        group_pages=group),
    st.sampled_from(["mamba", "swa", "indexer", "c4"]),
    st.sampled_from([ALL_PAGES, TRAILING_PAGES, BLOCK_GROUPS, "no_such_policy"]),
    st.lists(st.booleans(), min_size=12, max_size=12),
    st.integers(0, 5), st.integers(0, 4), st.integers(0, 3))


@settings(max_examples=400, deadline=None)
@given(kv_pages=st.integers(0, 12), pools=st.lists(pool_strategy, max_size=3,
                                                   unique_by=lambda p: p.name))
def test_fold_matches_the_docstring_semantics(kv_pages, pools):
    v = fold(kv_pages, 12, pools)
    final, hits, stops = reference(kv_pages, 12, pools)
    assert (v.final_pages, v.pool_hits, v.restorable) == (final, hits, stops)


def P(name, policy, present, **kw):
    return PoolPresence(name=name, policy=policy, present=[bool(c == "x") for c in present], **kw)


def test_all_pages_stops_at_the_first_missing_page():
    v = fold(6, 8, [P("indexer", ALL_PAGES, "xxx.xx..")])
    assert (v.final_pages, v.pool_hits, v.restorable) == (3, {"kv": 6, "indexer": 3}, [1, 2, 3])


def test_trailing_pages_leave_holes_and_keep_the_longest():
    # a 2-page window: complete ending at 2, 5 and 6, not at 3 or 4 (page 2 missing)
    v = fold(6, 6, [P("swa", TRAILING_PAGES, "xx.xxx", trailing=2)])
    assert v.restorable == [1, 2, 5, 6] and v.final_pages == 6 and v.pool_hits["swa"] == 6
    # the trailing page of the KV prefix missing: the prefix shortens to the last good stop
    v = fold(6, 6, [P("mamba", TRAILING_PAGES, "x.x.x.", trailing=1)])
    assert v.restorable == [1, 3, 5] and v.final_pages == 5


def test_block_groups_report_whole_groups_and_never_gate():
    # 2 keys per group, 4 FULL pages per block: groups 0 and 1 complete, group 2 not
    v = fold(5, 10, [P("c4", BLOCK_GROUPS, "xxxxx.", block_pages=4, group_pages=2)])
    assert v.pool_hits == {"kv": 5, "c4": 8} and v.final_pages == 5
    assert fold(5, 6, [P("c4", BLOCK_GROUPS, "xxxxxx", block_pages=4,
                         group_pages=2)]).pool_hits["c4"] == 6  # capped at the span
    incomplete = fold(5, 10, [P("c4", BLOCK_GROUPS, "x.xxxx", block_pages=4, group_pages=2)])
    assert "c4" not in incomplete.pool_hits and incomplete.final_pages == 5


def test_a_missing_pool_and_an_unknown_policy_give_no_hit():
    assert fold(4, 4, [P("mamba", TRAILING_PAGES, "....")]).final_pages == 0
    v = fold(4, 4, [P("x", "some_future_policy", "xxxx")])
    assert (v.final_pages, v.restorable) == (0, [])
    assert fold(0, 4, [P("indexer", ALL_PAGES, "xxxx")]).pool_hits == {}
