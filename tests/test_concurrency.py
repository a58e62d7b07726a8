"""Eviction under concurrency: threads putting, getting and evicting on one tier with LRU
pressure. Readers never get wrong bytes, pinned pages are never freed mid-read, and the store
never takes more disk than its manifest's file size."""

from __future__ import annotations

import os
import random
import threading

from gdskv.directory import PageDirectory, PageState
from gdskv.tier import Tier
from reliability_helpers import LAYOUT, SLOT, check_pages, put, small_config


def test_pinned_page_survives_eviction_until_unpinned():
    d = PageDirectory(2)
    res = d.reserve(["a", "b"])
    d.commit(res.slots, [11, 22])
    (slot_a, _), = d.pin(["a"])
    assert d.remove(["a"]) == []  # pinned: marked, not freed
    assert d.state("a") == PageState.EVICTING
    assert d.pin(["a"]) == [None]  # no new readers
    res2 = d.reserve(["c"])  # the store is full: LRU may only take unpinned READY "b"
    assert res2.evicted == [("b", res.slots[1])] and res2.slots[0] != slot_a
    assert d.unpin([slot_a]) == [("a", slot_a)]  # freed at the last unpin
    assert d.state("a") == PageState.FREE and d.free_slots == 1


def test_threads_put_get_evict(tmp_path):
    cfg = small_config(tmp_path, capacity=16 * SLOT, io_threads=4)
    tier = Tier(LAYOUT, cfg, device="cpu")
    keys = [f"t{i}" for i in range(40)]
    stop = threading.Event()
    errors: list = []
    counts = {"gets": 0, "hits": 0, "puts": 0, "evicts": 0, "size_checks": 0}
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                op = rng.random()
                batch = rng.sample(keys, rng.randint(1, 6))
                if op < 0.4:
                    ok = put(tier, batch)
                    with lock:
                        counts["puts"] += sum(ok)
                elif op < 0.85:
                    res = check_pages(tier, batch)
                    if res["wrong"]:
                        errors.append(f"wrong bytes for {res['wrong']}")
                    with lock:
                        counts["gets"] += len(batch)
                        counts["hits"] += res["hits"]
                else:
                    n = tier.evict(batch)
                    with lock:
                        counts["evicts"] += n
        except Exception as exc:  # surfaced below
            errors.append(repr(exc))

    def watcher() -> None:
        while not stop.is_set():
            for f in tier.store.files:
                size = os.fstat(f.fd).st_size
                if size > tier.store.file_bytes:
                    errors.append(f"{f.path} grew to {size} > {tier.store.file_bytes}")
            if len(tier.directory) > tier.store.num_slots:
                errors.append("more READY pages than slots")
            counts["size_checks"] += 1
            stop.wait(0.002)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    w = threading.Thread(target=watcher)
    w.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    w.join()
    print(counts, tier.stats().get("evictions"))
    assert not errors, errors[:5]
    assert counts["hits"] > 0 and counts["evicts"] > 0
    assert tier.stats()["evictions"] > counts["evicts"]  # LRU evicted too
    ready = {k for k in keys if tier.contains(k)}
    tier.close()
    with Tier(LAYOUT, cfg, device="cpu") as again:
        res = check_pages(again, keys)
        assert set(keys) - set(res["missed"]) == ready and not res["wrong"]


def test_evict_while_reading(tmp_path):
    """evict() from another thread while get() holds pins: the reader gets exact bytes or a
    miss; the page is freed only after the read."""
    cfg = small_config(tmp_path, capacity=64 * SLOT)
    keys = [f"v{i}" for i in range(64)]
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        assert all(put(tier, keys))
        for round_ in range(20):
            evicter = threading.Thread(target=tier.evict, args=(keys[round_::7],))
            evicter.start()
            res = check_pages(tier, keys)
            evicter.join()
            assert not res["wrong"]
            assert all(put(tier, keys))  # refill, reusing the freed slots
        assert check_pages(tier, keys)["hits"] == len(keys)
