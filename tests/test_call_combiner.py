"""Calls in flight combined into one (gdskv.call_combiner): the combiner's batching rules on
their own, and a CPU tier's pool calls from many threads -- bit-exact, each caller getting its
own pages' results, a bad argument raising in its own caller only."""

from __future__ import annotations

import threading

import pytest
import torch

from gdskv.call_combiner import CallCombiner, CallRequest
from gdskv.tier import Tier
from reliability_helpers import (LAYOUT, SLOT, hold_first_io, run_in_threads, small_config,
                                 wait_for)


class _Held:
    """A combiner whose first call (run alone, in group "g") blocks until released, so that
    the calls the test starts meanwhile queue up behind it; batches are recorded as run."""

    def __init__(self, max_batch_pages: int = 256) -> None:
        self.batches: list[list[str]] = []
        self.combiner = CallCombiner(self._run_batch, max_batch_pages)
        self.release = threading.Event()
        self.results: dict = {}

    def _run_batch(self, batch: list[CallRequest]) -> None:
        self.batches.append([r.payload for r in batch])
        if any(r.payload.startswith("bad") for r in batch):  # (as a tier's call: before any
            raise ValueError("a batch with a bad call")       # result is set)
        for r in batch:
            r.result = [f"{r.payload}:{k}" for k in r.keys]

    def hold(self, group="g") -> threading.Thread:
        def alone():
            self.release.wait(10)
            return ["alone"]
        t = threading.Thread(target=lambda: self.results.__setitem__(
            "first", self.combiner.call(group, alone, None)))
        t.start()
        wait_for(lambda: group in self.combiner._groups, 5, "the first call to start")
        return t

    def queue(self, name: str, keys: list, group="g") -> threading.Thread:
        def run():
            try:
                self.results[name] = self.combiner.call(
                    group, lambda: ["ran alone"], lambda: CallRequest(group, keys, name))
            except ValueError as exc:
                self.results[name] = exc
        before = self.combiner.waiting(group)
        t = threading.Thread(target=run)
        t.start()
        wait_for(lambda: self.combiner.waiting(group) > before, 5, f"{name} to queue")
        return t


def test_a_call_alone_runs_by_itself():
    c = CallCombiner(lambda batch: pytest.fail("no batch without a call in flight"))
    assert c.call("g", lambda: [True], lambda: pytest.fail("nothing to prepare")) == [True]
    assert c.call("g", lambda: [False], None) == [False]
    assert (c.batches, c.batched_calls, c._groups) == (0, 0, {})


def test_calls_in_flight_run_as_one_batch_each_with_its_own_results():
    h = _Held()
    first = h.hold()
    waiting = [h.queue("a", ["k1", "k2"]), h.queue("b", ["k3"]), h.queue("c", ["k4"])]
    h.release.set()
    for t in [first] + waiting:
        t.join(10)
    assert h.results == {"first": ["alone"], "a": ["a:k1", "a:k2"], "b": ["b:k3"],
                         "c": ["c:k4"]}
    assert h.batches == [["a", "b", "c"]]
    assert (h.combiner.batches, h.combiner.batched_calls, h.combiner._groups) == (1, 3, {})


def test_other_groups_never_wait_and_batches_keep_keys_disjoint_within_the_page_limit():
    h = _Held(max_batch_pages=3)
    first = h.hold()
    # another group (a spill while restores run, as SGLang's backup and prefetch threads do)
    # runs at once, alone, while the first call is still held
    assert h.combiner.call("other", lambda: ["at once"], None) == ["at once"]
    waiting = [h.queue("a", ["k1"]),
               h.queue("c", ["k1", "k5"]),  # a key of a's: a later batch
               h.queue("d", ["k6", "k7"]),  # fits with a (3 pages)
               h.queue("e", ["k8"])]        # over the page limit with a and d
    h.release.set()
    for t in [first] + waiting:
        t.join(10)
    assert h.batches == [["a", "d"], ["c", "e"]]  # (c and e: 3 pages)
    assert h.results["c"] == ["c:k1", "c:k5"] and h.results["e"] == ["e:k8"]


