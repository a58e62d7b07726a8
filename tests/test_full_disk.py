"""A full disk under a lazily grown store (``preallocate=False``) fails only the pages past the
point where it filled (issue 48 #6): a write that stops part way (a short ``pwritev``, then
ENOSPC) commits the whole pages it wrote. On a real full file system: an 8 MiB tmpfs
(``small_fs``, which needs root; skipped with the reason elsewhere)."""

from __future__ import annotations

import os

from gdskv.tier import Tier
from reliability_helpers import LAYOUT, SLOT, check_pages, put, ready_keys, small_config


def _fill(path, leave: int) -> None:
    """Take all free space of the file system holding ``path`` but ``leave`` bytes."""
    st = os.statvfs(os.path.dirname(path))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, st.f_bavail * st.f_frsize - leave)
    finally:
        os.close(fd)


def test_a_full_disk_fails_only_the_pages_past_it(small_fs):
    # one 128-page call in large chunks: its writes are a few long pwritev calls, which the
    # full disk cuts short part way
    cfg = small_config(small_fs, capacity=4096 * SLOT, preallocate=False,
                       io_chunk_size=256 * SLOT, staging_size=256 * SLOT, io_threads=4)
    room = 48
    keys = [f"k{i}" for i in range(128)]
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        # (the journal's first page now has room for the call's COMMIT records: on a disk
        # where the journal cannot grow either, the commit fails, see docs/errors.md)
        assert all(put(tier, ["first"]))
        _fill(os.path.join(small_fs, "filler"), leave=room * SLOT)
        ok = put(tier, keys)
        stored = [k for k, good in zip(keys, ok) if good]
        s = os.statvfs(small_fs)
        print(f"128-page put on a disk with room for {room} pages: stored {len(stored)}; "
              f"free after: {s.f_bavail * s.f_frsize} B")
        # each write that the disk cut may end inside a page, which fails: a few pages at most
        assert room - 4 <= len(stored) <= room
        assert tier.stats()["write_failed"] == len(keys) - len(stored)
        res = check_pages(tier, stored)
        assert res["hits"] == len(stored) and not res["wrong"]
    with Tier(LAYOUT, cfg, device="cpu") as tier:  # committed: there after a restart
        assert sorted(ready_keys(tier)) == sorted(stored + ["first"])
        res = check_pages(tier, stored)
        assert res["hits"] == len(stored) and not res["wrong"]
