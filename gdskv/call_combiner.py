"""Calls in flight from several threads, combined: one data call serves the pages of many.

Engines issue many small calls at once (a transfer thread per request, several prefetch and
backup threads). Each gdskv call has a fixed host cost -- directory lookups, a dozen CUDA calls
on a GPU pool, a hundred-odd Python calls under one interpreter lock -- and on the H100 VMs four
threads of 1-page restores ran *slower together* than one alone (0.27 ms a call alone, 0.45 ms
with four in flight; ``bench/results/h100-2026-11-27/concurrency/``): the threads contend for
the lock and the CUDA driver, so their fixed costs add up instead of overlapping.

So, as a database's group commit does: a call that finds fewer than ``running`` calls of its
group running, and none waiting, runs alone, as it always did (a single thread pays nothing but
one lock). A call that arrives while ``running`` run, or while others wait, queues its
arguments and waits (the batch's thread checks them: a waiting
caller takes the interpreter lock as little as it can). When a running call ends it hands the
queue to the first waiter, which runs every queued call of its group as *one* data call (keys
and slots concatenated) and wakes the others with their own results or errors. The fixed cost
is then paid once per batch, and one thread makes the batch's CUDA calls; the batch's I/O is
spread over the backend's threads as any multi-page call's is. Once calls wait, a group runs
one batch at a time (the calls already running alone finish meanwhile): a few threads' calls
(up to ``running``) overlap their I/O as they always did, and many threads' calls are combined
instead of contending (``bench/results/h100-2026-11-27/combine/``).

Calls of different *groups* never wait for each other: a spill and a restore (SGLang backs up
and prefetches from two threads), or calls on two pools, run side by side as before. Within a
group (the same operation on the same KV pool, or on host regions) calls combine only with
disjoint keys (a call refuses a repeated key); the rest wait for the next hand-off, in order.
"""

from __future__ import annotations

import _thread
import dataclasses
import time
from collections.abc import Callable, Hashable
from typing import Any

from .yielding_lock import YieldingLock

#: the most pages one combined call takes (more wait for the next): a batch is one call's
#: latency for every caller in it
MAX_BATCH_PAGES = 256


@dataclasses.dataclass(eq=False)
class CallRequest:
    """One caller's call, waiting to be combined: its ``group``, ``keys`` and whatever the
    batch runner needs to move its pages (``payload``); ``t0``: when it was asked for."""

    group: Hashable
    keys: list
    payload: Any
    t0: float = dataclasses.field(default_factory=time.perf_counter)
    result: list | None = None
    error: BaseException | None = None
    #: set for the request whose thread runs the batch (its first request)
    batch: list | None = None
    #: released to wake the waiting caller (a bare lock: cheaper than an Event)
    wake: Any = dataclasses.field(default_factory=_thread.allocate_lock)

    def __post_init__(self) -> None:
        self.wake.acquire()

    def outcome(self) -> list:
        if self.error is not None:
            raise self.error
        return self.result


class _Group:
    """One group's calls: how many run now (calls alone and the batch), whether a batch is
    among them, and those waiting (in arrival order)."""

    __slots__ = ("active", "batching", "queue")

    def __init__(self) -> None:
        self.active = 0
        self.batching = False
        self.queue: list[CallRequest] = []

    def free(self, running: int) -> bool:
        """A call arriving now may run alone: fewer than ``running`` run, and none waits or
        is being served in a batch (once calls queue, the group runs one batch at a time)."""
        return self.active < running and not self.queue and not self.batching


