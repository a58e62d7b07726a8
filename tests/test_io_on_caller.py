"""io_on_caller: a call of one chunk whose I/O the backend's pool would run on one thread moves
its bytes on the calling thread (``Backend.move_on_caller``); larger calls, and every call with
the option off, go through the pool. Both paths must give the same bytes and the same failures."""

from __future__ import annotations

import errno
import threading

import pytest
import torch

from gdskv.backends.base import CompletedIO, IOOutcome
from gdskv.config import TierConfig
from gdskv.layout import KVLayout
from gdskv.tier import Tier

from conftest import assert_same_rows, empty_like_pool, fail_io, random_pool

LAYOUT = KVLayout(num_layers=3, page_size=16, head_dim=32, kv_heads=2, dtype="bf16")
SLOTS = 64 * LAYOUT.page_size


def _spy(tier: Tier) -> list[tuple[str, bool, int]]:
    """Record each ``move_on_caller`` call: (op, whether the backend moved it, thread id)."""
    calls: list[tuple[str, bool, int]] = []
    move = tier.backend.move_on_caller

    def spied(op, buffer, extents):
        done = move(op, buffer, extents)
        calls.append((op, done is not None, threading.get_ident()))
        return done

    tier.backend.move_on_caller = spied
    return calls


def _slots(pages: int, first: int = 0) -> torch.Tensor:
    return torch.arange(first * LAYOUT.page_size, (first + pages) * LAYOUT.page_size)


@pytest.mark.parametrize("on", [True, False], ids=["on", "off"])
def test_one_chunk_calls_move_on_the_calling_thread(make_config, device, backend_name, on):
    src = random_pool(LAYOUT, SLOTS, device=device, seed=1)
    dst = empty_like_pool(src)
    with Tier(LAYOUT, make_config(io_on_caller=on), device=device) as tier:
        calls = _spy(tier)
        assert tier.put(["a"], src, _slots(1)) == [True]
        assert tier.get(["a"], dst, _slots(1, first=5)) == [True]
        assert_same_rows(src, _slots(1), dst, _slots(1, first=5))
        if not on:
            assert calls == []
        else:
            me = threading.get_ident()
            # posix and kvikio move it here; NIXL's threads always do (the base class's None)
            moved = backend_name in ("posix", "kvikio")
            assert calls == [("write", moved, me), ("read", moved, me)]
        s = tier.stats()
        assert s["write_failed"] == 0 and s["read_failed"] == 0


def test_calls_of_several_chunks_go_through_the_pool(make_config, device, backend_name):
    src = random_pool(LAYOUT, SLOTS, device=device, seed=2)
    dst = empty_like_pool(src)
    # staging of 4 parts of two slots each: 9 pages are 5 chunks
    cfg = make_config(staging_size=8 * LAYOUT.slot_bytes)
    keys = [f"k{i}" for i in range(9)]
    with Tier(LAYOUT, cfg, device=device) as tier:
        calls = _spy(tier)
        assert tier.put(keys, src, _slots(9)) == [True] * 9
        assert tier.get(keys, dst, _slots(9, first=20)) == [True] * 9
        assert_same_rows(src, _slots(9), dst, _slots(9, first=20))
        assert calls == []


def test_a_failed_io_on_the_calling_thread_fails_its_pages_only(tmp_path, monkeypatch):
    """posix: an error in a write or read moved on the caller is a failed page, as from the
    pool: the page is not stored (its slot given back); a failed read is a miss, read again
    (on the caller too) READ_RETRIES times, then the page is dropped (issue 46 #1)."""
    src = random_pool(LAYOUT, SLOTS, seed=3)
    dst = empty_like_pool(src)
    cfg = TierConfig(directories=(str(tmp_path),), capacity="16MiB", staging_size="1MiB",
                     backend="posix")
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        calls = _spy(tier)
        with monkeypatch.context() as m:
            failed_writes = fail_io(m, tier.backend, "write", error=errno.EIO)
            assert tier.put(["bad"], src, _slots(1)) == [False]
        assert failed_writes and calls[-1][:2] == ("write", True)
        assert not tier.contains("bad") and len(tier.directory) == 0
        assert tier.put(["good"], src, _slots(1, first=1)) == [True]
        with monkeypatch.context() as m:
            failed_reads = fail_io(m, tier.backend, "read", error=errno.EIO)
            assert tier.get(["good"], dst, _slots(1, first=7)) == [False]
        assert len(failed_reads) == 1 + Tier.READ_RETRIES and calls[-1][:2] == ("read", True)
        assert not tier.contains("good")
        assert tier.put(["good"], src, _slots(1, first=1)) == [True]
        assert tier.get(["good"], dst, _slots(1, first=7)) == [True]
        assert_same_rows(src, _slots(1, first=1), dst, _slots(1, first=7))
        s = tier.stats()
        assert s["write_failed"] == 1 and s["read_failed"] == 1


def test_completed_io_runs_callbacks_at_once():
    out = IOOutcome(nbytes=7)
    fut = CompletedIO(out)
    seen = []
    fut.add_done_callback(seen.append)
    assert seen == [fut] and fut.done() and fut.result() is out and fut.exception() is None
