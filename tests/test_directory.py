"""PageDirectory: states, prefix match, LRU with pinning, thread safety, memory per page."""

from __future__ import annotations

import random
import threading
import tracemalloc

import pytest

from gdskv.directory import PageDirectory, PageState


def fill(d: PageDirectory, keys):
    res = d.reserve(keys)
    d.commit([s for s in res.slots if s is not None], [7] * len(keys))
    return res


def test_states_and_prefix():
    d = PageDirectory(8)
    res = d.reserve(["a", "b", "c"])
    assert res.slots == [0, 1, 2] and d.state("a") == PageState.WRITING
    assert d.match_prefix(["a", "b"]) == 0  # WRITING is not readable yet
    d.commit([0, 1], [11, 12])
    d.abort([2])
    assert d.match_prefix(["a", "b", "c"]) == 2 and d.state("c") == PageState.FREE
    assert d.reserve(["a", "d"]).present == [True, False]


def test_lru_evicts_oldest_unpinned():
    d = PageDirectory(4)
    fill(d, ["a", "b", "c", "d"])
    assert d.pin(["a"]) == [(0, 7)]  # a is pinned and most recent
    d.pin(["b"])
    d.unpin([1])  # b: recent, unpinned
    res = d.reserve(["e", "f"])
    assert sorted(k for k, _ in res.evicted) == ["c", "d"]
    assert res.slots and None not in res.slots
    # e and f are still WRITING and a is pinned: only b can go, so one of three keys fits
    res = d.reserve(["g", "h", "i"])
    assert [k for k, _ in res.evicted] == ["b"] and res.slots == [1, None, None]
    assert d.contains("a") and d.state("e") == PageState.WRITING


def _lru_pick(d: PageDirectory, count: int, protect: set) -> set:
    """What eviction must take: the ``count`` oldest unpinned READY pages not in ``protect``
    (a scan of the arrays, as the directory did per call before it kept candidates)."""
    ready = [(int(d._last_use[s]), k) for k, s in d._index.items()
             if d._state[s] == PageState.READY and d._pins[s] == 0 and k not in protect]
    return {k for _, k in sorted(ready)[:max(count, 0)]}


@pytest.mark.parametrize("seed", range(6))
def test_eviction_takes_the_pages_a_scan_per_call_would(seed):
    """Random puts (some re-putting present keys), reads that pin and unpin, aborts and
    removals on a full directory: every reserve evicts exactly the least recently used
    unpinned pages that a scan of all slots at that moment picks, though the candidates come
    from a queue made by earlier scans."""
    rng = random.Random(seed)
    d = PageDirectory(64)
    d._scan_batch = 8  # small batches: the queue runs out and is scanned again often
    next_key, pinned, writing = 0, [], []
    for _ in range(1500):
        op = rng.random()
        if op < 0.45:
            present = [k for k in d._index if rng.random() < 0.05][:2]
            new = [f"k{next_key + i}" for i in range(rng.randint(1, 4))]
            next_key += len(new)
            keys = new + present
            count = sum(1 for k in keys if k not in d._index) - d.free_slots
            want = _lru_pick(d, count, set(keys))
            res = d.reserve(keys)
            assert {k for k, _ in res.evicted} == want
            got = [s for s in res.slots if s is not None]
            if rng.random() < 0.1:
                d.abort(got)
            else:
                writing.extend(got)
        elif op < 0.75 and writing:
            rng.shuffle(writing)
            done, writing = writing[:3], writing[3:]
            d.commit(done, [1] * len(done))
        elif op < 0.9 and d._index:
            keys = rng.sample(list(d._index), min(3, len(d._index)))
            pinned.extend(p[0] for p in d.pin(keys) if p is not None)
        elif pinned:
            rng.shuffle(pinned)
            d.unpin([pinned.pop()])
        elif op > 0.98 and d._index:
            d.remove([rng.choice(list(d._index))])


