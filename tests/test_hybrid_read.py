"""bench/experiments/hybrid_read.py runs as the GPU machine will run it (a script, no sglang)
and reports both reads, verified."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("store", ["kv-page", "own"])
def test_hybrid_read_runs_and_reports(tmp_path, store):
    out = tmp_path / "hybrid.json"
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "experiments",
                                                        "hybrid_read.py"),
                           "--dir", str(tmp_path), "--pages", "9", "--batch-pages", "2", "--passes", "2",
                           "--staging-size", "20MiB", "--sidecar-store", store, "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["sidecar"] == "indexer" and r["sidecar_page_bytes"] == 61 * 132 * 64
    assert r["sidecar_store"] == store
    # kv-page: one read of whole pages (KV + indexer) in the hybrid tier, 2 pages a pass (the
    # other pair plain reads); own: its own pages, 2 + 2 in the first pass, 2 + 2 + 1 in the next
    assert r["sidecar_pages_read_in_place"] == (4 if store == "kv-page" else 9)
    # what the CPU and the storage spent per byte are reported for both reads
    assert r["cpu_per_byte_hybrid_over_kv"] > 0
    assert {"kv_storage_bytes_per_byte", "kv+sidecar_storage_bytes_per_byte"} <= set(r)
    # four 2-page batches and a 1-page tail (no pair) a pass; kv-page: pairs alternate gdskv and
    # plain preadv of the same slots (one store to compare), swapped in the next pass
    batches = [[(b["engine"], b["kind"]) for b in p["batches"]] for p in r["passes"]]
    if store == "kv-page":
        assert batches[0] == [("gdskv", "kv"), ("gdskv", "kv+sidecar"), ("raw", "kv"),
                              ("raw", "kv+sidecar"), ("gdskv", "kv")]
        assert batches[1] == [("raw", "kv+sidecar"), ("raw", "kv"), ("gdskv", "kv+sidecar"),
                              ("gdskv", "kv"), ("raw", "kv+sidecar")]
        assert r["raw_pairs"] == 2 and len(r["raw_hybrid_over_kv_per_pair"]) == 2
        assert "plain preadv of the same slots" in proc.stdout
        lo, hi = r["raw_sidecar_total_time_fraction_bootstrap"]
        assert lo <= r["raw_sidecar_total_time_fraction"] <= hi
        assert r["gdskv_kv_over_raw_kv"] > 0
    else:
        assert batches[0] == [("gdskv", "kv"), ("gdskv", "kv+sidecar")] * 2 + [("gdskv", "kv")]
        assert "raw_pairs" not in r
    assert r["pairs"] == 2 * (1 if store == "kv-page" else 2)
    # totals over the pairs and medians, each inside its bootstrap range
    for name in ("sidecar_total_time_fraction", "sidecar_time_fraction"):
        lo, hi = r[f"{name}_bootstrap"]
        assert lo <= r[name] <= hi
    kv_s, hy_s = zip(*r["pair_seconds"])
    assert abs(r["sidecar_total_time_fraction"] - (sum(hy_s) / sum(kv_s) - 1)) < 1e-9
    assert r["kv_GBps"] > 0 and r["kv+sidecar_GBps"] > 0
    assert "KV + indexer" in proc.stdout
    assert os.listdir(tmp_path) == ["hybrid.json"]  # its store directories are gone


def test_a_kv_store_with_riders_keeps_o_direct_except_in_memory():
    """The KV store that carries the indexer takes the KV tier's O_DIRECT setting (its riders'
    unaligned pages go through scratch rows); under ``auto`` on a file system held in memory
    (O_DIRECT bypasses nothing there) it is buffered, so the riders move in place too."""
    from unittest import mock

    from gdskv.adapters.sglang import sidecar
    from gdskv.config import DirectIO, TierConfig
    from gdskv.layout import BytePageLayout

    def cfg(rider_bytes, direct_io, in_memory):
        base = TierConfig(directories=("/kv",), capacity=1 << 30, direct_io=direct_io)
        layout = BytePageLayout(page_bytes=(1 << 20) + rider_bytes, kind="sglang/test")
        with mock.patch.object(sidecar, "memory_backed", lambda d: in_memory):
            return sidecar.kv_slot_config(base, layout, 1 << 20, [rider_bytes],
                                          directories=("/side",))

    indexer = 61 * 132 * 64
    assert cfg(indexer, DirectIO.AUTO, in_memory=False).direct_io == DirectIO.AUTO
    assert cfg(indexer, DirectIO.AUTO, in_memory=True).direct_io == DirectIO.OFF
    assert cfg(indexer, DirectIO.ON, in_memory=True).direct_io == DirectIO.ON
    assert cfg(8 << 10, DirectIO.AUTO, in_memory=True).direct_io == DirectIO.AUTO
    c = cfg(indexer, DirectIO.AUTO, in_memory=False)
    assert c.directories == ("/side",) and c.capacity == (1 << 30) * ((1 << 20) + indexer) >> 20


def test_sidecar_pages_off_the_4k_grid_use_buffered_io_unless_asked():
    """A sidecar page that is not whole 4 KiB blocks sits at unaligned addresses of SGLang's
    page-first host buffer: with the KV tier's ``auto`` its store is buffered (in place),
    an explicit choice is kept, and a 4 KiB-multiple page keeps the KV tier's setting."""
    from gdskv.adapters.sglang.sidecar import store_config
    from gdskv.config import DirectIO, TierConfig
    from gdskv.layout import BytePageLayout

    def cfg(page_bytes, direct_io):
        base = TierConfig(directories=("/kv",), capacity=1 << 30, direct_io=direct_io)
        return store_config(base, BytePageLayout(page_bytes=page_bytes, kind="sglang/test"), directories=("/side",),
                            kv_capacity=base.capacity, pool_host_bytes=1, kv_host_bytes=8)

    assert cfg(61 * 132 * 64, DirectIO.AUTO).direct_io == DirectIO.OFF
    assert cfg(61 * 132 * 64, DirectIO.ON).direct_io == DirectIO.ON
    assert cfg(8 << 10, DirectIO.AUTO).direct_io == DirectIO.AUTO
    assert cfg(8 << 10, DirectIO.OFF).direct_io == DirectIO.OFF