def test_an_exception_in_a_batch_reaches_every_caller_in_it_and_no_other():
    h = _Held(max_batch_pages=2)
    first = h.hold()
    waiting = [h.queue("ok1", ["k1"]), h.queue("bad", ["k2"]), h.queue("ok2", ["k3"])]
    h.release.set()
    for t in [first] + waiting:
        t.join(10)
    assert isinstance(h.results["ok1"], ValueError) and isinstance(h.results["bad"], ValueError)
    assert h.results["ok2"] == ["ok2:k3"]  # a batch of its own (the page limit)
    assert h.combiner._groups == {}


# -- a CPU tier's pool calls ----------------------------------------------------------------------

def _pool(pages: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (LAYOUT.num_layers, pages * LAYOUT.page_size, LAYOUT.kv_heads, LAYOUT.head_dim)
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=gen).to(LAYOUT.torch_dtype) for _ in range(2))


def _slots(page: int) -> torch.Tensor:
    return torch.arange(page * LAYOUT.page_size, (page + 1) * LAYOUT.page_size)


def _queued(tier: Tier, n: int) -> None:
    wait_for(lambda: tier._combiner.waiting() >= n, 10, f"{n} calls to queue")


@pytest.mark.parametrize("io_on_caller", [True, False])
def test_pool_calls_in_flight_are_combined_and_bit_exact(tmp_path, io_on_caller):
    """Puts and gets of one shared pool from several threads, while a first call holds the
    tier: the waiting calls run as one call per operation, every page comes back exact, and
    each caller gets its own pages' results (misses included)."""
    threads = 6
    # pages 0..threads: stored and restored; threads+1..2*threads: where the misses would go
    src, dst = _pool(2 * threads + 1, 1), _pool(2 * threads + 1, 2)
    cfg = small_config(tmp_path, io_on_caller=io_on_caller, calls_at_once=1)
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        results: dict = {}

        def in_flight(first_call, calls) -> None:
            started, go = hold_first_io(tier)
            first = threading.Thread(target=lambda: results.__setitem__("first", first_call()))
            first.start()
            assert started.wait(10)
            waiting = [threading.Thread(target=lambda t=t, call=call: results.__setitem__(
                t, call())) for t, call in calls]
            for i, t in enumerate(waiting):
                t.start()
                _queued(tier, i + 1)
            go.set()
            for t in [first] + waiting:
                t.join(30)

        in_flight(lambda: tier.put(["p0"], src, _slots(0)),
                  [(t, lambda t=t: tier.put([f"p{t}"], src, _slots(t)))
                   for t in range(1, threads + 1)])
        assert results["first"] == [True]
        assert all(results[t] == [True] for t in range(1, threads + 1)), results
        assert (tier.stats()["combined_calls"], tier.stats()["calls_combined"]) == (1, threads)

        # each thread restores its page and a key never stored (a miss, for that caller only)
        in_flight(lambda: tier.get(["p0"], dst, _slots(0)),
                  [(t, lambda t=t: tier.get([f"p{t}", f"none{t}"], dst, torch.cat(
                      [_slots(t), _slots(threads + t)]))) for t in range(1, threads + 1)])
        assert results["first"] == [True]
        assert all(results[t] == [True, False] for t in range(1, threads + 1)), results
        stats = tier.stats()
        assert (stats["combined_calls"], stats["calls_combined"]) == (2, 2 * threads)
        assert stats["get_pages"] == 1 + 2 * threads and stats["hits"] == 1 + threads
    rows = (threads + 1) * LAYOUT.page_size
    assert all(torch.equal(a[:, :rows], b[:, :rows]) for a, b in zip(src, dst))


