"""Prometheus metrics (gdskv/metrics.py): a tier's gdskv_* series, read by scraping the
registry, on a registry passed in and on the default one; removed at close."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gdskv.tier import Tier
from conftest import fail_io
from reliability_helpers import LAYOUT, PAGE, put, read_back, slot_location, small_config


def scrape(registry) -> dict:
    """{(sample name, frozenset(labels)): value} from the registry's text exposition."""
    text = generate_latest(registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples, name, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_counters_histograms_gauges(tmp_path):
    reg = CollectorRegistry()
    store = str(tmp_path)
    with Tier(LAYOUT, small_config(tmp_path), device="cpu", metrics_registry=reg) as tier:
        assert all(put(tier, [f"k{i}" for i in range(10)]))
        path, off = slot_location(tier, "k3")
        with open(path, "r+b") as f:
            f.seek(off + 5)
            b = f.read(1)
            f.seek(off + 5)
            f.write(bytes([b[0] ^ 1]))
        hits, _ = read_back(tier, [f"k{i}" for i in range(10)] + ["nope"])
        assert sum(hits) == 9
        tier.evict(["k0", "k1"])
        s = scrape(reg)
        assert value(s, "gdskv_pages_total", store=store, event="put") == 10
        assert value(s, "gdskv_pages_total", store=store, event="got") == 9
        assert value(s, "gdskv_pages_total", store=store, event="missed") == 2
        assert value(s, "gdskv_pages_total", store=store, event="corrupt") == 1
        assert value(s, "gdskv_pages_total", store=store, event="evicted") == 2
        for event, pages in (("put", 10), ("got", 9), ("missed", 2), ("corrupt", 1),
                             ("evicted", 2)):
            assert value(s, "gdskv_bytes_total", store=store, event=event) == pages * PAGE
        assert value(s, "gdskv_call_seconds_count", store=store, op="put") == 1
        assert value(s, "gdskv_call_seconds_count", store=store, op="get") == 1
        assert value(s, "gdskv_call_pages_sum", store=store, op="get") == 11
        assert value(s, "gdskv_call_pages_bucket", store=store, op="put", le="16.0") == 1
        assert value(s, "gdskv_call_pages_bucket", store=store, op="put", le="8.0") == 0
        assert value(s, "gdskv_capacity_pages", store=store) == tier.store.num_slots
        # stored now (a scrape reads the count): 10, less k3 (the get dropped it), k0 and k1
        assert value(s, "gdskv_pages_stored", store=store) == 7
        o_direct = tier.stats()["o_direct"]
        fallback = [k for k in s if k[0] == "gdskv_fallback"]
        assert bool(fallback) != o_direct  # O_DIRECT refused (tmpfs): a fallback with reason
    assert not [k for k in scrape(reg) if dict(k[1]).get("store") == store]  # removed


def test_failed_io_counted(tmp_path, monkeypatch):
    reg = CollectorRegistry()
    with Tier(LAYOUT, small_config(tmp_path), device="cpu", metrics_registry=reg) as tier:
        assert all(put(tier, ["a"]))
        with monkeypatch.context() as m:
            fail_io(m, tier.backend, "read")
            assert read_back(tier, ["a"])[0] == [False]
        s = scrape(reg)
        assert value(s, "gdskv_io_failures_total", store=str(tmp_path), op="read") == 1


def test_default_registry_and_two_tiers(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    with Tier(LAYOUT, small_config(a), device="cpu") as ta, \
            Tier(LAYOUT, small_config(b), device="cpu") as tb:
        put(ta, ["x"])
        put(tb, ["y", "z"])
        s = scrape(REGISTRY)
        assert value(s, "gdskv_pages_total", store=str(a), event="put") == 1
        assert value(s, "gdskv_pages_total", store=str(b), event="put") == 2


def test_a_new_registry_at_a_dead_ones_address_gets_its_own_series(tmp_path):
    """The metric families are kept per registry object: a registry made where a collected one
    lived (CPython reuses the address, so the same id()) gets series of its own, not the dead
    one's (which made test_failed_io_counted fail now and then in the full suite)."""
    import gc
    for i in range(20):
        store = tmp_path / str(i)
        store.mkdir()
        reg = CollectorRegistry()
        with Tier(LAYOUT, small_config(store), device="cpu", metrics_registry=reg) as tier:
            assert all(put(tier, ["a"]))
            assert value(scrape(reg), "gdskv_pages_total", store=str(store), event="put") == 1
        del tier, reg
        gc.collect()


@pytest.mark.parametrize("kind", ["seconds", "pages"])
def test_observe_all_equals_observing_one_by_one(kind):
    """A settle's observations applied as one update (metrics.observe_all) expose what
    observing them one at a time would: every bucket's count, the count and the sum. Values
    on the bounds, between them, below the first and past the last."""
    from prometheus_client import Histogram

    from gdskv import metrics
    bounds = metrics._SECOND_BUCKETS if kind == "seconds" else metrics._PAGE_BUCKETS
    values = [b for b in bounds] + [b * 0.999 for b in bounds] + [b * 1.5 for b in bounds]
    values += [0.0, bounds[-1] * 10, bounds[0] / 7]
    exposed = []
    for bulk in (True, False):
        reg = CollectorRegistry()
        h = Histogram("h", "h", ["op"], buckets=bounds, registry=reg).labels("get")
        h.observe(bounds[2])  # (a value held before the update)
        if bulk:
            metrics.observe_all(h, values)
        else:
            for v in values:
                h.observe(v)
        exposed.append(scrape(reg))
    bulk, single = exposed
    assert bulk.keys() == single.keys()
    for name, labels in single:
        if name == "h_sum":
            assert bulk[name, labels] == pytest.approx(single[name, labels], rel=1e-12)
        elif name != "h_created":
            assert bulk[name, labels] == single[name, labels], (name, dict(labels))
    assert single["h_count", frozenset({("op", "get")})] == len(values) + 1


def test_observe_all_without_the_histograms_internals():
    """Where a histogram has not the value holders observe_all updates, it observes each."""
    from gdskv import metrics

    class Plain:
        def __init__(self):
            self.seen = []

        def observe(self, v):
            self.seen.append(v)
    h = Plain()
    metrics.observe_all(h, [3, 1, 2])
    assert h.seen == [3, 1, 2]
    metrics.observe_all(h, [])
    assert h.seen == [3, 1, 2]
