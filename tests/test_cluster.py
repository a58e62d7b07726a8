"""The cluster store (gdskv.cluster): several nodes over one shared directory, each writing its
own namespace and reading every other's. The multi-node tests run each node in its own process
(forkserver children with torch preloaded: the same fresh processes as spawn, started in ms),
POSIX backend, over a temporary directory standing in for the shared mount; ``pytest
--shared-dir=/mnt/nfs/...`` runs them over a real shared mount instead. Every page read is
compared with the bytes its key stands for: 0 wrong pages, everywhere."""

from __future__ import annotations

import collections
import fcntl
import json
import os
import re
import signal
import socket
import threading

import pytest
import torch

from gdskv import open_tier
from gdskv.cli import main as gdskv_main
from gdskv.cluster import ClusterStore, default_node_id
from gdskv.config import ConfigError, TierConfig
from gdskv.store import StoreError, StoreLockedError
from gdskv.tier import Tier

import cluster_helpers as ch
from conftest import HAS_CUDA, NEEDS_NIXL, random_pool
from reliability_helpers import (LAYOUT, SLOT, check_pages, forkserver, put, small_config,
                                 wait_for)

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
    with open(path) as f:
        return json.load(f)


def _kinds(messages: list[str]) -> collections.Counter:
    """Messages counted by kind: quoted paths and numbers left out."""
    return collections.Counter(re.sub(r"\d+", "N", re.sub(r"'[^']*'", "'...'", m))[:140]
                               for m in messages)


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



@pytest.mark.parametrize("var", ["GDSKV_CLUSTER_FOLLOW_MS", "GDSKV_CLUSTER_DISCOVERY_MS"])
@pytest.mark.parametrize("value", [str(2 ** 63 - 1), "60001", "0"])
def test_cluster_intervals_are_bounded(var, value):
    """A follow or discovery interval of 2**63-1 ms would never see another node's new pages
    or namespaces: refused, naming the variable, the value and the range."""
    with pytest.raises(ConfigError, match=f"{var}='{value}'.*must be 1..60000 ms"):
        TierConfig.from_env({"GDSKV_CLUSTER": "1", var: value})
    assert getattr(TierConfig.from_env({"GDSKV_CLUSTER": "1", var: "60000"}),
                   var[len("GDSKV_"):].lower()) == 60000


@pytest.mark.parametrize("size", ["4TiB", str(2 ** 63 - 1)])
def test_a_peer_staging_size_that_cannot_fit_is_refused_at_start(shared, size):
    """Each other node's follower tier stages this much: more than the memory there is made
    every peer unreadable, with one INFO line naming staging_size. Refused at start instead,
    naming the variable, the value and the most there is room for; nothing made on disk."""
    cfg = TierConfig.from_env({"GDSKV_CLUSTER_PEER_STAGING_SIZE": size},
                              **{k: v for k, v in vars(ch.cluster_config(shared, "n0")).items()
                                 if k != "cluster_peer_staging_size"})
    with pytest.raises(ConfigError, match=r"cluster_peer_staging_size: a staging buffer of "
                       rf"{cfg.cluster_peer_staging_size} B does not fit .*"
                       r"GDSKV_CLUSTER_PEER_STAGING_SIZE\) below \d+ B"):
        ClusterStore(LAYOUT, cfg)
    assert os.listdir(shared) == []


@pytest.mark.parametrize("node_id", ["a\n", "  ", " n1", "n1\t"])
def test_a_node_id_with_whitespace_is_refused_not_trimmed(node_id):
    with pytest.raises(ConfigError, match=r"GDSKV_NODE_ID=.*cannot name a namespace.*whitespace"):
        TierConfig.from_env({"GDSKV_CLUSTER": "1", "GDSKV_NODE_ID": node_id})
    with pytest.raises(ConfigError, match="whitespace"):
        TierConfig(cluster=True, node_id=node_id)
    assert TierConfig.from_env({"GDSKV_CLUSTER": "1", "GDSKV_NODE_ID": ""}).node_id == ""

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