class CallCombiner:
    """Combines calls in flight (see the module's docstring).

    Args:
        run_batch: runs a batch of requests of one group with disjoint keys as one call, and
            sets each request's ``result`` (its per-page results, in its keys' order) or
            ``error``; it must not raise.
        max_batch_pages: the most pages one batch takes.
        rounds: batches the thread that ends a call runs itself before it hands the next one
            over (0: it hands over at once).
        running: calls or batches of one group that run at once (their I/O overlaps); more
            wait and combine.
    """

    def __init__(self, run_batch: Callable[[list[CallRequest]], None],
                 max_batch_pages: int = MAX_BATCH_PAGES, rounds: int = 0,
                 running: int = 1) -> None:
        self._run_batch = run_batch
        self._max_pages = max_batch_pages
        self.running = running
        self.rounds = rounds
        self._lock = YieldingLock()
        self._groups: dict[Hashable, _Group] = {}  # groups with calls running or waiting
        #: batches of more than one call run, and the calls they served
        self.batches = 0
        self.batched_calls = 0

    def call(self, group: Hashable, alone: Callable[[], list],
             prepare: Callable[[], CallRequest]) -> list:
        """The call's per-page results. ``alone()`` runs it by itself (fewer than ``running``
        calls of its ``group`` run); ``prepare()`` makes its request of that group, to be
        combined (this one waits). What either raises, the caller gets; so does what the batch
        runner sets as the request's error."""
        with self._lock:
            g = self._groups.get(group)
            if g is None:
                g = self._groups[group] = _Group()
            lead = g.free(self.running)
            if lead:
                g.active += 1
        if lead:
            try:
                return alone()
            finally:
                self._drain(group, False)
        request = prepare()
        with self._lock:
            g = self._groups.get(group)
            if g is None:
                g = self._groups[group] = _Group()
            queued = not g.free(self.running)
            if queued:
                g.queue.append(request)
            else:  # a running call ended while this one prepared: run it now, as alone
                g.active += 1
                request.batch = [request]
        if queued:
            self._wait(group, request)
        if request.batch is not None:
            try:
                self._serve(request.batch, request)
            finally:
                self._drain(group, queued)
        return request.outcome()

    def waiting(self, group: Hashable | None = None) -> int:
        """Calls waiting now (in ``group``, or in all)."""
        with self._lock:
            groups = self._groups.values() if group is None else \
                [self._groups[group]] if group in self._groups else []
            return sum(len(g.queue) for g in groups)

    def _wait(self, group: Hashable, request: CallRequest) -> None:
        try:
            request.wake.acquire()
        except BaseException:
            # Interrupted (a signal in the main thread). Still queued: leave. Already taken into
            # a batch: the batch, and every waiter behind it, need this thread to go on.
            with self._lock:
                g = self._groups.get(group)
                if g is not None and request in g.queue:
                    g.queue.remove(request)
                    raise
            request.wake.acquire()
            if request.batch is not None:
                try:
                    self._serve(request.batch, request)
                finally:
                    self._drain(group, True)
            raise

    def _serve(self, batch: list[CallRequest], mine: CallRequest | None) -> None:
        """Run ``batch`` and wake its callers (all but ``mine``, this thread's own)."""
        try:
            self._run_batch(batch)
        except BaseException as exc:  # noqa: BLE001 - every caller of the batch gets it
            for r in batch:
                if r.result is None and r.error is None:
                    r.error = exc
        if len(batch) > 1:
            self.batches += 1
            self.batched_calls += len(batch)
        for r in batch:
            if r is not mine:
                r.wake.release()

    def _drain(self, group: Hashable, batch: bool) -> None:
        """A running call of ``group`` has ended (``batch``: a batch). If calls wait and no
        other batch is being served, run the next batches here (up to ``rounds``), then hand
        the next one to its first request, whose thread runs it; else one call fewer runs
        now. Running a batch here saves the hand-over (a thread to wake, the interpreter lock
        to win back) at the cost of this thread's caller waiting."""
        done = 0
        while True:
            with self._lock:
                g = self._groups[group]
                if not g.queue or (g.batching and not batch):
                    if batch:
                        g.batching = False
                    g.active -= 1
                    if not g.active:
                        del self._groups[group]
                    return
                g.batching = batch = True  # (this call's place passes to the batch)
                take = self._take(g)
                here = done < self.rounds
                if not here:
                    take[0].batch = take
            if not here:
                take[0].wake.release()
                return
            done += 1
            self._serve(take, None)

    def _take(self, g: _Group) -> list[CallRequest]:
        """The group's next batch, in arrival order (under the lock): the first request and
        the later ones whose keys none of the batch has, up to the page limit."""
        first = g.queue[0]
        batch, keys, rest = [first], set(first.keys), []
        pages = len(first.keys)
        for r in g.queue[1:]:
            if pages + len(r.keys) <= self._max_pages and keys.isdisjoint(r.keys):
                batch.append(r)
                keys.update(r.keys)
                pages += len(r.keys)
            else:
                rest.append(r)
        g.queue = rest
        return batch