def test_a_batch_of_evictions_shares_one_scan(monkeypatch):
    """On a full store each put evicts; the slots are scanned once per batch (1/256 of the
    slots, at least 64), not once per put."""
    d = PageDirectory(1 << 14)
    fill(d, [f"k{i}" for i in range(1 << 14)])
    scans = []
    scan = PageDirectory._scan_candidates_locked
    monkeypatch.setattr(PageDirectory, "_scan_candidates_locked",
                        lambda self, need: scans.append(need) or scan(self, need))
    for i in range(640):
        res = fill(d, [f"x{i}"])
        assert [k for k, _ in res.evicted] == [f"k{i}"]  # the oldest, in order
    assert len(scans) == 640 // 64


def test_eviction_looks_past_a_queue_of_pinned_pages():
    """The oldest pages are all pinned (being read): a put still evicts the oldest unpinned
    one, however many pinned pages the first scan's batch held, and the pinned ones go first
    once unpinned."""
    d = PageDirectory(128)
    d._scan_batch = 8
    fill(d, [f"k{i}" for i in range(128)])
    pins = [p[0] for p in d.pin([f"k{i}" for i in range(12)])]  # read (touched), held...
    for i in range(12, 128):  # ...while the rest are read after them: k0..k11 the oldest
        d.unpin([d.pin([f"k{i}"])[0][0]])
    assert [k for k, _ in fill(d, ["new0"]).evicted] == ["k12"]
    d.unpin(pins)
    assert [k for k, _ in fill(d, ["new1", "new2"]).evicted] == ["k0", "k1"]


def test_pinned_page_is_evicted_after_last_unpin():
    d = PageDirectory(2)
    fill(d, ["a"])
    d.pin(["a"])
    d.pin(["a"])
    assert d.remove(["a"]) == []  # pinned: EVICTING, not freed
    assert d.state("a") == PageState.EVICTING and d.pin(["a"]) == [None]
    assert d.unpin([0]) == []
    assert d.unpin([0]) == [("a", 0)]
    assert d.state("a") == PageState.FREE and d.free_slots == 2


def test_no_eviction_mode():
    d = PageDirectory(2, evict=False)
    fill(d, ["a", "b"])
    assert d.reserve(["c"]).slots == [None]


def test_thread_safety_under_concurrency():
    d = PageDirectory(64)
    errors = []

    def worker(t):
        try:
            for i in range(300):
                keys = [f"{t}-{i}-{j}" for j in range(3)]
                res = d.reserve(keys)
                d.commit([s for s in res.slots if s is not None], [1] * 3)
                pins = d.pin(keys)
                d.unpin([p[0] for p in pins if p is not None])
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(d) == 64 - d.free_slots and len(d) <= 64


def test_memory_per_page_under_100_bytes():
    n = 50_000
    keys = [f"{i:064x}" for i in range(n)]  # SHA-256-hex-like keys, allocated before measuring
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    d = PageDirectory(n)
    for k in range(0, n, 1000):
        fill(d, keys[k:k + 1000])
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    per_page = used / n
    print(f"directory bytes per page (keys excluded): {per_page:.1f}")
    assert per_page <= 100, per_page
    assert d.match_prefix(keys[:10]) == 10


@pytest.mark.parametrize("n", [1, 5])
def test_remove_unknown_and_writing_ignored(n):
    d = PageDirectory(n + 1)
    d.reserve(["w"])
    assert d.remove(["w", "nope"]) == []


@pytest.mark.parametrize("n", [3, 40])
def test_a_batch_commit_is_the_commits_one_by_one(n):
    """A commit of many slots (one numpy step per array) leaves what committing them one at a
    time does: states, checksums, algorithms, the ready count and the LRU order."""
    one, batch = PageDirectory(64), PageDirectory(64)
    keys = [f"k{i}" for i in range(n)]
    slots = one.reserve(keys).slots
    assert batch.reserve(keys).slots == slots
    order = slots[::-1]  # not slot order: recency must follow the call's order
    sums = [(i * 2654435761) % 2**64 for i in range(n)]
    for slot, csum in zip(order, sums):
        one.commit([slot], [csum], 3)
    batch.commit(order, sums, 3)
    for attr in ("_state", "_checksum", "_algorithm", "_last_use"):
        assert (getattr(one, attr) == getattr(batch, attr)).all(), attr
    assert one._ready == batch._ready == n and one._clock == batch._clock
    # the least recently used go first, in the call's order
    evicted = batch.reserve([f"new{i}" for i in range(64 - n + 2)]).evicted
    assert [k for k, _ in evicted] == [keys[slots.index(s)] for s in order[:2]]
    with pytest.raises(AssertionError, match="not WRITING"):
        batch.commit(order, sums, 3)


