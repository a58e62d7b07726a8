"""A journal cut exactly at a record boundary (issue 46, item 4): it decodes whole, so only the
slot trailers can show that pages were committed after its end. A writer child acknowledges
pages (each True answer logged) and is SIGKILLed; the journal is then cut at several record
boundaries, and after each cut every acknowledged page must read back bit-exact."""

from __future__ import annotations

import logging
import os
import time

import pytest

from ack_helpers import ack_writer, read_log
from gdskv.journal import decode_all
from gdskv.store import JOURNAL
from gdskv.tier import Tier
from reliability_helpers import LAYOUT, SLOT, check_pages, forkserver, small_config


def _boundaries(data: bytes) -> list[int]:
    """The offset where each record ends."""
    records, valid, _ = decode_all(data)
    assert valid == len(data)
    ends, pos = [], 0
    for _ in records:
        pos += 8 + int.from_bytes(data[pos:pos + 4], "little")
        ends.append(pos)
    return ends


def _killed_writer(tmp_path, overrides: dict, evict_above, rounds: int) -> tuple[str, list]:
    """Run an ack_writer for ``rounds`` batches, SIGKILL it; (store, acknowledged keys)."""
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    log, done = str(tmp_path / "acks.log"), tmp_path / "done"
    child = forkserver().Process(target=ack_writer, args=(str(store), log, "k", overrides,
                                                          rounds, evict_above, str(done)))
    child.start()
    try:
        t0 = time.monotonic()
        while not done.exists():
            assert child.is_alive(), read_log(log)
            assert time.monotonic() - t0 < 120
            time.sleep(0.05)
    finally:
        child.kill()
        child.join()
    return store, read_log(log)["acked"]


@pytest.mark.parametrize("mode", ["free-slots", "full-store"])
def test_journal_cut_at_record_boundaries_loses_no_acknowledged_page(tmp_path, mode, caplog):
    """free-slots: explicit evictions keep the store under 70%, so the pages after the cut went
    to slots the cut journal calls free; full-store: LRU evicts all the time, so they went over
    pages the cut journal still calls live (every acknowledged page among the newest half of
    the store's slots must survive)."""
    full = mode == "full-store"
    overrides = dict(capacity=(64 if full else 512) * SLOT)
    store, acked = _killed_writer(tmp_path, overrides, None if full else 0.7,
                                  rounds=60 if full else 150)
    must = acked[-32:] if full else acked
    path = os.path.join(store, JOURNAL)
    with open(path, "rb") as f:
        whole = f.read()
    ends = _boundaries(whole)
    n = len(ends)
    cuts = sorted({n // 4, n // 2, 3 * n // 4, n - 5, n - 1})
    lost = {}
    for keep in cuts:
        with open(path, "wb") as f:  # each cut starts from the journal the kill left
            f.write(whole[:ends[keep - 1]])
        with caplog.at_level(logging.WARNING, logger="gdskv.persistence"):
            with Tier(LAYOUT, small_config(store, **overrides), device="cpu") as tier:
                res = check_pages(tier, must)
        assert not res["wrong"], (keep, res["wrong"])
        lost[f"{keep}/{n}"] = len(res["missed"])
    print(f"{mode}: {len(must)} acknowledged pages checked after each cut "
          f"(records kept/records: lost): {lost}")
    assert not any(lost.values()), lost
    assert "shorter than" in caplog.text
