"""The cluster store (gdskv.cluster): several nodes over one shared directory, each writing its
own namespace and reading every other's. The multi-node tests run each node in its own process
(forkserver children with torch preloaded: the same fresh processes as spawn, started in ms),
POSIX backend, over a temporary directory standing in for the shared mount; ``pytest
--shared-dir=/mnt/nfs/...`` runs them over a real shared mount instead. Every page read is
compared with the bytes its key stands for: 0 wrong pages, everywhere."""

from __future__ import annotations

import os
import re
import signal
import socket

import pytest
import torch

from gdskv import open_tier
from gdskv.cli import main as gdskv_main
from gdskv.cluster import ClusterStore, default_node_id
from gdskv.config import ConfigError, TierConfig
from gdskv.store import StoreLockedError
from gdskv.tier import Tier

import cluster_helpers as ch
from conftest import HAS_CUDA, NEEDS_NIXL, random_pool
from reliability_helpers import LAYOUT, SLOT, check_pages, forkserver, put, wait_for

NODES = ["node0", "node1", "node2", "node3"]


@pytest.fixture
def shared(request, tmp_path):
    """The directory the nodes share: a new one under --shared-dir when given (a real network
    mount; removed afterwards), else a temporary directory."""
    base = request.config.getoption("--shared-dir")
    if base is None:
        root = tmp_path / "shared"
        root.mkdir()
        yield str(root)
        return
    import shutil
    import tempfile
    root = tempfile.mkdtemp(prefix="gdskv-cluster-", dir=base)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _json(path):
    import json
    with open(path) as f:
        return json.load(f)


def _join(procs) -> None:
    for p in procs:
        p.join(90)
        assert p.exitcode == 0, f"{p.name} exited with {p.exitcode}"


# -- several processes ---------------------------------------------------------------------------
def test_four_writers_read_each_others_pages_and_a_late_node_is_found(shared, tmp_path):
    """Nodes 0-2 write and read concurrently; node 3's namespace appears only once they run.
    Each reads all others' pages bit-exact; offering them all again stores nothing (dedup)."""
    ctx = forkserver()
    per_node = 24
    barrier = ctx.Barrier(len(NODES))
    started = {n: str(tmp_path / f"{n}.started") for n in NODES}
    results = {n: str(tmp_path / f"{n}.json") for n in NODES}

    def start(n):
        p = ctx.Process(target=ch.writer_reader, name=n, args=(
            shared, n, NODES, per_node, started[n], results[n], barrier))
        p.start()
        return p

    procs = [start(n) for n in NODES[:3]]
    wait_for(lambda: all(os.path.exists(started[n]) for n in NODES[:3]), 60, "nodes 0-2")
    assert "node3" not in os.listdir(shared)
    procs.append(start("node3"))
    _join(procs)
    for n in NODES:
        r = _json(results[n])
        assert r["stored"] == per_node
        assert r["wrong"] == [], f"{n} read wrong bytes: {r['wrong'][:3]}"
        assert r["missed"] == [] and r["hits"] == 3 * per_node, n
        assert r["namespaces"] == [m for m in NODES if m != n]
        assert r["peer_hits"] >= 3 * per_node
        # dedup: every page offered again is acknowledged and none is stored a second time
        assert r["put_again"] == 4 * per_node
        assert r["own_after"] == r["own_before"] == per_node
        assert r["dedup_skipped"] == 3 * per_node


