"""The call ledger (gdskv/ledger.py): a data call's counters applied off its critical path,
yet exact wherever they are read (stats(), a scrape) and applied within the idle interval."""

from __future__ import annotations

import logging
import threading
import time

from gdskv.ledger import CallLedger
from gdskv.tier import Tier
from reliability_helpers import LAYOUT, put, read_back, small_config


def test_entries_are_applied_once_in_order_by_settle():
    seen = []
    ledger = CallLedger(lambda *e: seen.append(e), idle_seconds=60)
    try:
        for i in range(5):
            ledger.record(i, "x")
        assert seen == []  # recorded only
        ledger.settle()
        assert seen == [(i, "x") for i in range(5)]
        ledger.settle()
        assert len(seen) == 5
    finally:
        ledger.close()


def test_the_idle_thread_applies_what_no_call_settles():
    seen = []
    ledger = CallLedger(lambda *e: seen.append(e), idle_seconds=0.05)
    try:
        ledger.record("late")
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [("late",)]
    finally:
        ledger.close()
    assert not ledger._thread.is_alive()


def test_many_entries_wake_the_idle_thread():
    """WAKE_AT entries waiting are applied at once, not at the idle interval's end: a quick
    call settles nothing itself, and entries left for long outlive the collector's young
    generations."""
    from gdskv import ledger as ledger_module
    seen = []
    ledger = CallLedger(lambda *e: seen.append(e), idle_seconds=60)
    try:
        for i in range(ledger_module.WAKE_AT - 1):
            ledger.record(i)
        time.sleep(0.2)
        assert seen == []  # fewer: they wait for the interval (or a settle)
        ledger.record("last")
        deadline = time.monotonic() + 5
        while len(seen) < ledger_module.WAKE_AT and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [(i,) for i in range(ledger_module.WAKE_AT - 1)] + [("last",)]
    finally:
        ledger.close()


def test_a_data_call_does_not_wait_for_another_settler():
    """settle(wait=False) returns at once while another thread applies (that one applies all)."""
    started, release, seen = threading.Event(), threading.Event(), []

    def slow(entry):
        started.set()
        release.wait(5)
        seen.append(entry)

    ledger = CallLedger(slow, idle_seconds=60)
    try:
        ledger.record(1)
        t = threading.Thread(target=ledger.settle)
        t.start()
        assert started.wait(5)
        ledger.record(2)
        t0 = time.perf_counter()
        ledger.settle(wait=False)
        assert time.perf_counter() - t0 < 1.0 and seen == []
        release.set()
        t.join(5)
        ledger.settle()
        assert seen == [1, 2]
    finally:
        ledger.close()


def test_a_failing_entry_is_logged_once_and_the_rest_still_apply(caplog):
    seen = []

    def apply(x):
        if x < 0:
            raise RuntimeError("bad entry")
        seen.append(x)

    ledger = CallLedger(apply, idle_seconds=60)
    with caplog.at_level(logging.ERROR, logger="gdskv.ledger"):
        for x in (1, -1, 2, -2, 3):
            ledger.record(x)
        ledger.settle()
        ledger.close()
    assert seen == [1, 2, 3]
    assert len([r for r in caplog.records if "bad entry" in r.getMessage()]) == 1


def test_a_tiers_counters_are_exact_right_after_each_call_and_its_thread_ends(tmp_path):
    with Tier(LAYOUT, small_config(tmp_path), device="cpu") as tier:
        for i in range(3):
            assert all(put(tier, [f"k{i}"]))
            assert tier.stats()["put_stored"] == i + 1
        hits, _ = read_back(tier, ["k0", "k1", "nope"])
        s = tier.stats()
        assert (s["hits"], s["misses"], s["get_pages"]) == (2, 1, 3)
        thread = tier._ledger._thread
        assert thread.is_alive()
    assert not thread.is_alive()
    assert tier.stats()["put_stored"] == 3  # the final counters, after close


def test_flush_ends_each_settle_that_applied_entries():
    events = []
    ledger = CallLedger(lambda *e: events.append(e), idle_seconds=60,
                        flush=lambda: events.append("flush"))
    try:
        ledger.settle()
        assert events == []  # nothing applied: no flush
        ledger.record(1)
        ledger.record(2)
        ledger.settle()
        assert events == [(1,), (2,), "flush"]
    finally:
        ledger.close()