def _store_files(directory) -> dict:
    """Each file's name and size in a directory (what a refused reclaim must leave as it was)."""
    return {n: os.lstat(os.path.join(directory, n)).st_size for n in os.listdir(directory)}


def test_reclaim_never_follows_links_nor_removes_what_gdskv_did_not_make(shared, tmp_path,
                                                                       capsys):
    """A namespace that is a link to another store is neither listed nor reclaimed (that store
    keeps every file and page); a namespace holding a directory, a link or a FIFO under a
    store file's name is refused in one message naming each, before anything is removed."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with Tier(LAYOUT, small_config(elsewhere)) as other:
        assert all(put(other, ["e0", "e1"]))
    os.symlink(elsewhere, os.path.join(shared, "linked"))
    kept = _store_files(elsewhere)
    assert gdskv_main(["cluster", "list", shared, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [n["node"] for n in listed["nodes"]] == []
    assert "linked" in listed["ignored"][0] and "symbolic link" in listed["ignored"][0]
    with pytest.raises(SystemExit) as refused:
        gdskv_main(["cluster", "reclaim", "linked", shared, "--yes"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "symbolic link" in err and "nothing removed" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert os.path.islink(os.path.join(shared, "linked")) and _store_files(elsewhere) == kept
    with Tier(LAYOUT, small_config(elsewhere)) as other:
        assert check_pages(other, ["e0", "e1"])["hits"] == 2

    with ClusterStore(LAYOUT, ch.cluster_config(shared, "odd")) as odd:
        assert all(put(odd, ["o0"]))
    ns = os.path.join(shared, "odd")
    os.mkdir(os.path.join(ns, "slab-999.bin"))
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x" * 100)
    os.symlink(outside, os.path.join(ns, "slab-998.bin"))
    os.mkfifo(os.path.join(ns, "gdskv-journal.log.tmp"))
    before = _store_files(ns)
    with pytest.raises(SystemExit) as refused:
        gdskv_main(["cluster", "reclaim", "odd", shared, "--yes"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "nothing removed" in err and err.count("\n") == 1
    for name, kind in (("slab-999.bin", "a directory"), ("slab-998.bin", "a symbolic link"),
                       ("gdskv-journal.log.tmp", "a FIFO")):
        assert f"{name}' is {kind}, not a regular file" in err, err
    assert _store_files(ns) == before and outside.read_bytes() == b"x" * 100
    for name in ("slab-999.bin", "slab-998.bin", "gdskv-journal.log.tmp"):
        p = os.path.join(ns, name)
        os.rmdir(p) if name == "slab-999.bin" else os.unlink(p)
    with ClusterStore(LAYOUT, ch.cluster_config(shared, "odd")) as odd:  # its pages are there
        assert check_pages(odd, ["o0"])["hits"] == 1
    assert gdskv_main(["cluster", "reclaim", "odd", shared, "--yes"]) == 0
    assert "odd" not in os.listdir(shared)


def test_a_namespace_that_is_a_link_is_not_written_through(shared, tmp_path):
    """This node's own namespace must be a directory of its own: the other nodes never read
    through a link (and reclaim refuses one)."""
    target = tmp_path / "target"
    target.mkdir()
    os.symlink(target, os.path.join(shared, "me"))
    with pytest.raises(StoreError, match="not a directory of its own.*link"):
        ClusterStore(LAYOUT, ch.cluster_config(shared, "me"))
    assert os.listdir(target) == []


def test_starts_wait_for_reclaims_and_reclaims_for_starts(shared, capsys, monkeypatch):
    """The cluster start lock, deterministically: a writer does not create or open its
    namespace while a reclaim or listing holds the lock; a reclaim (or a listing's writer
    probe) is refused, after its wait, while a writer is starting; nothing is removed."""
    from gdskv import namespaces
    with ClusterStore(LAYOUT, ch.cluster_config(shared, "old")) as old:
        assert all(put(old, ["o0"]))
    fd = os.open(os.path.join(shared, namespaces.START_LOCK), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # what a reclaim or a listing holds
        opened = []
        starter = threading.Thread(target=lambda: opened.append(
            ClusterStore(LAYOUT, ch.cluster_config(shared, "new"))))
        starter.start()
        starter.join(0.5)
        assert starter.is_alive() and "new" not in os.listdir(shared)
        fcntl.flock(fd, fcntl.LOCK_UN)
        starter.join(30)
        assert not starter.is_alive() and "new" in os.listdir(shared)
        opened[0].close()

        fcntl.flock(fd, fcntl.LOCK_SH)  # what a starting writer holds
        monkeypatch.setattr(namespaces, "RECLAIM_WAIT_S", 0.2)
        monkeypatch.setattr(namespaces, "LIST_WAIT_S", 0.2)
        with pytest.raises(SystemExit) as refused:
            gdskv_main(["cluster", "reclaim", "old", shared, "--yes"])
        err = capsys.readouterr().err
        assert refused.value.code == 2 and "kept starting" in err and "nothing removed" in err
        assert gdskv_main(["cluster", "list", shared, "--json"]) == 0
        listed = json.loads(capsys.readouterr().out)
        assert "kept starting" in listed["writers_unknown"]
        assert {n["node"]: n["writer_running"] for n in listed["nodes"]} == \
            {"new": None, "old": None}
        assert listed["nodes"][1]["pages"] == 1
    finally:
        os.close(fd)
    assert gdskv_main(["cluster", "reclaim", "old", shared, "--yes"]) == 0
    assert sorted(os.listdir(shared)) == [namespaces.START_LOCK, "new"]

def test_reclaim_and_listings_racing_a_restarting_writer(shared, tmp_path):
    """A writer restarts in a loop under one node id while another process reclaims its
    namespace in a loop and a third lists the cluster in a loop. Starts and reclaims exclude
    each other: every start succeeds and reads back its page, every reclaim removes the whole
    namespace or is refused naming the writer's pid, and no listing or reclaim fails."""
    ctx = forkserver()
    seconds = 4.0
    out = {n: str(tmp_path / f"{n}.json") for n in ("writer", "reclaim", "list")}
    writer = ctx.Process(target=ch.restart_loop, name="writer",
                         args=(shared, "racer", seconds, out["writer"]))
    writer.start()
    others = [ctx.Process(target=ch.reclaim_loop, name="reclaim",
                          args=(shared, "racer", writer.pid, seconds, out["reclaim"])),
              ctx.Process(target=ch.list_loop, name="list", args=(shared, seconds, out["list"]))]
    for p in others:
        p.start()
    _join([writer] + others)
    w, r, ls = (_json(out[n]) for n in ("writer", "reclaim", "list"))
    print(f"race over {seconds} s: writer {w['starts']} starts, {len(w['errors'])} errors; "
          f"reclaim {r['reclaimed']} removed, {r['in_use']} refused (writer running), "
          f"{r['absent']} absent, {len(r['tracebacks'])} tracebacks, "
          f"{len(r['misleading'])} misleading; list {ls['runs']} runs, "
          f"{len(ls['failures'])} failures")
    for what, msgs in (("writer", w["errors"]), ("reclaim traceback", r["tracebacks"]),
                       ("reclaim refusal", r["misleading"]), ("list", ls["failures"])):
        for kind, n in _kinds(msgs).most_common():
            print(f"  {what}: {n} x {kind}")
    assert w["errors"] == [], w["errors"][:5]
    assert r["tracebacks"] == [], r["tracebacks"][:5]
    assert r["misleading"] == [], r["misleading"][:5]
    assert ls["failures"] == [], ls["failures"][:5]
    assert w["hits"] == w["starts"] > 0
    assert r["reclaimed"] > 0 and ls["runs"] > 0
