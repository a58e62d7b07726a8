"""Corruption: bit flips in slab payloads are misses (never wrong bytes), dropped and counted;
a damaged journal record (torn tail or middle) is skipped or cut, and the header scan it sets
off brings its page back from the slot trailer; neither ever serves wrong data."""

from __future__ import annotations

import os
import random

import pytest
import torch

from gdskv.journal import decode_all
from gdskv.store import JOURNAL
from gdskv.tier import Tier
from reliability_helpers import (LAYOUT, PAGE, SLOT, check_pages, page_content, put, ready_keys,
                                 slot_location, small_config)


def _flip(path: str, offset: int, bit: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ (1 << bit)]), offset)
    finally:
        os.close(fd)


@pytest.mark.parametrize("live", [False, True], ids=["reopened", "live"])
def test_payload_bit_flips_are_misses(tmp_path, live):
    """550 payload flips per variant (1100 in all): flipped pages miss, are dropped and counted;
    the untouched pages still read back exact; nothing wrong is ever returned."""
    rng = random.Random(3 if live else 4)
    cfg = small_config(tmp_path)
    keys = [f"c{i}" for i in range(48)]
    tier = Tier(LAYOUT, cfg, device="cpu")
    assert all(put(tier, keys))
    runs, flips, detected, corrupt_counted = 50, 0, 0, 0
    for _ in range(runs):
        where = {k: slot_location(tier, k) for k in keys}
        if not live:
            tier.close()
        victims = rng.sample(keys, 10)
        for n, k in enumerate(victims):
            path, off = where[k]
            for _ in range(2 if n == 0 else 1):  # one page with two flips, the others one
                _flip(path, off + rng.randrange(PAGE), rng.randrange(8))
                flips += 1
        for k in rng.sample(keys, 5):  # slot padding is not part of the page: no effect
            path, off = where[k]
            _flip(path, off + PAGE + rng.randrange(SLOT - PAGE), rng.randrange(8))
        if not live:
            tier = Tier(LAYOUT, cfg, device="cpu")
        before = tier.stats().get("corrupt_pages", 0)
        res = check_pages(tier, keys)
        assert not res["wrong"], f"wrong bytes served for {res['wrong']}"
        assert set(res["missed"]) == set(victims), (res["missed"], victims)
        detected += len(res["missed"])
        corrupt_counted += tier.stats()["corrupt_pages"] - before
        for k in victims:
            assert not tier.contains(k), f"corrupt page {k} still in the directory"
        assert all(put(tier, victims))  # re-spill them for the next run
    ready = set(ready_keys(tier))
    tier.close()
    with Tier(LAYOUT, cfg, device="cpu") as again:  # drops and re-puts were journaled
        assert set(ready_keys(again)) == ready == set(keys)
        assert not check_pages(again, keys)["missed"]
    print(f"live={live} flips={flips} pages_flipped={runs * 10} detected={detected} "
          f"counted={corrupt_counted}")
    assert flips == runs * 11 and detected == corrupt_counted == runs * 10


def _journal(tmp_path) -> str:
    return os.path.join(str(tmp_path), JOURNAL)


def _records(path: str):
    with open(path, "rb") as f:
        data = f.read()
    recs, valid, _ = decode_all(data)
    assert valid == len(data)
    offsets, pos = [], 0
    for r in recs:  # record boundaries, for cutting and flipping inside one record
        offsets.append(pos)
        pos += 8 + int.from_bytes(data[pos:pos + 4], "little")
    return recs, offsets, len(data)


@pytest.mark.parametrize("damage", ["torn", "flipped"])
def test_journal_tail_damage(tmp_path, damage):
    """A torn or flipped last record: cut at open; the header scan it sets off still finds that
    page (its bytes and slot trailer were on disk), so nothing is lost."""
    cfg = small_config(tmp_path)
    keys = [f"j{i}" for i in range(12)]
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        for k in keys:
            assert put(tier, [k]) == [True]  # one COMMIT record per key
    path = _journal(tmp_path)
    recs, offsets, size = _records(path)
    assert [r.key for r in recs] == keys
    last = offsets[-1]
    if damage == "torn":
        os.truncate(path, random.Random(1).randrange(last + 1, size))
    else:
        _flip(path, random.Random(2).randrange(last, size), 0)
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        assert set(ready_keys(tier)) == set(keys)
        assert tier.stats()["header_scan_pages"] == 1  # the last page, from its trailer
        res = check_pages(tier, keys)
        assert not res["wrong"] and not res["missed"]
        assert len(_records(path)[0]) == len(keys)  # rewritten whole: no bad tail left
        assert put(tier, ["after"]) == [True]  # ... so records appended now are reachable
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        assert set(ready_keys(tier)) == set(keys) | {"after"}
        assert not check_pages(tier, keys + ["after"])["missed"]


