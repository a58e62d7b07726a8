"""Host regions moved in place on a CPU tier (gdskv/host_pages.py): put_pages / get_pages write
straight from the caller's memory and read straight into it, with the same checksums, trailers,
journal, sync policy, pins and failure handling as the staging path; pages whose regions do not
allow it (unaligned under O_DIRECT) go through staging in the same call. Real POSIX backend."""

from __future__ import annotations

import contextlib
import os

import crc32c
import numpy as np
import pytest
import torch

from conftest import HAS_CUDA, NEEDS_NIXL, fail_io
from gdskv import native
from gdskv.backends.posix import IOV_MAX, _vector_io
from gdskv.backends.base import SlabFile
from gdskv.config import TierConfig
from gdskv.host_pages import PARALLEL_HASH_BYTES, HostPagePath
from gdskv.layout import BytePageLayout
from gdskv.memory import alloc_host
from gdskv.slot_trailer import TRAILER_BYTES
from gdskv.tier import Tier

KIND = "test/host-pages"


def config(tmp_path, **overrides) -> TierConfig:
    d = tmp_path / "store"
    d.mkdir(exist_ok=True)
    base = dict(directories=(str(d),), capacity="16MiB", staging_size="256KiB",
                io_chunk_size="64KiB", io_threads=4, backend="posix", files_per_dir=2)
    base.update(overrides)
    return TierConfig(**base)


def direct(tier) -> bool:
    """Whether any slab file has O_DIRECT (then only aligned regions go in place)."""
    return any(f.direct for f in tier.store.files)


def host(nbytes: int, skew: int = 0) -> torch.Tensor:
    """Zeroed host bytes starting ``skew`` bytes past a 4 KiB boundary."""
    raw = alloc_host(nbytes + 4096, pin=False)
    raw.zero_()
    return raw[skew:skew + nbytes]


def contents(n: int, page_bytes: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (page_bytes,), dtype=torch.uint8, generator=g)
            for _ in range(n)]


def as_regions(data: torch.Tensor, sizes: list[int], skew: int = 0) -> list[torch.Tensor]:
    """``data`` copied into fresh host regions of these sizes (each ``skew`` past 4 KiB)."""
    out, done = [], 0
    for n in sizes:
        r = host(n, skew)
        r.copy_(data[done:done + n])
        out.append(r)
        done += n
    assert done == data.numel()
    return out


@contextlib.contextmanager
def stored_pages(tmp_path, page_bytes: int, n: int, seed: int, prefix: str, **overrides):
    """A posix tier holding ``n`` pages of distinct bytes, each written in place from one
    region; yields (tier, keys, data)."""
    layout = BytePageLayout(page_bytes=page_bytes, kind=KIND)
    data = contents(n, page_bytes, seed=seed)
    keys = [f"{prefix}{i}" for i in range(n)]
    with Tier(layout, config(tmp_path, **overrides), device="cpu") as tier:
        assert all(tier.put_pages(keys, [as_regions(d, [page_bytes]) for d in data]))
        yield tier, keys, data


def stored_sums(tier) -> dict:
    """key -> the payload checksum the directory (and journal) hold."""
    return {k: csum for k, _, csum in tier.directory.ready_items()}


