"""The staging parts: whole parts for chunked calls, small parts split off them for calls of a
few pages (gdskv.staging), and a tier whose 1-page calls from more threads than parts overlap."""

from __future__ import annotations

import threading

import pytest
import torch

from gdskv.config import TierConfig
from gdskv.layout import BytePageLayout
from gdskv.staging import SPLITS, StagingParts
from gdskv.tier import Tier

SLOT = 4096


def _parts(depth: int = 2, slots: int = 32) -> StagingParts:
    return StagingParts(slots * SLOT, depth, torch.device("cpu"), slot_bytes=SLOT)


def test_small_parts_are_slices_of_one_whole_part_and_disjoint():
    st = _parts(depth=2, slots=32)
    assert st.splits == SPLITS and st.small_pages == 32 // SPLITS
    taken = [st.try_take(pages=1) for _ in range(SPLITS)]
    assert None not in taken and len(set(taken)) == SPLITS
    spans = sorted((st[i].data_ptr(), st[i].numel()) for i in taken)
    whole = st.parts[0] if spans[0][0] == st.parts[0].data_ptr() else st.parts[1]
    assert spans[0][0] == whole.data_ptr()
    for (a, n), (b, _) in zip(spans, spans[1:]):
        assert n == st.small_pages * SLOT and a + n == b  # tiling the whole part, no overlap
    # one whole part is split; the other is still free for a chunked call
    other = st.try_take(pages=st.small_pages + 1)
    assert other is not None and st[other].data_ptr() != whole.data_ptr()
    assert st.try_take(pages=100) is None
    for i in taken:
        st.give_back(i)
    st.give_back(other)
    assert st.all_free()  # the split part joined again


def test_more_small_calls_in_flight_than_whole_parts():
    """A 1-page call takes a small part: with 2 whole parts, 2 x SPLITS calls fit at once
    (with whole parts only, 2 would)."""
    st = _parts(depth=2, slots=32)
    taken = [st.try_take(pages=1) for _ in range(2 * SPLITS)]
    assert None not in taken and len(set(taken)) == 2 * SPLITS
    assert st.try_take(pages=1) is None
    st.give_back(taken[0])
    assert st.try_take(pages=1) == taken[0]  # (last given back, first taken)


def test_a_waiting_whole_taker_is_not_starved_by_small_calls():
    st = _parts(depth=1, slots=32)
    small = st.try_take(pages=1)
    got = []
    waiter = threading.Thread(target=lambda: got.append(st.take(pages=32)))
    waiter.start()
    while not st._whole_waiting:  # the chunked call waits for the split part
        threading.Event().wait(0.001)
    assert st.try_take(pages=1) is None  # no new small part while it waits
    st.give_back(small)
    waiter.join(5)
    assert got == [0]
    st.give_back(0)
    assert st.all_free()


def test_parts_that_hold_few_slots_split_into_single_slots_or_not_at_all():
    assert _parts(slots=4).small_pages == 1 and _parts(slots=4).splits == 4
    one = _parts(slots=1)
    assert one.small_pages == 0 and one.try_take(pages=1) in (0, 1)  # whole parts only
    assert StagingParts(32 * SLOT, 2, torch.device("cpu")).small_pages == 0


@pytest.mark.parametrize("op", ["put", "get"])
def test_one_page_calls_from_more_threads_than_parts_are_in_flight_together(tmp_path, op):
    """Three 1-page calls through staging (in_place off) on a tier with 2 whole parts: all
    three are in their I/O at once (a barrier of 3 inside the backend's I/O passes; with a
    whole part per call the third would wait for a part and the barrier break), and every
    page comes back bit-exact."""
    lay = BytePageLayout(page_bytes=3 * SLOT - 100, kind="test/staging")
    cfg = TierConfig(directories=(str(tmp_path),), capacity=f"{64 * lay.slot_bytes}",
                     staging_size=f"{32 * lay.slot_bytes}", pipeline_depth=2, in_place=False)
    pages = [torch.randint(0, 256, (lay.page_bytes,), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(t)) for t in range(3)]
    with Tier(lay, cfg, device="cpu") as tier:
        if op == "get":
            assert tier.put_pages([f"k{t}" for t in range(3)], [[p] for p in pages]) == [True] * 3
        together = threading.Barrier(3, timeout=10)
        start = tier.backend.start

        def start_together(kind, buffer, extents, on_caller=False):
            if kind == ("write" if op == "put" else "read"):
                together.wait()  # BrokenBarrierError unless all three calls are in I/O
            return start(kind, buffer, extents, on_caller)
        tier.backend.start = start_together
        outs = [torch.zeros_like(p) for p in pages]
        results, errors = {}, []

        def call(t: int) -> None:
            try:
                results[t] = tier.put_pages([f"k{t}"], [[pages[t]]]) if op == "put" \
                    else tier.get_pages([f"k{t}"], [[outs[t]]])
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=call, args=(t,)) for t in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        assert not errors and results == {0: [True], 1: [True], 2: [True]}
        tier.backend.start = start
        assert tier._staging.all_free()
        if op == "put":
            assert tier.get_pages([f"k{t}" for t in range(3)], [[o] for o in outs]) == [True] * 3
        assert all(torch.equal(o, p) for o, p in zip(outs, pages))
