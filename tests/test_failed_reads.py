"""A page whose read fails is dropped from the directory, so every existence check answers MISS
and no engine loads it again and again (issue 46 #1): at once for a failure that lasts (a short
read: the slab was truncated; a checksum mismatch), after ``Tier.READ_RETRIES`` more tries for
one that may pass (EIO). On each backend this machine runs (posix, nixl)."""

from __future__ import annotations

import errno
import os

import pytest

from conftest import NEEDS_NIXL, fail_first_reads, fail_io
from gdskv.tier import Tier
from reliability_helpers import (LAYOUT, SLOT, check_pages, put, read_back, ready_keys,
                                 slot_location, small_config)

BACKENDS = [pytest.param("posix", id="posix"), pytest.param("nixl", id="nixl", marks=NEEDS_NIXL)]


def config(tmp_path, backend: str, **overrides):
    # one file, 16-slot stripes: pages k0.. sit in slots 0.. of slab-000.bin
    return small_config(tmp_path, backend=backend, files_per_dir=1, io_chunk_size=16 * SLOT,
                        staging_size=32 * SLOT, **overrides)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("aligned", [False, True], ids=["staged", "in-place"])
def test_truncated_slab_settles_as_misses_in_one_call(tmp_path, backend, aligned):
    keys = [f"k{i}" for i in range(12)]
    cfg = config(tmp_path, backend)
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        assert all(put(tier, keys, aligned=aligned))
        path, off = slot_location(tier, keys[8])
        assert [slot_location(tier, k) for k in keys] == [(path, i * SLOT) for i in range(12)]
        os.truncate(path, off + 100)  # the slab now ends inside page 8
        hits, _ = read_back(tier, keys, aligned=aligned)
        assert hits == [True] * 8 + [False] * 4
        # one failed read is enough: the pages past the end are gone for every caller
        assert [tier.contains(k) for k in keys] == hits
        assert tier.match_prefix(keys) == 8
        s = tier.stats()
        assert s["unreadable_pages"] == 4 and s["corrupt_pages"] == 0
        read_failed = s["read_failed"]
        assert read_back(tier, keys, aligned=aligned)[0] == hits
        assert tier.stats()["read_failed"] == read_failed  # no second read of them
    with Tier(LAYOUT, cfg, device="cpu") as tier:  # the journal said so: gone after a restart
        assert sorted(ready_keys(tier)) == sorted(keys[:8])
        res = check_pages(tier, keys[:8])
        assert res["hits"] == 8 and not res["wrong"]
        assert all(put(tier, keys[8:]))  # the slots are usable again (the file grows back)
        assert check_pages(tier, keys)["hits"] == 12


@pytest.mark.parametrize("fails", [Tier.READ_RETRIES, Tier.READ_RETRIES + 1])
@pytest.mark.parametrize("aligned", [False, True], ids=["staged", "in-place"])
def test_transient_eio_is_tried_again_then_dropped(tmp_path, monkeypatch, fails, aligned):
    """The first ``fails`` reads of the file fail with EIO: up to READ_RETRIES the call still
    hits (bit exact); one more and the pages are dropped after that call."""
    keys = [f"e{i}" for i in range(6)]
    with Tier(LAYOUT, config(tmp_path, "posix"), device="cpu") as tier:
        assert all(put(tier, keys, aligned=aligned))
        attempts = fail_first_reads(monkeypatch, tier.backend, tier.store.files[0].fd, fails)
        res = check_pages(tier, keys)
        calls = [None] * attempts()
        assert not res["wrong"]
        if fails <= Tier.READ_RETRIES:
            assert res["hits"] == 6 and all(tier.contains(k) for k in keys)
            assert len(calls) == fails + 1
        else:
            assert res["hits"] == 0 and not any(tier.contains(k) for k in keys)
            assert len(calls) == Tier.READ_RETRIES + 1  # bounded: tried, then dropped
            assert tier.stats()["unreadable_pages"] == 6
        monkeypatch.undo()  # the faults end
        assert check_pages(tier, keys)["hits"] == (6 if fails <= Tier.READ_RETRIES else 0)


def test_a_file_gone_is_not_tried_again(tmp_path, monkeypatch):
    """ENOENT/ESTALE (a file gone, e.g. on NFS) last: dropped after one read, no retry."""
    keys = [f"g{i}" for i in range(4)]
    with Tier(LAYOUT, config(tmp_path, "posix"), device="cpu") as tier:
        assert all(put(tier, keys))
        bad_fd = tier.store.files[0].fd
        seen = fail_io(monkeypatch, tier.backend, "read", lambda fd, _: fd == bad_fd,
                       errno.ESTALE)
        assert check_pages(tier, keys)["hits"] == 0
        assert seen and seen.count(seen[0]) == 1 and not any(tier.contains(k) for k in keys)


def test_a_page_put_again_is_not_dropped_by_a_late_verdict(tmp_path):
    """Dropping names the slot that failed: a newer copy of the key elsewhere stays."""
    keys = ["late"]
    with Tier(LAYOUT, config(tmp_path, "posix"), device="cpu") as tier:
        assert all(put(tier, keys))
        old = tier.directory._index["late"]
        tier.evict(keys)
        assert all(put(tier, ["filler", "late"]))  # filler takes the old slot
        new = tier.directory._index["late"]
        assert new != old
        tier.directory.remove(["late"], [old])  # the verdict about the old slot
        assert tier.contains("late")
        tier.directory.remove(["late"], [new])
        assert not tier.contains("late")