def joined(regions: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([r.clone() for r in regions])


@pytest.mark.parametrize("page_bytes", [3 * 4096, 3 * 4096 + 100, 4096 - 400, 5000],
                         ids=["whole-blocks", "partial-last-block", "under-one-block",
                              "trailer-in-next-block"])
def test_in_place_round_trip_bit_exact(tmp_path, page_bytes):
    layout = BytePageLayout(page_bytes=page_bytes, kind=KIND)
    data = contents(20, page_bytes, seed=page_bytes)
    keys = [f"k{i}" for i in range(len(data))]
    with Tier(layout, config(tmp_path), device="cpu") as tier:
        assert tier.stats()["in_place"]["enabled"]
        assert tier.put_pages(keys, [as_regions(d, [page_bytes]) for d in data]) == [True] * 20
        out = [[host(page_bytes)] for _ in data]
        assert tier.get_pages(keys, out) == [True] * 20
        assert all(torch.equal(d, o[0]) for d, o in zip(data, out))
        s = tier.stats()
        assert s["pages_written_in_place"] == 20 and s["pages_read_in_place"] == 20
        assert "region_pages_written_staged" not in s and "region_pages_read_staged" not in s
        # the checksum the journal holds is the CRC-32C of the caller's bytes
        assert stored_sums(tier)["k3"] == crc32c.crc32c(data[3].numpy())


def test_unaligned_regions_go_through_staging(tmp_path):
    page_bytes = 2 * 4096
    layout = BytePageLayout(page_bytes=page_bytes, kind=KIND)
    data = contents(6, page_bytes, seed=1)
    keys = [f"u{i}" for i in range(6)]
    with Tier(layout, config(tmp_path), device="cpu") as tier:
        if not direct(tier):
            pytest.skip("no O_DIRECT on this file system: every host region goes in place")
        assert tier.put_pages(keys, [as_regions(d, [page_bytes], skew=1) for d in data]) == \
            [True] * 6
        out = [[host(page_bytes, skew=64)] for _ in data]
        assert tier.get_pages(keys, out) == [True] * 6
        assert all(torch.equal(d, o[0]) for d, o in zip(data, out))
        s = tier.stats()
        assert s["region_pages_written_staged"] == 6 and s["region_pages_read_staged"] == 6
        assert "pages_written_in_place" not in s and "pages_read_in_place" not in s


def test_multi_region_pages(tmp_path):
    page_bytes = 5 * 4096 + 700
    layout = BytePageLayout(page_bytes=page_bytes, kind=KIND)
    data = contents(8, page_bytes, seed=2)
    keys = [f"m{i}" for i in range(8)]
    aligned = [2 * 4096, 4096, 2 * 4096 + 700]     # all but the last whole 4 KiB blocks
    ragged = [4096 + 10, 4 * 4096 - 10 + 700]      # a region ends inside a block
    with Tier(layout, config(tmp_path), device="cpu") as tier:
        pages = [as_regions(d, aligned if i % 2 else ragged) for i, d in enumerate(data)]
        assert tier.put_pages(keys, pages) == [True] * 8      # one call, both paths
        out = [[host(3 * 4096), host(2 * 4096 + 700)] for _ in data]
        assert tier.get_pages(keys, out) == [True] * 8
        assert all(torch.equal(d, joined(o)) for d, o in zip(data, out))
        s = tier.stats()
        staged = 4 if direct(tier) else 0
        assert s.get("region_pages_written_staged", 0) == staged
        assert s["pages_written_in_place"] == 8 - staged
        assert s["pages_read_in_place"] == 8
        # the journal and directory were told about each page once, in one call
        assert tier.match_prefix(keys) == 8 and s["put_stored"] == 8


def test_an_unaligned_last_region_reads_through_its_scratch_row(tmp_path):
    """SGLang's DSA indexer after its KV page: whole aligned blocks, then a region at an
    unaligned address. Under O_DIRECT the aligned regions move in place and the last one
    through the page's scratch row, in the same read; bit-exact both ways, a flipped byte in
    either part a miss, and the slot's padding written as zeros (scratch rows are reused)."""
    kv_bytes, rider_bytes = 3 * 4096, 5000
    page_bytes = kv_bytes + rider_bytes
    layout = BytePageLayout(page_bytes=page_bytes, kind=KIND)
    data = contents(10, page_bytes, seed=7)
    keys = [f"r{i}" for i in range(10)]

    def regions(d, skew):
        return as_regions(d[:kv_bytes], [kv_bytes]) + as_regions(d[kv_bytes:], [rider_bytes],
                                                                 skew=skew)

    # the rider's start: unaligned for most pages, aligned for some (one read mixes both)
    skews = [100 * (i % 4) for i in range(10)]
    with Tier(layout, config(tmp_path), device="cpu") as tier:
        if not direct(tier):
            pytest.skip("no O_DIRECT on this file system: every host region goes in place")
        # unaligned riders (their whole 5000 B in the row), then aligned ones (904 B in a
        # shorter row) in the same, reused scratch memory, then a mix
        assert tier.put_pages(keys[:2], [regions(d, 100) for d in data[:2]]) == [True] * 2
        assert tier.put_pages(keys[2:6], [regions(d, 0) for d in data[2:6]]) == [True] * 4
        assert tier.put_pages(keys[6:], [regions(d, k) for d, k in zip(data[6:], skews[6:])]) \
            == [True] * 4
        out = [regions(torch.zeros(page_bytes, dtype=torch.uint8), k + 8) for k in skews]
        assert tier.get_pages(keys, out) == [True] * 10
        assert all(torch.equal(d, joined(o)) for d, o in zip(data, out))
        s = tier.stats()
        assert s["pages_written_in_place"] == 10 and s["pages_read_in_place"] == 10
        assert "region_pages_written_staged" not in s and "region_pages_read_staged" not in s
        # the padding between the payload and the trailer is zeros on disk
        for key in keys:
            f, off = tier.store.location(tier.directory._index[key])
            with open(tier.store.files[f].path, "rb") as fh:
                pad = os.pread(fh.fileno(), layout.slot_bytes - TRAILER_BYTES - page_bytes,
                               off + page_bytes)
            assert pad == bytes(len(pad)), key
        # a flipped byte in the KV part of r2 and in the rider part of r5: both misses
        for key, at in (("r2", 10), ("r5", kv_bytes + 4000)):
            f, off = tier.store.location(tier.directory._index[key])
            fd = os.open(tier.store.files[f].path, os.O_RDWR)
            try:
                os.pwrite(fd, bytes([os.pread(fd, 1, off + at)[0] ^ 4]), off + at)
            finally:
                os.close(fd)
        out = [regions(torch.zeros(page_bytes, dtype=torch.uint8), 300) for _ in data]
        hits = tier.get_pages(keys, out)
        assert hits == [k not in ("r2", "r5") for k in keys]
        assert all(torch.equal(d, joined(o)) for d, o, h in zip(data, out, hits) if h)


def test_async_calls_from_one_thread_keep_their_own_scratch_rows(tmp_path):
    """Scratch rows are the running thread's, taken when the call runs: two ``_async`` calls
    made back to back from one thread run on tier workers and never share rows."""
    kv_bytes, rider_bytes = 2 * 4096, 3000
    page_bytes = kv_bytes + rider_bytes
    layout = BytePageLayout(page_bytes=page_bytes, kind=KIND)
    data = contents(16, page_bytes, seed=8)
    keys = [f"a{i}" for i in range(16)]

    def regions(d):
        return as_regions(d[:kv_bytes], [kv_bytes]) + as_regions(d[kv_bytes:], [rider_bytes],
                                                                 skew=64)

    with Tier(layout, config(tmp_path, capacity="64MiB"), device="cpu") as tier:
        puts = [tier.put_pages_async(keys[h::2], [regions(d) for d in data[h::2]])
                for h in (0, 1)]
        assert all(all(f.result()) for f in puts)
        outs = [[regions(torch.zeros(page_bytes, dtype=torch.uint8)) for _ in data[h::2]]
                for h in (0, 1)]
        gets = [tier.get_pages_async(keys[h::2], outs[h]) for h in (0, 1)]
        assert all(all(f.result()) for f in gets)
        for h in (0, 1):
            assert all(torch.equal(d, joined(o)) for d, o in zip(data[h::2], outs[h]))


def test_pages_written_either_way_read_either_way_after_restart(tmp_path):
    page_bytes = 3 * 4096 + 100
    layout = BytePageLayout(page_bytes=page_bytes, kind=KIND)
    data = contents(12, page_bytes, seed=3)
    keys = [f"r{i}" for i in range(12)]
    with Tier(layout, config(tmp_path), device="cpu") as tier:  # written in place
        assert all(tier.put_pages(keys[:6], [as_regions(d, [page_bytes]) for d in data[:6]]))
    with Tier(layout, config(tmp_path, in_place=False), device="cpu") as tier:  # staged
        assert tier.stats()["in_place"] == {"enabled": False,
                                            "reason": "off by config (in_place=false)"}
        assert all(tier.put_pages(keys[6:], [as_regions(d, [page_bytes]) for d in data[6:]]))
        out = [[host(page_bytes)] for _ in data]
        assert tier.get_pages(keys, out) == [True] * 12       # staged reads of both
        assert all(torch.equal(d, o[0]) for d, o in zip(data, out))
        assert tier.stats()["region_pages_read_staged"] == 12
    with Tier(layout, config(tmp_path), device="cpu") as tier:
        assert tier.stats()["recovered_pages"] == 12
        out = [[host(page_bytes)] for _ in data]
        assert tier.get_pages(keys, out) == [True] * 12       # in-place reads of both
        assert all(torch.equal(d, o[0]) for d, o in zip(data, out))
        assert tier.stats()["pages_read_in_place"] == 12


def test_header_scan_adopts_pages_written_in_place(tmp_path):
    page_bytes = 4096 + 50
    layout = BytePageLayout(page_bytes=page_bytes, kind=KIND)
    data = contents(5, page_bytes, seed=4)
    keys = [f"h{i}" for i in range(5)]
    with Tier(layout, config(tmp_path), device="cpu") as tier:
        assert all(tier.put_pages(keys, [as_regions(d, [page_bytes]) for d in data]))
    os.remove(tmp_path / "store" / "gdskv-journal.log")
    with Tier(layout, config(tmp_path), device="cpu") as tier:  # rebuilt from slot trailers
        out = [[host(page_bytes)] for _ in data]
        assert tier.get_pages(keys, out) == [True] * 5
        assert all(torch.equal(d, o[0]) for d, o in zip(data, out))


@pytest.mark.parametrize("where", ["first-block", "last-partial-block"])
def test_corrupted_slab_is_a_miss_never_wrong_bytes(tmp_path, where):
    page_bytes = 2 * 4096 + 300
    layout = BytePageLayout(page_bytes=page_bytes, kind=KIND)
    data = contents(6, page_bytes, seed=5)
    keys = [f"c{i}" for i in range(6)]
    with Tier(layout, config(tmp_path), device="cpu") as tier:
        assert all(tier.put_pages(keys, [as_regions(d, [page_bytes]) for d in data]))
        f, off = tier.store.location(tier.directory._index["c2"])
        off += 10 if where == "first-block" else page_bytes - 5
        fd = os.open(tier.store.files[f].path, os.O_RDWR)
        try:
            os.pwrite(fd, bytes([os.pread(fd, 1, off)[0] ^ 0x20]), off)
        finally:
            os.close(fd)
        out = [[host(page_bytes)] for _ in data]
        hits = tier.get_pages(keys, out)
        assert hits == [True, True, False, True, True, True]
        assert all(torch.equal(d, o[0]) for d, o, h in zip(data, out, hits) if h)
        s = tier.stats()
        assert s["corrupt_pages"] == 1 and s["pages_read_in_place"] == 6
        assert not tier.contains("c2")   # dropped: the next lookup is a plain miss


@pytest.mark.parametrize("page_bytes", [5000, 3 * 65536 + 100], ids=["pages-per-piece",
                                                                     "pieces-per-page"])
def test_posix_reads_hash_each_page_in_the_thread_that_read_it(tmp_path, monkeypatch,
                                                               page_bytes):
    # io_chunk_size 64 KiB: a piece holds several small pages, or a large page spans pieces
    with stored_pages(tmp_path, page_bytes, 12, 12, "h", capacity="64MiB",
                      staging_size="4MiB") as (tier, keys, data):
        late = []   # pages the caller had to hash after the reads (none: the readers did)
        real = tier._host_pages.hash_pages
        monkeypatch.setattr(tier._host_pages, "hash_pages",
                            lambda iovs: late.extend(iovs) or real(iovs))
        out = [[host(page_bytes)] for _ in data]
        assert all(tier.get_pages(keys, out))
        assert all(torch.equal(d, o[0]) for d, o in zip(data, out)) and not late
        # a page whose bytes changed on disk is caught by the reader's hash too
        f, off = tier.store.location(tier.directory._index["h4"])
        fd = os.open(tier.store.files[f].path, os.O_RDWR)
        try:
            os.pwrite(fd, bytes([os.pread(fd, 1, off + page_bytes - 1)[0] ^ 1]),
                      off + page_bytes - 1)
        finally:
            os.close(fd)
        hits = tier.get_pages(keys, [[host(page_bytes)] for _ in data])
        assert hits == [k != "h4" for k in keys] and not late


def test_injected_io_failure_fails_only_its_pages(tmp_path, monkeypatch):
    page_bytes = 4096
    layout = BytePageLayout(page_bytes=page_bytes, kind=KIND)
    data = contents(16, page_bytes, seed=6)
    keys = [f"f{i}" for i in range(16)]
    cfg = config(tmp_path, io_chunk_size=2 * layout.slot_bytes)  # 2-slot stripes over 2 files
    with Tier(layout, cfg, device="cpu") as tier:
        bad_fd = tier.store.files[1].fd
        in_file1 = [tier.store.location(s)[0] == 1 for s in range(16)]
        in_bad_file = lambda fd, offset: fd == bad_fd  # noqa: E731
        with monkeypatch.context() as m:
            fail_io(m, tier.backend, "write", in_bad_file)
            stored = tier.put_pages(keys, [as_regions(d, [page_bytes]) for d in data])
        # slots are handed out in order on an empty store: page i went to slot i
        assert stored == [not f1 for f1 in in_file1] and not all(stored)
        assert [tier.contains(k) for k in keys] == stored  # failed pages are not READY
        retry = [k for k, ok in zip(keys, stored) if not ok]
        assert all(tier.put_pages(retry, [as_regions(data[keys.index(k)], [page_bytes])
                                          for k in retry]))
        where = [tier.store.location(tier.directory._index[k])[0] == 1 for k in keys]
        with monkeypatch.context() as m:
            fail_io(m, tier.backend, "read", in_bad_file)
            out = [[host(page_bytes)] for _ in data]
            hits = tier.get_pages(keys, out)
        assert hits == [not w for w in where] and not all(hits)
        assert all(torch.equal(d, o[0]) for d, o, h in zip(data, out, hits) if h)
        # an EIO that outlasts the retries drops the pages (issue 46 #1): misses from now on
        assert [tier.contains(k) for k in keys] == hits
        s = tier.stats()
        assert s["write_failed"] == sum(in_file1) and s["read_failed"] == sum(where)
        assert s["unreadable_pages"] == sum(where) and s["corrupt_pages"] == 0


@pytest.mark.parametrize("sync", ["data", "none"])
def test_sync_policy_honored(tmp_path, monkeypatch, sync):
    layout = BytePageLayout(page_bytes=8192, kind=KIND)
    data = contents(4, 8192, seed=7)
    with Tier(layout, config(tmp_path, sync=sync), device="cpu") as tier:
        synced = []
        real = tier.store.sync
        monkeypatch.setattr(tier.store, "sync", lambda files: (synced.append(set(files)),
                                                                real(files)))
        assert all(tier.put_pages([f"s{i}" for i in range(4)],
                                  [as_regions(d, [8192]) for d in data]))
        assert tier.stats()["pages_written_in_place"] == 4
        if sync == "data":
            files = {tier.store.location(s)[0] for _, s, _ in tier.directory.ready_items()}
            assert synced and set().union(*synced) == files  # each file the pages went to
        else:
            assert not synced


def test_many_small_pages_beyond_iov_max(tmp_path):
    # 4 KiB pages in 8 KiB slots, one thread and 16 MiB pieces: one piece holds 2048 pages,
    # 4096 buffers, more than one pwritev/preadv takes
    layout = BytePageLayout(page_bytes=4096, kind=KIND)
    n = 2048
    assert 2 * n > IOV_MAX
    data = torch.randint(0, 256, (n * 4096,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(8))
    cfg = config(tmp_path, capacity=n * layout.slot_bytes, files_per_dir=1, io_threads=1,
                 io_chunk_size="16MiB", staging_size=f"{n * layout.slot_bytes * 4}")
    src = host(n * 4096)
    src.copy_(data)
    dst = host(n * 4096)
    keys = [f"p{i}" for i in range(n)]
    with Tier(layout, cfg, device="cpu") as tier:
        assert all(tier.put_pages(keys, [[src[i * 4096:(i + 1) * 4096]] for i in range(n)]))
        assert all(tier.get_pages(keys, [[dst[i * 4096:(i + 1) * 4096]] for i in range(n)]))
        assert torch.equal(src, dst)
        assert tier.stats()["pages_read_in_place"] == n


def test_parallel_checksums_match_one_shot(tmp_path):
    # a call over PARALLEL_HASH_BYTES hashes its pages on several threads
    page_bytes = 1 << 20
    with stored_pages(tmp_path, page_bytes, 8, 9, "b", capacity="32MiB",
                      staging_size="16MiB") as (tier, keys, data):
        sums = stored_sums(tier)
        assert all(sums[k] == crc32c.crc32c(d.numpy()) for k, d in zip(keys, data))
        out = [[host(page_bytes)] for _ in data]
        assert all(tier.get_pages(keys, out))
        assert all(torch.equal(d, o[0]) for d, o in zip(data, out))


@pytest.mark.parametrize("pages", [1, 2, 5, 9])
def test_hash_tasks_cover_every_page_once(pages):
    # tasks of PARALLEL_HASH_BYTES or more, the first on the caller: uneven groups included
    page = 3 * PARALLEL_HASH_BYTES // 4
    raw = np.random.default_rng(pages).integers(0, 256, pages * page, dtype=np.uint8)
    iovs = [(raw[k * page:k * page + 1000], raw[k * page + 1000:(k + 1) * page])
            for k in range(pages)]
    path = HostPagePath(BytePageLayout(page_bytes=page, kind=KIND), "", False, threads=4)
    try:
        sums = path.hash_pages(iovs)
    finally:
        path.close()
    assert list(sums) == [crc32c.crc32c(raw[k * page:(k + 1) * page]) for k in range(pages)]


def test_vector_io_goes_on_after_partial_transfers(tmp_path, monkeypatch, data_path):
    path = str(tmp_path / "f.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    engine = native.engine()
    try:
        f = SlabFile(0, path, fd, False, 0)
        parts = [np.full(n, v, dtype=np.uint8) for n, v in ((1000, 1), (3000, 2), (10, 3))]
        if data_path == "python":  # a pwritev that moves at most 700 bytes of its first buffer
            real = os.pwritev
            monkeypatch.setattr(os, "pwritev",
                                lambda fd, bufs, off: real(fd, [memoryview(bufs[0])[:700]], off))
        assert _vector_io(engine, "write", f, parts, 5) == (4010, None)
        monkeypatch.undo()
        assert os.pread(fd, 4010, 5) == b"\1" * 1000 + b"\2" * 3000 + b"\3" * 10
        back = [np.zeros(4000, dtype=np.uint8), np.zeros(10, dtype=np.uint8)]
        assert _vector_io(engine, "read", f, back, 5) == (4010, None)
        assert bytes(back[1]) == b"\3" * 10
        # past the end of the file: the first preadv moves 15 bytes, the next none
        with pytest.raises(OSError, match="short read") as err:
            _vector_io(engine, "read", f, [np.zeros(100, dtype=np.uint8)], 4000)
        assert err.value.actual == 15 and err.value.expected == 100
    finally:
        os.close(fd)


@NEEDS_NIXL
def test_nixl_keeps_staging_and_says_why(tmp_path):
    layout = BytePageLayout(page_bytes=8192, kind=KIND)
    data = contents(3, 8192, seed=11)
    with Tier(layout, config(tmp_path, backend="nixl"), device="cpu") as tier:
        info = tier.stats()["in_place"]
        assert not info["enabled"] and "backend nixl" in info["reason"]
        keys = ["n0", "n1", "n2"]
        assert all(tier.put_pages(keys, [as_regions(d, [8192]) for d in data]))
        out = [[host(8192)] for _ in data]
        assert all(tier.get_pages(keys, out))
        assert all(torch.equal(d, o[0]) for d, o in zip(data, out))
        assert tier.stats()["region_pages_read_staged"] == 3


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="kvikio does I/O only with the CUDA driver (none here)")
def test_kvikio_moves_host_regions_in_place(tmp_path):
    pytest.importorskip("kvikio", reason="kvikio (the gpu extra) is not installed")
    page_bytes = 3 * 4096 + 100
    layout = BytePageLayout(page_bytes=page_bytes, kind=KIND)
    data = contents(10, page_bytes, seed=12)
    keys = [f"g{i}" for i in range(10)]
    with Tier(layout, config(tmp_path, backend="kvikio"), device="cpu") as tier:
        assert tier.stats()["in_place"]["enabled"]
        assert all(tier.put_pages(keys, [as_regions(d, [page_bytes]) for d in data]))
        out = [[host(page_bytes)] for _ in data]
        assert all(tier.get_pages(keys, out))
        assert all(torch.equal(d, o[0]) for d, o in zip(data, out))
        s = tier.stats()
        assert s["pages_written_in_place"] == 10 and s["pages_read_in_place"] == 10


def test_scratch_rows_are_pinned_where_cuda_is_usable_and_kept_per_thread(monkeypatch):
    """A thread's scratch rows come from the tier's host allocator with its default pinning
    (pinned where CUDA is usable: an O_DIRECT read into pageable memory is slower, and the
    indexer's bytes go through these rows), are made once and reused by the next call, and
    are the thread's own."""
    import threading

    import gdskv.host_pages as host_pages

    calls = []

    def recording_alloc(nbytes, **kwargs):
        calls.append(kwargs)
        return alloc_host(nbytes, **kwargs)

    monkeypatch.setattr(host_pages, "alloc_host", recording_alloc)
    path = HostPagePath(BytePageLayout(page_bytes=8192, kind=KIND), "", True, 2)
    first = path.scratch(3 * 4096)
    assert path.scratch(2 * 4096).ctypes.data == first.ctypes.data  # kept, not remade
    assert len(calls) == 1 and calls[0].get("pin") is None  # the allocator's default pinning
    if HAS_CUDA:
        assert torch.from_numpy(first).is_pinned()
    other = []
    t = threading.Thread(target=lambda: other.append(path.scratch(4096).ctypes.data))
    t.start()
    t.join()
    assert len(calls) == 2 and other[0] != first.ctypes.data  # another thread: rows of its own