def test_a_bad_argument_raises_in_its_own_caller_only(tmp_path):
    """A call that would be combined checks its arguments before it waits: slots out of the
    pool raise in that caller; the call in flight and the good waiting call are unharmed."""
    src, dst = _pool(3, 3), _pool(3, 4)
    with Tier(LAYOUT, small_config(tmp_path, calls_at_once=1), device="cpu") as tier:
        assert tier.put(["a", "b"], src, torch.cat([_slots(0), _slots(1)])) == [True, True]
        started, go = hold_first_io(tier)
        results: dict = {}

        def run(name, call):
            try:
                results[name] = call()
            except (ValueError, IndexError) as exc:
                results[name] = exc

        first = threading.Thread(target=run, args=("first", lambda: tier.get(
            ["a"], dst, _slots(0))))
        first.start()
        assert started.wait(10)
        good = threading.Thread(target=run, args=("good", lambda: tier.get(
            ["b"], dst, _slots(1))))
        good.start()
        _queued(tier, 1)
        run("bad", lambda: tier.get(["b"], dst, _slots(50)))  # no such slots: raises at once
        go.set()
        for t in (first, good):
            t.join(30)
        assert isinstance(results["bad"], (ValueError, IndexError)), results["bad"]
        assert results["first"] == [True] and results["good"] == [True]
    rows = 2 * LAYOUT.page_size
    assert all(torch.equal(a[:, :rows], b[:, :rows]) for a, b in zip(src, dst))


@pytest.mark.parametrize("combine", [True, False])
def test_many_threads_of_one_page_calls_on_one_pool(tmp_path, combine):
    """Eight threads, each spilling and restoring its own pages of one shared pool one page a
    call, many rounds: every byte comes back, with combining on and off (none combined)."""
    threads, rounds = 8, 12
    src, dst = _pool(threads * 2, 5), _pool(threads * 2, 6)
    cfg = small_config(tmp_path, capacity=128 * SLOT, combine_calls=combine)
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        def worker(t: int) -> list:
            problems = []
            for r in range(rounds):
                page = 2 * t + r % 2
                key = f"t{t}-r{r}"
                if tier.put([key], src, _slots(page)) != [True]:
                    problems.append(f"put {key}")
                if tier.get([key], dst, _slots(page)) != [True]:
                    problems.append(f"get {key}")
            return problems

        assert not run_in_threads(worker, threads)
        stats = tier.stats()
        assert stats["get_pages"] == stats["hits"] == threads * rounds
        if not combine:  # (with it on, how many combine depends on timing; see the test above)
            assert stats["combined_calls"] == stats["calls_combined"] == 0
    assert all(torch.equal(a, b) for a, b in zip(src, dst))


def test_running_calls_up_to_the_limit_run_alone_and_the_rest_combine():
    """``running=2``: two calls run alone at once; the next ones wait and run as one batch."""
    both = threading.Barrier(2, timeout=10)
    release = threading.Event()
    ran: list = []

    def alone(name):
        def run():
            ran.append(name)
            both.wait()  # the two run at the same time (else this times out)
            release.wait(10)
            return [name]
        return run

    batches: list = []

    def run_batch(batch):
        batches.append([r.payload for r in batch])
        for r in batch:
            r.result = [r.payload]

    c = CallCombiner(run_batch, running=2)
    results: dict = {}
    first = [threading.Thread(target=lambda n=n: results.__setitem__(n, c.call("g", alone(n),
                                                                                None)))
             for n in ("x", "y")]
    for t in first:
        t.start()
    wait_for(lambda: len(ran) == 2, 10, "both calls to run")
    later = [threading.Thread(target=lambda n=n: results.__setitem__(n, c.call(
        "g", alone(n), lambda n=n: CallRequest("g", [n], n)))) for n in ("a", "b")]
    for i, t in enumerate(later):
        t.start()
        wait_for(lambda: c.waiting() > i, 10, "the call to queue")
    release.set()
    for t in first + later:
        t.join(10)
    assert results == {"x": ["x"], "y": ["y"], "a": ["a"], "b": ["b"]}
    assert batches == [["a", "b"]] and sorted(ran) == ["x", "y"] and c._groups == {}


