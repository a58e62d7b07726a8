"""Opaque byte pages (BytePageLayout): the tier stores them as it stores KV pages (slots, checksum,
journal, eviction, followers) but moves them only as byte regions. Runs on every backend."""

from __future__ import annotations

import pytest
import torch

from gdskv.layout import BytePageLayout, KVLayout
from gdskv.memory import alloc_host
from gdskv.store import StoreMismatchError
from gdskv.tier import Tier

KIND = "test/state"


def random_pages(n: int, page_bytes: int, seed: int, device="cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (page_bytes,), dtype=torch.uint8, generator=g).to(device)
            for _ in range(n)]


def split_regions(page: torch.Tensor, cuts: list[int]) -> list[torch.Tensor]:
    """A page as several regions (as an engine pool hands a page's components)."""
    edges = [0] + [c for c in cuts if 0 < c < page.numel()] + [page.numel()]
    return [page[a:b] for a, b in zip(edges, edges[1:]) if b > a]


@pytest.mark.parametrize("page_bytes", [1, 4095, 4096, 4097, 10_000])
def test_round_trip_bit_exact_in_regions(page_bytes, make_config, device):
    layout = BytePageLayout(page_bytes=page_bytes, kind=KIND, model_name="m")
    pages = random_pages(11, page_bytes, seed=page_bytes, device=device)
    keys = [f"k{i}" for i in range(len(pages))]
    # a few pages per staging part: the batch goes through in several chunks
    config = make_config(staging_size=max(4 * 3 * layout.slot_bytes, 8192))
    with Tier(layout, config, device=device) as tier:
        written = [split_regions(p, [1, page_bytes // 3, page_bytes - 5]) for p in pages]
        assert tier.put_pages(keys, written) == [True] * len(keys)
        assert tier.match_prefix(keys) == len(keys)
        out = [torch.zeros_like(p) for p in pages]
        # read back into a different split of the same bytes
        assert tier.get_pages(keys, [split_regions(o, [page_bytes // 2]) for o in out]) == \
            [True] * len(keys)
        for a, b in zip(pages, out):
            assert torch.equal(a.cpu(), b.cpu())
        s = tier.stats()
        assert s["page_bytes"] == page_bytes and s["slot_bytes"] % 4096 == 0
        assert s["fingerprint"] == layout.fingerprint


def test_restart_finds_pages_again(make_config, device):
    layout = BytePageLayout(page_bytes=5000, kind=KIND)
    pages = random_pages(6, 5000, seed=3, device=device)
    keys = [f"k{i}" for i in range(6)]
    with Tier(layout, make_config(), device=device) as tier:
        assert all(tier.put_pages(keys, [[p] for p in pages]))
    with Tier(layout, make_config(), device=device) as tier:
        out = [torch.zeros_like(p) for p in pages]
        assert tier.get_pages(keys, [[o] for o in out]) == [True] * 6
        assert all(torch.equal(a, b) for a, b in zip(pages, out))
        assert tier.stats()["recovered_pages"] == 6


@pytest.mark.parametrize("in_place", [False, True], ids=["staged", "in-place"])
def test_corrupt_page_is_a_miss(make_config, device, in_place):
    if in_place and device.type == "cuda":
        pytest.skip("host regions move in place only on a CPU tier")
    layout = BytePageLayout(page_bytes=3000, kind=KIND)
    config = make_config(files_per_dir=1, in_place=in_place)
    pages = random_pages(2, 3000, seed=4, device=device)
    with Tier(layout, config, device=device) as tier:
        if in_place and not tier.backend.in_place_host_memory:
            pytest.skip(f"the {tier.backend.name} backend moves no host region in place")
        assert all(tier.put_pages(["a", "b"], [[p] for p in pages]))
        slot = tier.directory.pin(["a"])[0][0]
        tier.directory.unpin([slot])
        f, off = tier.store.location(slot)
        path = tier.store.files[f].path
    with open(path, "r+b") as fh:  # flip one payload byte of page "a"
        fh.seek(off + 1234)
        b = fh.read(1)
        fh.seek(off + 1234)
        fh.write(bytes([b[0] ^ 0x40]))
    with Tier(layout, config, device=device) as tier:
        if in_place:  # 4 KiB-aligned regions, which the tier reads straight into
            out = [alloc_host(4096, pin=False)[:3000].fill_(7) for _ in range(2)]
        else:
            out = [torch.full((3000,), 7, dtype=torch.uint8, device=device) for _ in range(2)]
        assert tier.get_pages(["a", "b"], [[o] for o in out]) == [False, True]
        assert torch.equal(out[1], pages[1])
        if in_place:  # a page that fails its checksum leaves undefined bytes, as a miss may
            assert tier.stats()["pages_read_in_place"] == 2
        else:  # through staging, a failed page is never scattered
            assert bool((out[0] == 7).all()), "a failed page must leave the target untouched"
        assert tier.stats()["corrupt_pages"] == 1 and not tier.contains("a")


def test_eviction_at_capacity_keeps_newest(make_config, device):
    layout = BytePageLayout(page_bytes=4096, kind=KIND)
    config = make_config(capacity=8 * layout.slot_bytes, io_chunk_size=layout.slot_bytes,
                         files_per_dir=1)
    pages = random_pages(12, 4096, seed=5, device=device)
    keys = [f"k{i}" for i in range(12)]
    with Tier(layout, config, device=device) as tier:
        for i in range(12):  # one at a time: LRU order is put order
            assert tier.put_pages([keys[i]], [[pages[i]]]) == [True]
        present = [tier.contains(k) for k in keys]
        assert present == [False] * 4 + [True] * 8
        out = [torch.zeros_like(p) for p in pages]
        res = tier.get_pages(keys, [[o] for o in out])
        assert res == present
        for i in range(4, 12):
            assert torch.equal(out[i], pages[i])


def test_store_of_another_kind_or_size_is_refused(make_config):
    layout = BytePageLayout(page_bytes=4000, kind=KIND, model_name="m", tp_rank=0, tp_size=2)
    with Tier(layout, make_config(), device="cpu") as tier:
        assert tier.put_pages(["a"], [random_pages(1, 4000, 6)]) == [True]
    for other in (layout.replace(kind="test/other"), layout.replace(page_bytes=4001),
                  layout.replace(tp_rank=1), layout.replace(model_name="n"),
                  # same slot size, but KV pages: never read as these bytes
                  KVLayout(num_layers=1, page_size=1, head_dim=2000, dtype="fp16")):
        with pytest.raises(StoreMismatchError, match="written for layout"):
            Tier(other, make_config(), device="cpu")


def test_pool_calls_are_refused_with_the_way_out(make_config):
    layout = BytePageLayout(page_bytes=64, kind=KIND)
    with Tier(layout, make_config(), device="cpu") as tier:
        with pytest.raises(TypeError, match="put_pages / get_pages"):
            tier.put(["a"], torch.zeros(1, 4, 1, 16), torch.arange(1))
        with pytest.raises(TypeError, match="put_pages / get_pages"):
            tier.get_async(["a"], torch.zeros(1, 4, 1, 16), torch.arange(1))
        with pytest.raises(ValueError, match="regions hold 63 B, a page is 64 B"):
            tier.put_pages(["a"], [[torch.zeros(63, dtype=torch.uint8)]])
        assert not tier.contains("a")


@pytest.mark.parametrize("kwargs, match", [
    (dict(page_bytes=0), "page_bytes"), (dict(page_bytes=True), "page_bytes"),
    (dict(kind=""), "kind"), (dict(kind="a|b"), "kind"), (dict(kind=3), "kind"),
    (dict(tp_rank=2, tp_size=2), "tp_rank"), (dict(pp_size=0), "pp_size"),
    (dict(model_name="x\ny"), "model_name"),
])
def test_byte_layout_rejects_bad_values(kwargs, match):
    base = dict(page_bytes=128, kind=KIND)
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        BytePageLayout(**base)


def test_fingerprint_names_everything():
    a = BytePageLayout(page_bytes=100, kind=KIND, model_name="m", tp_rank=1, tp_size=2)
    others = [a.replace(page_bytes=101), a.replace(kind="x"), a.replace(model_name="n"),
              a.replace(tp_rank=0), a.replace(pp_size=2)]
    assert len({o.fingerprint for o in others} | {a.fingerprint}) == len(others) + 1


def test_read_only_follower_reads_a_byte_store(make_config):
    layout = BytePageLayout(page_bytes=2000, kind=KIND)
    pages = random_pages(3, 2000, seed=7)
    keys = ["a", "b", "c"]
    with Tier(layout, make_config(), device="cpu") as writer:
        assert all(writer.put_pages(keys[:2], [[p] for p in pages[:2]]))
        with Tier(layout, make_config(read_only=True), device="cpu") as follower:
            assert follower.put_pages(["c"], [[pages[2]]]) == [False]
            assert writer.put_pages(["c"], [[pages[2]]]) == [True]
            follower.refresh()
            out = [torch.zeros(2000, dtype=torch.uint8) for _ in keys]
            assert follower.get_pages(keys, [[o] for o in out]) == [True] * 3
            assert all(torch.equal(a, b) for a, b in zip(pages, out))


def test_async_page_calls_round_trip(make_config, device):
    """put_pages_async / get_pages_async: futures of the same per-page results; a bad region
    raises in the caller at once, before anything is queued."""
    layout = BytePageLayout(page_bytes=6000, kind=KIND)
    pages = random_pages(5, 6000, seed=9, device=device)
    keys = [f"a{i}" for i in range(5)]
    with Tier(layout, make_config(), device=device) as tier:
        assert tier.put_pages_async(keys, [[p] for p in pages]).result() == [True] * 5
        out = [torch.zeros_like(p) for p in pages]
        assert tier.get_pages_async(keys + ["absent"], [[o] for o in out] +
                                    [[torch.zeros_like(pages[0])]]).result() == [True] * 5 + [False]
        assert all(torch.equal(a, b) for a, b in zip(pages, out))
        with pytest.raises(ValueError, match="regions hold 5999 B, a page is 6000 B"):
            tier.put_pages_async(["x"], [[pages[0][:5999]]])


def test_pinned_page_survives_lru_and_evict_until_unpinned(make_config, device):
    layout = BytePageLayout(page_bytes=4096, kind=KIND)
    config = make_config(capacity=4 * layout.slot_bytes, io_chunk_size=layout.slot_bytes,
                         files_per_dir=1)
    with Tier(layout, config, device=device) as tier:
        pages = random_pages(8, 4096, seed=4, device=device)
        assert all(tier.put_pages([f"p{i}" for i in range(4)], [[p] for p in pages[:4]]))
        handles = tier.pin(["p0", "missing"])
        assert handles[0] is not None and handles[1] is None
        # LRU must make room from the unpinned pages only
        assert all(tier.put_pages([f"p{i}" for i in range(4, 7)], [[p] for p in pages[4:7]]))
        assert tier.contains("p0")
        tier.evict(["p0"])  # asked to go while pinned: goes at the unpin
        tier.unpin([handles[0]])
        assert not tier.contains("p0")
        assert tier.put_pages(["p7"], [[pages[7]]]) == [True]