@pytest.mark.parametrize("count", [1, 8, 9, 40])
def test_all_use_tells_whether_every_slot_has_the_algorithm(count):
    """``all_use`` looks at a few slots one by one and at many with numpy: the same answer,
    including a slot of another algorithm at either end of the list."""
    d = PageDirectory(64)
    keys = [f"k{i}" for i in range(count)]
    slots = [s for s in d.reserve(keys).slots]
    d.commit(slots, [7] * count, algorithm=2)
    assert d.all_use(slots, 2) and not d.all_use(slots, 1)
    for end in ("first", "last"):
        other = d.reserve([f"odd-{end}"]).slots[0]
        d.commit([other], [7], algorithm=1)
        listed = [other] + slots if end == "first" else slots + [other]
        assert not d.all_use(listed, 2)
        assert d.all_use([other], 1)


def _twin_directories(n: int):
    """Two directories in the same state: ``n`` READY pages (keys k0..), two WRITING (w0, w1),
    one READY page pinned and then asked to go (EVICTING: freed at its last unpin)."""
    pair = []
    for _ in range(2):
        d = PageDirectory(2 * n + 8)
        fill(d, [f"k{i}" for i in range(n)])
        d.reserve(["w0", "w1"])
        d.pin(["k1"])
        assert d.remove(["k1"]) == [] and d.state("k1") == PageState.EVICTING
        pair.append(d)
    return pair


@pytest.mark.parametrize("n", [5, 40, 300])
def test_array_lookups_are_the_loops_one_by_one(n):
    """``pin``/``unpin``/``match_prefix`` on many keys use arrays, on few a loop: both give the
    same answers (misses, WRITING and EVICTING pages, a slot pinned twice) and leave the same
    pins, LRU order and freed pages."""
    loop, arrays = _twin_directories(n)
    keys = [f"k{i}" for i in range(n)]
    asked = ["k0"] + keys[::-1][:n - 2] + ["nope", "w0", "k1", "k0"]  # k0 twice in one call
    assert loop._pin_each(asked) == arrays._pin_arrays(asked)
    for attr in ("_pins", "_last_use", "_state"):
        assert (getattr(loop, attr) == getattr(arrays, attr)).all(), attr
    assert loop._clock == arrays._clock
    got = loop._pin_each(asked)
    assert got[asked.index("nope")] is None and got[asked.index("w0")] is None
    assert got[asked.index("k1")] is None  # EVICTING: no new reader
    arrays._pin_arrays(asked)
    held = [p[0] for p in got if p is not None] * 2 + [1]  # both pins of each, and k1's one
    assert loop._unpin_each(held) == arrays._unpin_arrays(held) == [("k1", 1)]
    for attr in ("_pins", "_state"):
        assert (getattr(loop, attr) == getattr(arrays, attr)).all(), attr
    assert loop.state("k1") == arrays.state("k1") == PageState.FREE
    with pytest.raises(AssertionError, match="unpin of unpinned slot 0"):
        arrays._unpin_arrays([0] * 40)
    with pytest.raises(AssertionError, match="unpin of unpinned slot 0"):
        loop._unpin_each([0])
    # the public calls choose by size; every answer is the loop's
    for d in (loop, arrays):
        assert d.match_prefix(keys) == 1  # k1 is gone
        assert d.match_prefix(iter(keys[:1] * 50)) == 50
        assert d.match_prefix(["k0", "w0"] + keys) == 1
        assert d.match_prefix([]) == 0