def test_writer_killed_mid_write_and_restarted(shared, tmp_path):
    """A writer putting into a small store (slots reused all the time) is SIGKILLed and
    restarted under the same node id while three other nodes read its pages: it recovers its
    namespace, the readers go on reading the new pages, and no one is ever served a wrong page."""
    ctx = forkserver()
    ack, stop = str(tmp_path / "acked"), str(tmp_path / "stop")
    readers = [ctx.Process(target=ch.churn_reader, name=f"reader{i}", args=(
        shared, f"reader{i}", ack, stop, str(tmp_path / f"reader{i}.json"))) for i in range(3)]

    def readers_hit(gen: str) -> bool:
        """Every reader has read at least one page of this writer generation."""
        try:
            return all(_json(str(tmp_path / f"reader{i}.json.progress"))[gen] > 0
                       for i in range(3))
        except (FileNotFoundError, ValueError):
            return False

    def acked() -> int:
        try:
            with open(ack) as f:
                return len(f.read().split())
        except FileNotFoundError:
            return 0

    def writer(gen: int):
        p = ctx.Process(target=ch.churn_writer, name=f"writer{gen}", args=(
            shared, "writer", gen, ack, str(tmp_path / f"writer{gen}.json")))
        p.start()
        return p

    for r in readers:
        r.start()
    first = writer(0)
    try:
        wait_for(lambda: acked() >= 120 and readers_hit("gen0"), 60,
                 "the first writer's pages, read by every reader")
        os.kill(first.pid, signal.SIGKILL)
        first.join(10)
        assert first.exitcode == -signal.SIGKILL
        n_first = acked()
        second = writer(1)
        wait_for(lambda: acked() >= n_first + 120 and readers_hit("gen1"), 60,
                 "the restarted writer's pages, read by every reader")
        with open(stop, "w"):
            pass
        _join(readers)
    finally:
        for p in [first] + ([second] if "second" in locals() else []) + readers:
            if p.is_alive():
                p.kill()
    rec = _json(str(tmp_path / "writer1.json"))
    assert rec["recovered"] > 0 and rec["own"]["misses"] == 0 and rec["own"]["wrong"] == []
    assert rec["last_batch"]["hits"] == 4  # acknowledged just before the kill: recovered
    for i in range(3):
        r = _json(str(tmp_path / f"reader{i}.json"))
        assert r["wrong"] == [], f"reader{i} was served wrong bytes: {r['wrong'][:3]}"
        assert r["hits"]["gen0"] > 0 and r["hits"]["gen1"] > 0, r


def test_slot_reused_under_a_remote_reader_is_a_miss(shared, tmp_path):
    """A reader on another node still maps old pages to slots the writer has since filled
    with other pages: each read fails its checksum (a miss), never returns the new bytes."""
    ctx = forkserver()
    ready, go_on = ctx.Event(), ctx.Event()
    old, new = ch.node_keys("writer", 16, "old"), ch.node_keys("writer", 16, "new")
    with ClusterStore(LAYOUT, ch.cluster_config(shared, "writer", capacity=16 * SLOT)) as w:
        assert all(put(w, old))
        reader = ctx.Process(target=ch.stale_reader, args=(
            shared, "reader", old, new, ready, go_on, str(tmp_path / "reader.json")))
        reader.start()
        assert ready.wait(60)
        assert all(put(w, new))  # the store holds 16 slots: every old page's slot is reused
        assert check_pages(w, old)["hits"] == 0
        go_on.set()
        _join([reader])
    r = _json(str(tmp_path / "reader.json"))
    assert r["before"] == 16 and r["after"] == 16
    assert r["stale_hits"] == 0 and r["corrupt"] == 16 and r["wrong"] == []


# -- one process, several nodes (each namespace is locked by its own writer tier) ---------------
def test_pool_calls_route_each_page_to_the_node_holding_it(shared):
    """put/get on an engine KV pool: a get mixing pages of two nodes and a missing one
    scatters each stored page into its own token slots."""
    pool = random_pool(LAYOUT, 64, seed=1)
    ps = LAYOUT.page_size
    # a CPU pool, so staging stays on the CPU where a GPU exists too (the kvikio variant below
    # covers CUDA pools)
    with ClusterStore(LAYOUT, ch.cluster_config(shared, "a"), device="cpu") as a, \
            ClusterStore(LAYOUT, ch.cluster_config(shared, "b"), device="cpu") as b:
        assert a.put(["p0", "p2"], pool, torch.arange(0, 2 * ps)) == [True, True]
        assert b.put(["p1"], pool, torch.arange(2 * ps, 3 * ps)) == [True]
        a.refresh()
        assert a.match_prefix(["p0", "p1", "p2", "p9"]) == 3
        out = tuple(torch.zeros_like(t) for t in pool)
        slots = torch.arange(10 * ps, 14 * ps)
        assert a.get(["p0", "p1", "p9", "p2"], out, slots) == [True, True, False, True]
        src = {"p0": range(0, ps), "p2": range(ps, 2 * ps), "p1": range(2 * ps, 3 * ps)}
        for j, key in enumerate(["p0", "p1", "p9", "p2"]):
            if key in src:
                for t, o in zip(pool, out):
                    # compared as bits: random bf16 bits hold NaNs, which never compare equal
                    assert torch.equal(o[:, (10 + j) * ps:(11 + j) * ps].view(torch.int16),
                                       t[:, list(src[key])].view(torch.int16))
        assert a.get_async(["p1"], out, slots[:ps]).result() == [True]
        assert a.stats()["cluster"]["peer_hits"] == 2