def test_journal_middle_corruption(tmp_path):
    """A bad record in the middle: replay skips it and keeps every intact record after it; the
    header scan the damage sets off brings that record's page back from its slot trailer; the
    damage is written away. Pages whose EVICT record was lost may come back in slots reused
    since: they read back exact or miss, never wrong."""
    cfg = small_config(tmp_path, capacity=16 * SLOT)
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        first = [f"a{i}" for i in range(16)]
        assert all(put(tier, first))
        later = [f"b{i}" for i in range(12)]
        for i in range(0, 12, 4):  # store full: LRU evicts a* pages, their slots are reused
            assert all(put(tier, later[i:i + 4]))
    path = _journal(tmp_path)
    recs, offsets, _ = _records(path)
    cut = next(i for i, r in enumerate(recs) if r.key == "b4")
    _flip(path, offsets[cut] + 12, 3)  # inside the record body: crc mismatch
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        ready = ready_keys(tier)
        assert set(later) <= set(ready)  # b4 too: from its trailer
        res = check_pages(tier, first + later)
        assert not res["wrong"], res["wrong"]
        assert set(k for k in first + later if k not in res["missed"]) <= set(ready)
        assert not set(res["missed"]) & set(later)
        recs_now, _, _ = _records(path)  # rewritten: nothing damaged left to skip
        assert len(recs_now) == len(ready)
        assert put(tier, ["after"]) == [True]
    with Tier(LAYOUT, cfg, device="cpu") as tier:  # appends after the rewrite are reachable
        assert tier.contains("after") and not check_pages(tier, ["after"])["missed"]
        assert set(later) <= set(ready_keys(tier))


@pytest.mark.parametrize("where", ["length", "crc", "kind", "key"])
def test_decode_skips_one_damaged_record(where):
    """decode_all: a record damaged in any field is skipped, the ones after it kept; damage
    with nothing intact after it is the torn tail."""
    from gdskv.journal import Record, RecordKind, encode
    recs = [Record(RecordKind.COMMIT, n + 1, n, 1000 + n, 1, f"key-{n}") for n in range(20)]
    blobs = [encode(r) for r in recs]
    data = bytearray(b"".join(blobs))
    start = sum(len(b) for b in blobs[:7])
    field = {"length": 1, "crc": 5, "kind": 8, "key": len(blobs[7]) - 2}[where]
    data[start + field] ^= 0x10
    got, valid, skipped = decode_all(bytes(data))
    assert [r.key for r in got] == [r.key for r in recs if r.seq != 8]
    assert valid == len(data) and skipped == [(start, start + len(blobs[7]))]
    got, valid, skipped = decode_all(bytes(data[:start + 5]))  # torn inside record 7
    assert len(got) == 7 and valid == start and skipped == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_staging_bit_flips_are_misses(tmp_path):
    """Same guarantee with staging on the GPU (whatever backend auto picks there)."""
    keys = [f"g{i}" for i in range(32)]
    rng = random.Random(5)
    with Tier(LAYOUT, small_config(tmp_path), device="cuda") as tier:
        assert all(tier.put_pages(keys, [[page_content(k).cuda()] for k in keys]))
        victims = rng.sample(keys, 8)
        for k in victims:
            path, off = slot_location(tier, k)
            _flip(path, off + rng.randrange(PAGE), rng.randrange(8))
        out = [torch.zeros(PAGE, dtype=torch.uint8, device="cuda") for _ in keys]
        hits = tier.get_pages(keys, [[o] for o in out])
        torch.cuda.synchronize()
        for k, hit, o in zip(keys, hits, out):
            assert not hit or torch.equal(o.cpu(), page_content(k)), f"wrong bytes for {k}"
        assert {k for k, hit in zip(keys, hits) if not hit} == set(victims)
        assert tier.stats()["corrupt_pages"] == len(victims)


def _gpu_pool(num_slots: int, fill: int | None, seed: int = 0):
    """A stacked K/V pool of LAYOUT on the GPU: random bytes, or every byte ``fill``."""
    shape = (LAYOUT.num_layers, num_slots, LAYOUT.kv_heads, LAYOUT.head_dim)
    nbytes = torch.Size(shape).numel() * LAYOUT.torch_dtype.itemsize
    gen = torch.Generator().manual_seed(seed)
    parts = []
    for _ in range(2):
        raw = (torch.full((nbytes,), fill, dtype=torch.uint8) if fill is not None else
               torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen))
        parts.append(raw.view(LAYOUT.torch_dtype).view(shape).cuda())
    return tuple(parts)


