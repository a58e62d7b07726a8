"""Child processes of the cluster tests: each runs one node of a cluster store over a directory
standing in for the shared mount, and reports what it saw in a JSON file (pages read bit-exact,
misses, wrong bytes: the parent asserts on them). Page bytes derive from the key
(``reliability_helpers.page_content``), so any process can check any page."""

from __future__ import annotations

import json
import os
import time

from gdskv.cluster import ClusterStore
from reliability_helpers import LAYOUT, SLOT, check_pages, put, small_config


def cluster_config(root: str, node_id: str, **overrides):
    base = dict(cluster=True, node_id=node_id, backend="posix", cluster_discovery_ms=50,
                cluster_peer_staging_size=8 * SLOT, capacity=256 * SLOT)
    base.update(overrides)
    return small_config(root, **base)


def node_keys(node: str, n: int, prefix: str = "page") -> list[str]:
    return [f"{node}/{prefix}-{j}" for j in range(n)]


def dump(path: str, result: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)


def read_until_all(cs: ClusterStore, keys: list[str], wrong: list, seconds: float = 30) -> dict:
    """Read ``keys`` until every one hits (or time runs out); wrong bytes seen are collected."""
    deadline = time.monotonic() + seconds
    while True:
        got = check_pages(cs, keys)
        wrong += got["wrong"]
        if not got["misses"] or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def writer_reader(root: str, node: str, nodes: list[str], per_node: int, started_path: str,
                  result_path: str, barrier) -> None:
    """Write this node's pages in batches, reading the others' between batches; then read
    until every node's pages are here bit-exact; then offer all of them again (dedup)."""
    wrong: list = []
    with ClusterStore(LAYOUT, cluster_config(root, node)) as cs:
        open(started_path, "w").close()
        mine = node_keys(node, per_node)
        others = [k for n in nodes if n != node for k in node_keys(n, per_node)]
        stored = []
        for b in range(0, per_node, 8):
            stored += put(cs, mine[b:b + 8])
            wrong += check_pages(cs, others)["wrong"]  # whatever is visible now must be right
        barrier.wait(timeout=60)
        got = read_until_all(cs, others, wrong)
        own_before = len(cs.own.directory)
        again = put(cs, others + mine)
        stats = cs.stats()
        dump(result_path, {"stored": sum(stored), "missed": got["missed"], "wrong": wrong,
                           "hits": got["hits"], "put_again": sum(again),
                           "own_before": own_before, "own_after": len(cs.own.directory),
                           "namespaces": sorted(stats["cluster"]["namespaces"]),
                           "dedup_skipped": stats["cluster"].get("dedup_skipped", 0),
                           "peer_hits": stats["cluster"].get("peer_hits", 0)})


