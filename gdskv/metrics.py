"""Prometheus metrics of a tier (``gdskv_*``), through ``prometheus_client``.

One family per metric and registry (the process's default registry unless a tier is given
another), shared by the tiers of a process; each tier's series carry ``store`` = its first
directory. The counters follow :class:`~gdskv.stats.TierStats` (every ``add`` goes to both);
the call counters and histograms are applied from the tier's ledger (:mod:`gdskv.ledger`: after
the call returns, by the next call, or within 0.5 s), and the pages-stored gauge is set then
and at every scrape in the tier's process (not with ``set_function``, which does not work in
prometheus_client's multiprocess mode, which SGLang always uses and vLLM uses with
``PROMETHEUS_MULTIPROC_DIR``). A closed tier's series are removed.

| metric | type | labels |
|---|---|---|
| ``gdskv_pages_total`` | counter | ``store``, ``event``: put, got, missed, evicted, corrupt |
| ``gdskv_bytes_total`` | counter | ``store``, ``event``: as pages (payload bytes) |
| ``gdskv_io_failures_total`` | counter | ``store``, ``op``: read, write |
| ``gdskv_call_seconds`` | histogram | ``store``, ``op``: put, get |
| ``gdskv_call_pages`` | histogram | ``store``, ``op`` |
| ``gdskv_pages_stored`` / ``gdskv_capacity_pages`` | gauge | ``store`` |
| ``gdskv_fallback`` | gauge (1 while on) | ``store``, ``kind``, ``reason`` |
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import threading
import weakref
from collections.abc import Callable

#: TierStats keys -> (family, label value); a key not here is not a metric
_COUNTED = {"put_stored": ("pages", "put"), "hits": ("pages", "got"),
            "misses": ("pages", "missed"), "evictions": ("pages", "evicted"),
            "corrupt_pages": ("pages", "corrupt"), "bytes_written": ("bytes", "put"),
            "bytes_read": ("bytes", "got"), "write_failed": ("failures", "write"),
            "read_failed": ("failures", "read")}
#: page events whose bytes are the pages' payload (put/got count the bytes really moved)
_PAGE_BYTES = ("missed", "evicted", "corrupt")
_EVENTS = ("put", "got", "missed", "evicted", "corrupt")
_PAGE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
_SECOND_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)

# Per registry object, not per id(): a registry that is gone leaves its id to the next one made
# at the same address, whose metrics would otherwise go to the dead registry's families.
_families: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class _SettleOnScrape:
    """A collector with no series, registered in a registry before gdskv's families: a scrape
    collects it first, and it brings the live tiers' series up to date (what their calls left
    in their ledgers, :mod:`gdskv.ledger`, and the pages stored now), so a scrape in the tier's
    process is exact (one in another process, prometheus_client's multiprocess mode, sees the
    ledger's idle thread's work)."""

    def __init__(self) -> None:
        self.tiers: weakref.WeakSet = weakref.WeakSet()  # their TierMetrics

    def describe(self) -> list:
        return []  # (no names to claim; and registering it must not collect)

    def collect(self) -> list:
        for tier in list(self.tiers):
            tier.bring_up_to_date()
        return []


def observe_all(histogram, values: list) -> None:
    """``histogram.observe(v)`` for each of ``values``, as one update: each bucket hit and the
    sum incremented once. A tier's ledger applies its calls' observations by the thousand
    (:mod:`gdskv.ledger`), and ``observe`` takes the child's locks for each: about 0.8 µs an
    observation, 2 µs of a 1-page call's 12 µs of host time under the GIL on the development
    machine. This uses the child's own bounds and value holders (``_upper_bounds``,
    ``_buckets``: each observation counted in the first bucket whose bound holds it, as
    ``observe`` counts it; ``_sum``), which every prometheus_client since 0.20 has; where they
    are not, it observes one by one (``tests/test_metrics.py`` compares the two)."""
    if not values:
        return
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(buckets) != len(bounds):
        for v in values:
            histogram.observe(v)
        return
    hits = collections.Counter(bisect.bisect_left(bounds, v) for v in values)
    total.inc(sum(values))
    for i, n in sorted(hits.items()):
        if i < len(buckets):  # (past the last bound, +Inf: only NaN, which observe counts nowhere)
            buckets[i].inc(n)


def _families_for(registry) -> dict:
    from prometheus_client import Counter, Gauge, Histogram
    with _lock:
        fam = _families.get(registry)
        if fam is None:
            kw = {"registry": registry}
            settler = _SettleOnScrape()
            registry.register(settler)  # first: a registry collects in registration order
            fam = _families[registry] = {
                "settler": settler,
                "pages": Counter("gdskv_pages", "Pages by what happened to them",
                                 ["store", "event"], **kw),
                "bytes": Counter("gdskv_bytes", "Payload bytes by what happened to their pages",
                                 ["store", "event"], **kw),
                "failures": Counter("gdskv_io_failures", "Pages whose I/O failed",
                                    ["store", "op"], **kw),
                "seconds": Histogram("gdskv_call_seconds", "Latency of one put/get call",
                                     ["store", "op"], buckets=_SECOND_BUCKETS, **kw),
                "call_pages": Histogram("gdskv_call_pages", "Pages in one put/get call",
                                        ["store", "op"], buckets=_PAGE_BUCKETS, **kw),
                "stored": Gauge("gdskv_pages_stored", "Pages stored now", ["store"],
                                multiprocess_mode="livemostrecent", **kw),
                "capacity": Gauge("gdskv_capacity_pages", "Pages the store can hold",
                                  ["store"], multiprocess_mode="livemostrecent", **kw),
                "fallback": Gauge("gdskv_fallback", "1 while the tier runs on a fallback "
                                  "(kind: o_direct, gpu_direct, puts); reason says why",
                                  ["store", "kind", "reason"],
                                  multiprocess_mode="livemostrecent", **kw),
            }
        return fam


class TierMetrics:
    """A tier's series in ``registry`` (None: prometheus_client's default registry)."""

    def __init__(self, store: str, capacity_pages: int, page_bytes: int, registry=None
                 ) -> None:
        if registry is None:
            from prometheus_client import REGISTRY
            registry = REGISTRY
        self._fam = _families_for(registry)
        self.store = store
        self._page_bytes = page_bytes
        self._fallbacks: set[tuple[str, str]] = set()
        self._fam["capacity"].labels(store).set(capacity_pages)
        self._fam["stored"].labels(store).set(0)
        self._stored = 0  # what the stored gauge says now
        # labelled children, looked up once: labels() costs several µs per call on a busy host
        self._children: dict[tuple, object] = {}
        self._ledger = None

    def count(self, amounts: dict) -> None:
        """Feed TierStats.add's amounts into the counters."""
        for key, value in amounts.items():
            where = _COUNTED.get(key)
            if where is not None and value:
                self._child(where[0], where[1]).inc(value)
                if where[1] in _PAGE_BYTES:
                    self._child("bytes", where[1]).inc(value * self._page_bytes)

    def calls(self, op: str, pages: list[int], seconds: list[float]) -> None:
        """Observe calls of ``op`` that have ended: each one's pages and seconds."""
        observe_all(self._child("seconds", op), seconds)
        observe_all(self._child("call_pages", op), pages)

    def _child(self, family: str, *labels: str):
        key = (family, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._fam[family].labels(self.store, *labels)
        return child

    def settle_on_scrape(self, ledger, stored: Callable[[], int]) -> None:
        """Have a scrape of the registry first apply ``ledger`` (the tier's calls' counters)
        and set the stored gauge to ``stored()``."""
        self._ledger, self._stored_now = ledger, stored
        self._fam["settler"].tiers.add(self)

    def bring_up_to_date(self) -> None:
        if self._ledger is not None:
            self._ledger.settle()
            self.stored(self._stored_now())

    def stored(self, pages: int) -> None:
        """Set the pages-stored gauge (skipped when it says so already)."""
        if pages != self._stored:
            self._stored = pages
            self._child("stored").set(pages)

    def fallback(self, kind: str, reason: str) -> None:
        """Mark a fallback as on (it stays on for the tier's life)."""
        self._fallbacks.add((kind, reason))
        self._fam["fallback"].labels(self.store, kind, reason).set(1)

    def close(self) -> None:
        """Remove this tier's series (those it may have made)."""
        f, s = self._fam, self.store
        made = [(f[n], (s, e)) for n in ("pages", "bytes") for e in _EVENTS]
        made += [(f["failures"], (s, op)) for op in ("read", "write")]
        made += [(f[n], (s, op)) for n in ("seconds", "call_pages") for op in ("put", "get")]
        made += [(f["stored"], (s,)), (f["capacity"], (s,))]
        made += [(f["fallback"], (s, kind, reason)) for kind, reason in self._fallbacks]
        for family, labels in made:
            with contextlib.suppress(KeyError):  # never made
                family.remove(*labels)
        self._fam["settler"].tiers.discard(self)
        self._ledger = None
        self._children.clear()
