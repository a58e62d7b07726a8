"""Crash safety: a child spills pages in a loop and is SIGKILLed at random moments; after each
kill the store reopens with every READY page bit-exact and every completed put present.

Two modes: ``explicit`` (the child evicts by itself, so the parent knows which completed puts
must still be there) and ``lru`` (the store is kept full and LRU evicts inside put, reusing
slots all the time; which pages LRU dropped is not known outside the child, so that mode checks
every READY page but not that each completed put survived)."""

from __future__ import annotations

import os
import random
import time

import pytest

from gdskv.tier import Tier
from reliability_helpers import (LAYOUT, check_pages, forkserver, ready_keys, small_config,
                                 spill_loop)


def _events(log_path: str) -> tuple[set, set]:
    """(keys whose last logged event is a completed put, keys the child saw read back wrong).
    No log yet: the kill came before the child opened it (a loaded machine), so nothing was
    completed."""
    last: dict[str, str] = {}
    wrong = set()
    if not os.path.exists(log_path):
        return set(), wrong
    with open(log_path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break  # a line the kill cut short
            kind, key = line.rstrip("\n").split(" ", 1)
            if kind == "W":
                wrong.add(key)
            else:
                last[key] = kind
    return {k for k, kind in last.items() if kind == "P"}, wrong


def run_crash_rounds(tmp_path, rounds: int, seed: int, max_delay: float, lru: bool = False,
                     **overrides) -> dict:
    ctx = forkserver()
    rng = random.Random(seed)
    store = tmp_path / ("store-lru" if lru else "store")
    store.mkdir(mode=0o700)
    log_path = str(tmp_path / ("completed-lru.log" if lru else "completed.log"))
    totals = dict(rounds=0, pages_checked=0, required=0, pages_lost=0, wrong_pages=0,
                  killed_while_running=0)
    for r in range(rounds):
        child = ctx.Process(target=spill_loop, args=(str(store), log_path, seed * 1000 + r, 200,
                                                     overrides, lru))
        child.start()
        time.sleep(rng.uniform(0.0, max_delay))
        if child.is_alive():
            totals["killed_while_running"] += 1
        child.kill()  # SIGKILL
        child.join()
        assert child.exitcode in (-9, None) or child.exitcode < 0, \
            f"round {r}: child died on its own (exit {child.exitcode}) before the kill"
        required, seen_wrong = _events(log_path)
        assert not seen_wrong, f"round {r}: the child read wrong bytes for {sorted(seen_wrong)}"
        with Tier(LAYOUT, small_config(store, **overrides), device="cpu") as tier:
            ready = ready_keys(tier)
            res = check_pages(tier, ready)
            missing = set() if lru else required - set(ready)
            assert not res["wrong"], f"round {r}: wrong bytes for {res['wrong']}"
            assert not missing, f"round {r}: completed puts lost: {sorted(missing)}"
            # sync=data: a READY page was durable before its COMMIT, so it must read back
            assert not res["missed"], f"round {r}: READY pages unreadable: {res['missed']}"
            assert tier.stats().get("corrupt_pages", 0) == 0
            totals["pages_checked"] += len(ready)
            totals["required"] += 0 if lru else len(required)
            totals["pages_lost"] += len(missing) + len(res["missed"])
            totals["wrong_pages"] += len(res["wrong"])
        totals["rounds"] += 1
    return totals


@pytest.mark.parametrize("lru,rounds", [(False, 5), (True, 3)], ids=["explicit", "lru"])
def test_sigkill_rounds(tmp_path, lru, rounds, data_path):
    # (the child is another process: the page engine's path goes to it in its config)
    totals = run_crash_rounds(tmp_path, rounds=rounds, seed=1, max_delay=0.6, lru=lru,
                              native=data_path == "native")
    print(f"crash rounds ({'lru' if lru else 'explicit'}):", totals)
    assert totals["rounds"] == rounds and totals["wrong_pages"] == 0 and totals["pages_lost"] == 0
    assert totals["pages_checked"] > 0, "the child never stored a page before being killed"


@pytest.mark.slow
@pytest.mark.parametrize("lru", [False, True], ids=["explicit", "lru"])
def test_sigkill_many_rounds(tmp_path, lru, data_path):
    rounds = int(os.environ.get("GDSKV_CRASH_ROUNDS", "120"))
    totals = run_crash_rounds(tmp_path, rounds=rounds, seed=7, max_delay=1.0, lru=lru,
                              native=data_path == "native")
    print(f"crash rounds (slow, {'lru' if lru else 'explicit'}):", totals)
    assert totals["rounds"] == rounds and totals["wrong_pages"] == 0 and totals["pages_lost"] == 0