def test_once_calls_wait_a_group_runs_one_batch_at_a_time():
    """``running=3``: while a batch is being served, a call arriving with fewer than three
    running still waits (it joins the next batch) rather than running alone beside it."""
    gates = {n: threading.Event() for n in ("x", "y", "z", "batch")}
    ran_alone: list = []
    batches: list = []

    def alone(name):
        def run():
            ran_alone.append(name)
            gates.get(name, gates["z"]).wait(10)
            return [name]
        return run

    def run_batch(batch):
        batches.append([r.payload for r in batch])
        if len(batches) == 1:
            gates["batch"].wait(10)  # the first batch is held until the test lets it go
        for r in batch:
            r.result = [r.payload]

    c = CallCombiner(run_batch, running=3)
    results: dict = {}

    def start(name):
        t = threading.Thread(target=lambda: results.__setitem__(name, c.call(
            "g", alone(name), lambda: CallRequest("g", [name], name))))
        t.start()
        return t

    threads = [start(n) for n in ("x", "y", "z")]
    wait_for(lambda: len(ran_alone) == 3, 10, "three calls to run alone")
    threads.append(start("a"))
    wait_for(lambda: c.waiting() == 1, 10, "a to wait")
    gates["x"].set()  # x ends: a's batch starts (and is held)
    wait_for(lambda: batches == [["a"]], 10, "a's batch")
    gates["y"].set()  # y ends while the batch runs: two run now (z, the batch)
    wait_for(lambda: c._groups["g"].active == 2, 10, "y to end")
    threads.append(start("b"))  # fewer than three run, but a batch is being served: b waits
    wait_for(lambda: c.waiting() == 1, 10, "b to wait")
    gates["batch"].set()
    gates["z"].set()
    for t in threads:
        t.join(10)
    assert results == {n: [n] for n in ("x", "y", "z", "a", "b")}
    assert sorted(ran_alone) == ["x", "y", "z"] and batches == [["a"], ["b"]]
    assert c._groups == {}


def test_quick_spills_that_wait_run_as_one_quick_call(tmp_path, monkeypatch):
    """Host-region spills that can go the quick way and wait behind a running one are combined
    into one quick spill (one engine call for the batch), not the general path, and every page
    reads back exact."""
    from gdskv.config import TierConfig
    from gdskv.layout import BytePageLayout
    from gdskv.memory import alloc_host
    layout = BytePageLayout(page_bytes=16 << 10, kind="test/quick-batch")
    cfg = TierConfig(directories=(str(tmp_path),), capacity=64 * layout.slot_bytes,
                     calls_at_once=1)
    keys = ["first", "a", "b", "c"]
    pages = {k: alloc_host(layout.page_bytes, pin=False) for k in keys}
    for i, k in enumerate(keys):
        pages[k].copy_(torch.randint(0, 256, (layout.page_bytes,), dtype=torch.uint8,
                                     generator=torch.Generator().manual_seed(i)))
    with Tier(layout, cfg, device="cpu") as tier:
        spill = tier._quick["put"]
        started, go = threading.Event(), threading.Event()
        real_write, sizes = spill._write, []

        def held_write(keys, todo, regions):
            sizes.append(len(todo))
            if not started.is_set():
                started.set()
                go.wait(30)
            return real_write(keys, todo, regions)

        monkeypatch.setattr(spill, "_write", held_write)
        answers = {}

        def put(k):
            answers[k] = tier.put_pages([k], [[pages[k]]])

        threads = [threading.Thread(target=put, args=(k,)) for k in keys]
        threads[0].start()
        assert started.wait(30)
        for i, t in enumerate(threads[1:]):
            t.start()
            wait_for(lambda: tier._combiner.waiting() > i, 10, "the spill to queue")
        go.set()
        for t in threads:
            t.join(30)
        assert answers == {k: [True] for k in keys}
        assert sizes == [1, 3]  # the first alone, then the three waiting as one quick spill
        stats = tier.stats()
        assert stats["quick_spills"] == 2 and stats["put_stored"] == 4
        assert stats["calls_combined"] == 3
        out = [alloc_host(layout.page_bytes, pin=False) for _ in keys]
        assert tier.get_pages(keys, [[o] for o in out]) == [True] * 4
        assert all(torch.equal(o, pages[k]) for o, k in zip(out, keys))
