"""A data call's counters and metrics, applied off its critical path.

Adding a call's counters to :class:`~gdskv.stats.TierStats` and its Prometheus series
(:mod:`gdskv.metrics`) costs a 1-page spill about 25 µs of host time on an H200's host, after
its write has ended and before it returns
(``bench/results/h200-2026-11-26/call-overhead-6/call2/put_lines_start.txt``). A call instead
records them here (a deque append) and they are applied later: by the next call while its own
I/O runs (host time the call waits anyway), by :meth:`Tier.stats` before it reads the counters,
by a registry scrape in the tier's process (:mod:`gdskv.metrics`), at close, and otherwise by an
idle thread within ``idle_seconds``, or as soon as :data:`WAKE_AT` entries wait. So
``Tier.stats()`` and an in-process scrape are exact; a scrape from another process
(prometheus_client's multiprocess mode) lags by at most ``idle_seconds``.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

log = logging.getLogger("gdskv.ledger")

#: how long a call's counters may wait for the next call before the idle thread applies them
IDLE_SECONDS = 0.5
#: entries waiting that wake the idle thread at once. A quick call settles nothing itself, so
#: at tens of thousands of calls a second the entries of half a second would outlive the
#: collector's young generations and make the full collections come often: 1-page restores
#: on the development machine spent about 2 µs a call in them (three of about 70 ms each in
#: 100,000 calls); woken at this many, the entries die young.
WAKE_AT = 512


class CallLedger:
    """Entries recorded by data calls, applied by ``apply(*entry)`` in record order (each
    exactly once; from whichever thread settles). ``flush()``, where given, ends every settle
    that applied entries (in the same hold of the order lock): ``apply`` may gather the
    entries' counters and ``flush`` add them up once (an add per call cost a 1-page call
    about 4 µs of host time on the 2-core development machine, ``bench/results/
    cpu-2026-11-27/percall/``)."""

    def __init__(self, apply: Callable[..., None], idle_seconds: float = IDLE_SECONDS,
                 name: str = "gdskv-ledger", flush: Callable[[], None] | None = None) -> None:
        self._apply = apply
        self._flush = flush
        self._entries: collections.deque = collections.deque()
        self._order = threading.Lock()  # one settler at a time: entries applied in order
        self._stop = threading.Event()
        self._wake = threading.Event()  # set: many entries wait (WAKE_AT), or stop
        self._idle_seconds = idle_seconds
        self._failed_once = False
        self._thread = threading.Thread(target=self._settle_when_idle, name=name, daemon=True)
        self._thread.start()

    def record(self, *entry) -> None:
        """Keep ``entry`` to apply later (cheap: one append, no lock; the idle thread is woken
        when :data:`WAKE_AT` entries wait)."""
        entries = self._entries
        entries.append(entry)
        if len(entries) >= WAKE_AT and not self._wake.is_set():
            self._wake.set()

    def settle(self, wait: bool = True) -> None:
        """Apply every entry recorded so far. ``wait=False``: unless another thread is
        applying them now (it applies them all; a data call does not wait for it)."""
        if not self._entries or not self._order.acquire(blocking=wait):
            return
        try:
            entries = self._entries
            while entries:
                entry = entries.popleft()
                try:
                    self._apply(*entry)
                except Exception as exc:  # noqa: BLE001 - a counter never fails a later call
                    self._failed(exc)
            if self._flush is not None:
                try:
                    self._flush()
                except Exception as exc:  # noqa: BLE001 - as an entry's
                    self._failed(exc)
        finally:
            self._order.release()

    def _failed(self, exc: Exception) -> None:
        if not self._failed_once:
            self._failed_once = True
            log.error("gdskv: applying a call's counters failed: %s", exc)

    def close(self) -> None:
        """Stop the idle thread and apply what is left."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        self.settle()

    def _settle_when_idle(self) -> None:
        while True:
            self._wake.wait(self._idle_seconds)
            if self._stop.is_set():
                return
            self.settle()
            # cleared after the settle: a call that records meanwhile finds it set and does not
            # wake this thread again for the entries it is applying (woken for each, it took
            # the Event's lock and the GIL back and forth with the calling thread: 1-page
            # spills from one thread ran 20 % slower)
            self._wake.clear()