@pytest.mark.parametrize("backend", [
    pytest.param("nixl", marks=NEEDS_NIXL),
    pytest.param("kvikio", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not HAS_CUDA, reason="kvikio backend needs a CUDA device (none here)")])])
def test_nodes_on_other_backends_read_each_other(shared, backend):
    """The same routing with each node's tiers (own and followers) on NIXL, or on kvikio with
    the KV pool on the GPU: bit-exact across nodes."""
    device = "cuda" if backend == "kvikio" else "cpu"
    pool = random_pool(LAYOUT, 64, seed=2, device=device)
    ps = LAYOUT.page_size
    with ClusterStore(LAYOUT, ch.cluster_config(shared, "a", backend=backend),
                      device=device) as a, \
            ClusterStore(LAYOUT, ch.cluster_config(shared, "b", backend=backend),
                         device=device) as b:
        assert a.put(["q0", "q1"], pool, torch.arange(0, 2 * ps, device=device)) == [True] * 2
        b.refresh()
        out = tuple(torch.zeros_like(t) for t in pool)
        slots = torch.arange(8 * ps, 10 * ps, device=device)
        assert b.get(["q1", "q0"], out, slots) == [True, True]
        for t, o in zip(pool, out):
            assert torch.equal(o[:, 8 * ps:10 * ps].view(torch.int16),
                               t[:, list(range(ps, 2 * ps)) + list(range(ps))].view(torch.int16))
        assert b.peers["a"].stats()["backend"] == backend


def test_dedup_off_stores_own_copies_and_pins_name_the_holder(shared):
    with ClusterStore(LAYOUT, ch.cluster_config(shared, "a")) as a, \
            ClusterStore(LAYOUT, ch.cluster_config(shared, "b", cluster_dedup=False)) as b:
        assert all(put(a, ["x", "y"]))
        b.refresh()
        assert all(put(b, ["x"]))
        assert [k for k, _, _ in b.own.directory.ready_items()] == ["x"]
        handles = b.pin(["x", "y", "z"])
        assert handles[0][0] == "b" and handles[1][0] == "a" and handles[2] is None
        assert check_pages(b, ["x", "y"])["hits"] == 2
        b.unpin([h for h in handles if h is not None])
        assert b.evict(["x", "y"]) == 1  # only its own copy; y is a's
        assert check_pages(b, ["x", "y"])["hits"] == 2  # now both from a


def test_a_reclaimed_namespace_is_closed_and_its_pages_miss(shared, capsys):
    with ClusterStore(LAYOUT, ch.cluster_config(shared, "gone")) as gone:
        assert all(put(gone, ["g0", "g1"]))
    with ClusterStore(LAYOUT, ch.cluster_config(shared, "live")) as live:
        assert check_pages(live, ["g0", "g1"])["hits"] == 2  # a vanished node stays readable
        assert gdskv_main(["cluster", "list", shared, "--json"]) == 0
        listed = capsys.readouterr().out
        assert '"gone"' in listed and '"live"' in listed
        # the live node's writer lock is held: refused, nothing removed
        with pytest.raises(SystemExit) as held:
            gdskv_main(["cluster", "reclaim", "live", shared, "--yes"])
        assert held.value.code == 2 and "live" in os.listdir(shared)
        assert "in use" in capsys.readouterr().err
        assert gdskv_main(["cluster", "reclaim", "gone", shared, "--yes"]) == 0
        assert "gone" not in os.listdir(shared)
        live.discover()
        assert "gone" not in live.peers
        assert check_pages(live, ["g0", "g1"])["misses"] == 2