def churn_writer(root: str, node: str, generation: int, ack_path: str, result_path: str) -> None:
    """Put batches of 4 new pages forever into a small store (LRU reuses slots all the time),
    appending each acknowledged key to ``ack_path`` (fsynced). A restarted writer (generation
    > 0) first reports what it recovered: its pages read back, the last acknowledged batch
    of the killed one among them."""
    with ClusterStore(LAYOUT, cluster_config(root, node, capacity=32 * SLOT)) as cs:
        if generation:
            with open(ack_path) as f:
                acked = f.read().split()
            last = acked[-4:]
            held = [k for k, _, _ in cs.own.directory.ready_items()]
            dump(result_path, {"recovered": len(held), "own": check_pages(cs.own, held),
                               "last_batch": check_pages(cs.own, last)})
        fd = os.open(ack_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        n = 0
        while True:
            keys = node_keys(node, 4, prefix=f"gen{generation}-batch{n}")
            ok = put(cs, keys)
            line = "".join(k + "\n" for k, good in zip(keys, ok) if good)
            os.write(fd, line.encode())
            os.fsync(fd)
            n += 1
            time.sleep(0.005)  # leave the two-core test machine's readers some CPU


def churn_reader(root: str, node: str, ack_path: str, stop_path: str, result_path: str) -> None:
    """Read the writer's most recently acknowledged pages over and over until told to stop:
    hits must be bit-exact (slots are reused under us all the time: those are misses). The
    hits so far per writer generation are in ``result_path + ".progress"`` after each round."""
    wrong: list = []
    hits = {"gen0": 0, "gen1": 0}
    reads = 0
    with ClusterStore(LAYOUT, cluster_config(root, node)) as cs:
        while not os.path.exists(stop_path):
            try:
                with open(ack_path) as f:
                    keys = list(dict.fromkeys(f.read().split()[-24:]))
            except FileNotFoundError:
                keys = []
            if keys:
                got = check_pages(cs, keys)
                wrong += got["wrong"]
                reads += len(keys)
                for k in set(keys) - set(got["missed"]):
                    hits[k.split("/")[1].split("-")[0]] += 1
                dump(result_path + ".progress", hits)
            time.sleep(0.01)
        corrupt = cs.stats()["corrupt_pages"]
    dump(result_path, {"wrong": wrong, "hits": hits, "reads": reads, "corrupt": corrupt})


def stale_reader(root: str, node: str, old: list[str], new: list[str], ready, go_on,
                 result_path: str) -> None:
    """Read the writer's ``old`` pages, stop following its journal, let it overwrite their
    slots with ``new`` pages, read ``old`` again (every slot now holds another page: checksum
    misses, never bytes), then catch up and read ``new``."""
    wrong: list = []
    with ClusterStore(LAYOUT, cluster_config(root, node)) as cs:
        before = read_until_all(cs, old, wrong)
        for tier in cs.peers.values():
            tier.FOLLOW_INTERVAL = 3600  # a reader whose view of the writer is stale
        ready.set()
        go_on.wait(timeout=60)
        stale = check_pages(cs, old)
        wrong += stale["wrong"]
        corrupt = cs.stats()["corrupt_pages"]
        cs.refresh()
        after = read_until_all(cs, new, wrong)
        dump(result_path, {"before": before["hits"], "stale_hits": stale["hits"],
                           "corrupt": corrupt, "after": after["hits"], "wrong": wrong})


def restart_loop(root: str, node: str, seconds: float, result_path: str) -> None:
    """A writer that restarts over and over (open, put one page, read it back, close) for
    ``seconds``, beside a reclaim and a listing of its namespace: every start must succeed
    and see its page. Errors are collected as ``Type: message``."""
    errors: list[str] = []
    starts = hits = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        key = f"{node}/start-{starts}"
        try:
            with ClusterStore(LAYOUT, cluster_config(root, node, capacity=16 * SLOT)) as cs:
                starts += 1
                put(cs, [key])
                hits += check_pages(cs, [key])["hits"]
        except Exception as exc:  # noqa: BLE001 - each one is a failure the parent reports
            errors.append(f"{type(exc).__name__}: {exc}")
        time.sleep(0.002)
    dump(result_path, {"starts": starts, "hits": hits, "errors": errors})


def _cli(argv: list[str]) -> tuple[int | None, str, str]:
    """``gdskv ARGV`` in this process: (exit status or None for an uncaught exception, its
    stderr, the exception as ``Type: message``)."""
    import contextlib
    import io

    from gdskv.cli import main
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            return main(argv), err.getvalue(), ""
    except SystemExit as exc:
        return exc.code, err.getvalue(), ""
    except Exception as exc:  # noqa: BLE001 - an uncaught traceback is what the test counts
        return None, err.getvalue(), f"{type(exc).__name__}: {exc}"


def reclaim_loop(root: str, node: str, writer_pid: int, seconds: float,
                 result_path: str) -> None:
    """``gdskv cluster reclaim NODE --yes`` over and over: each run removes the namespace, finds
    none, or is refused because the writer (``writer_pid``, on this host) runs. Anything else
    (a traceback, another refusal, a pid that is not the writer's) is collected."""
    counts = {"reclaimed": 0, "in_use": 0, "absent": 0}
    tracebacks: list[str] = []
    misleading: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        code, err, exc = _cli(["cluster", "reclaim", node, root, "--yes"])
        if exc:
            tracebacks.append(exc)
        elif code == 0:
            counts["reclaimed"] += 1
        elif "in use" in err and f"pid {writer_pid}" in err:
            counts["in_use"] += 1
        elif "no namespace" in err:
            counts["absent"] += 1
        else:
            misleading.append(err.strip())
    dump(result_path, dict(counts, tracebacks=tracebacks, misleading=misleading))


def list_loop(root: str, seconds: float, result_path: str) -> None:
    """``gdskv cluster list`` over and over: each must exit 0."""
    runs = 0
    failures: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        code, err, exc = _cli(["cluster", "list", root, "--json"])
        runs += 1
        if exc or code != 0:
            failures.append(exc or err.strip())
    dump(result_path, {"runs": runs, "failures": failures})