def _page_rows(pool, slots: torch.Tensor) -> list[torch.Tensor]:
    return [p[:, slots.long()].cpu() for p in pool]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_pool_restore_bit_flips_are_misses(tmp_path):
    """Restores into a GPU KV pool verify on the GPU (the verifying scatter, one flag read-back
    per call): a flipped page is a miss and its destination slots keep their bytes; pages
    written with the host checksum (a CPU tier) take the plain path in the same call; nothing
    wrong reaches the pool."""
    ps, n = LAYOUT.page_size, 24
    keys = [f"v{i}" for i in range(n)]
    src = _gpu_pool(n * ps, None, seed=9)
    src_slots = torch.randperm(n * ps, generator=torch.Generator().manual_seed(1))
    cfg = small_config(tmp_path)
    with Tier(LAYOUT, cfg, device="cpu") as cpu_tier:  # the first 8 pages: CRC-32C checksums
        host = tuple(p.cpu() for p in src)
        assert all(cpu_tier.put(keys[:8], host, src_slots[:8 * ps]))
    rng = random.Random(6)
    with Tier(LAYOUT, cfg, device="cuda") as tier:
        assert all(tier.put(keys[8:], src, src_slots[8 * ps:].cuda()))
        victims = set(rng.sample(keys[8:], 5)) | {keys[2]}
        for k in victims:
            path, off = slot_location(tier, k)
            _flip(path, off + rng.randrange(PAGE), rng.randrange(8))
        dst = _gpu_pool(n * ps + 8, 0xAB)
        dst_slots = torch.randperm(n * ps + 8, generator=torch.Generator().manual_seed(2))[
            :n * ps].cuda()
        hits = tier.get(keys, dst, dst_slots)
        torch.cuda.synchronize()
        assert {k for k, hit in zip(keys, hits) if not hit} == victims
        for i, (k, hit) in enumerate(zip(keys, hits)):
            got = _page_rows(dst, dst_slots[i * ps:(i + 1) * ps])
            if hit:
                want = _page_rows(src, src_slots[i * ps:(i + 1) * ps])
                assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                           for a, b in zip(got, want)), f"wrong bytes for {k}"
            else:  # untouched: still the 0xAB fill
                assert all((g.view(torch.uint8) == 0xAB).all() for g in got), f"{k} was written"
        assert tier.stats()["corrupt_pages"] == len(victims)
        assert not any(tier.contains(k) for k in victims)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_restore_replayed_from_a_graph_is_exact_and_still_misses_flips(tmp_path, graphs):
    """A restore shape seen before replays its verify + scatter launches from a CUDA graph
    (gdskv.launch_graphs): each replay restores into that call's own slots, bit-exact, and a
    page flipped on disk after the graph was captured is still a miss whose slots keep their
    bytes. With launch_graphs off nothing is captured and the results are the same."""
    ps, n = LAYOUT.page_size, 6
    keys = [f"g{i}" for i in range(n)]
    src = _gpu_pool(n * ps, None, seed=4)
    src_slots = torch.randperm(n * ps, generator=torch.Generator().manual_seed(3)).cuda()
    cfg = small_config(tmp_path, launch_graphs=graphs)
    with Tier(LAYOUT, cfg, device="cuda") as tier:
        assert all(tier.put(keys, src, src_slots))
        dst = _gpu_pool(4 * ps, 0xAB)
        gen = torch.Generator().manual_seed(5)

        def restore(two: list[str]) -> tuple[list[bool], torch.Tensor]:
            # fresh destination slots every call: a replay must use this call's indices
            dst_slots = torch.randperm(4 * ps, generator=gen)[:2 * ps]
            for p in dst:
                p.view(torch.uint8)[:, dst_slots.cuda()] = 0xAB
            hits = tier.get(two, dst, dst_slots)
            torch.cuda.synchronize()
            return hits, dst_slots

        # Staging parts rotate, and each part's launches are a key of their own: three rounds
        # per part are plain, capture (and replay), replay; other pages each round.
        for rnd in range(3 * len(tier._staging)):
            two = [keys[(2 * rnd) % n], keys[(2 * rnd + 1) % n]]
            hits, dst_slots = restore(two)
            assert hits == [True, True]
            for j, k in enumerate(two):
                i = keys.index(k)
                got = _page_rows(dst, dst_slots[j * ps:(j + 1) * ps])
                want = _page_rows(src, src_slots[i * ps:(i + 1) * ps].cpu())
                assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                           for a, b in zip(got, want)), f"round {rnd}: wrong bytes for {k}"
        graph_set = tier._per_thread.buffers.graphs
        assert (graph_set.captures >= 1 and graph_set.replays > graph_set.captures) if graphs \
            else (graph_set.captures == 0 and graph_set.replays == 0)
        replays = graph_set.replays
        path, off = slot_location(tier, keys[1])
        _flip(path, off + PAGE // 3, 5)
        hits, dst_slots = restore([keys[0], keys[1]])
        assert hits == [True, False]
        assert graph_set.replays == (replays + 1 if graphs else 0)
        got = _page_rows(dst, dst_slots[ps:2 * ps])
        assert all((g.view(torch.uint8) == 0xAB).all() for g in got), "a flipped page was written"
        want = _page_rows(src, src_slots[:ps].cpu())
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                   for a, b in zip(_page_rows(dst, dst_slots[:ps]), want))
        assert tier.stats()["corrupt_pages"] == 1