def test_namespaces_of_another_layout_are_skipped(shared):
    other = LAYOUT.__class__(num_layers=2, page_size=4, head_dim=48, model_name="other")
    with ClusterStore(other, ch.cluster_config(shared, "other-model")), \
            ClusterStore(LAYOUT, ch.cluster_config(shared, "mine")) as mine:
        assert mine.peers == {}
        assert mine.stats()["cluster"]["namespaces"] == {}


# -- configuration -------------------------------------------------------------------------------
def test_node_id_and_cluster_options_are_checked():
    with pytest.raises(ConfigError, match="node_id: 'a/b'"):
        TierConfig(cluster=True, node_id="a/b")
    with pytest.raises(ConfigError, match="node_id: '..'"):
        TierConfig(cluster=True, node_id="..")
    with pytest.raises(ConfigError, match="cluster is off"):
        TierConfig(node_id="n1")
    with pytest.raises(ConfigError, match="GDSKV_CLUSTER='maybe'"):
        TierConfig.from_env({"GDSKV_CLUSTER": "maybe"})
    with pytest.raises(ConfigError, match="cluster: reading other nodes' pages needs verify"):
        TierConfig(cluster=True, verify=False)
    with pytest.raises(ConfigError, match="cluster_discovery_ms"):
        TierConfig(cluster=True, cluster_discovery_ms=0)
    cfg = TierConfig.from_env({"GDSKV_CLUSTER": "1", "GDSKV_NODE_ID": "host7-gpu3"})
    assert cfg.cluster and cfg.node_id == "host7-gpu3"


def test_tier_refuses_a_cluster_config_and_open_tier_picks(shared):
    cfg = ch.cluster_config(shared, "n0")
    with pytest.raises(ConfigError, match="open_tier"):
        Tier(LAYOUT, cfg)
    with open_tier(LAYOUT, cfg) as cs:
        assert isinstance(cs, ClusterStore) and cs.node_id == "n0"
    with open_tier(LAYOUT, cfg.replace(cluster=False, node_id="",
                                       directories=(os.path.join(shared, "n0"),))) as t:
        assert isinstance(t, Tier)


def test_a_taken_node_id_is_one_clear_error(shared):
    with ClusterStore(LAYOUT, ch.cluster_config(shared, "twin")):
        with pytest.raises(StoreLockedError, match="node id 'twin' is in use.*GDSKV_NODE_ID"):
            ClusterStore(LAYOUT, ch.cluster_config(shared, "twin"))


def test_missing_shared_directory_is_refused(tmp_path):
    with pytest.raises(OSError, match="does not exist.*mount it"):
        ClusterStore(LAYOUT, ch.cluster_config(str(tmp_path / "nope"), "n0"))


def test_default_node_id_is_the_host_and_the_engine_ranks():
    host = socket.gethostname().split(".")[0]
    node = default_node_id("dp1", device="cpu")
    # a process that has started CUDA (earlier tests on a GPU machine) also names its GPU
    assert re.fullmatch(re.escape(host[:8]) + r".*-dp1(-gpu[A-Za-z0-9._-]+)?", node), node


def test_reclaim_refuses_foreign_files_and_unknown_nodes(shared, capsys):
    with ClusterStore(LAYOUT, ch.cluster_config(shared, "old")) as old:
        assert all(put(old, ["o0"]))
    assert gdskv_main(["cluster", "list", shared, "--json"]) == 0
    assert '"writer_running": false' in capsys.readouterr().out
    keep = os.path.join(shared, "old", "notes.txt")
    with open(keep, "w") as f:
        f.write("an operator's file")
    for argv, says in ((["cluster", "reclaim", "old", shared, "--yes"], "did not make"),
                       (["cluster", "reclaim", "nobody", shared, "--yes"], "no namespace"),
                       (["cluster", "reclaim", "../old", shared, "--yes"], "node_id")):
        with pytest.raises(SystemExit) as refused:
            gdskv_main(argv)
        assert refused.value.code == 2 and says in capsys.readouterr().err
    assert os.path.exists(keep) and len(os.listdir(os.path.join(shared, "old"))) > 1
