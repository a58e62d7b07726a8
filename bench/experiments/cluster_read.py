"""A cluster store's aggregate read rate: every node reading every node's pages, against one
node reading only its own, in one call.

``--writers`` processes (4) are the nodes of one cluster store (:mod:`gdskv.cluster`) over
``--dir`` (standing in for the shared mount). Each writes ``--size`` (1 GiB) of distinct pages
to its own namespace. Then, after the slab files are dropped from the page cache
(``posix_fadvise(DONTNEED)``; nothing can be dropped on tmpfs, and the JSON says so):

- **own**: node 0 alone reads its own pages (the single-node tier's read rate);
- **all**: every node at once reads every node's pages (``writers x size`` each), starting
  with the next node's, so the aggregate is ``writers^2 x size`` bytes over the time from the
  first node's start to the last node's end (one host clock).

Each process reads one batch of its own pages before the timed phases (untimed: first-call
costs). Every page read is checksum-verified by the tier and its stamped page number checked here (a
wrong page would be counted in ``wrong_pages``; it must be 0). Reads go into a host buffer
(posix) or a GPU buffer (``--backend kvikio``, one CUDA pool per process).

    python bench/experiments/cluster_read.py --dir /dev/shm --size 64MiB --out cluster.json

Result it produced (bench/RESULTS.md, "Cluster store"), under bench/results/:
``cpu-2026-11-23/cluster/`` (the development machine: /dev/shm and its disk, 64 MiB a node).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import shutil
import tempfile
import time

import experiment_helpers
from gdskv.bench.cache import drop_page_cache, fs_type
from gdskv.config import parse_size

PAGE_ID_BYTES = 8


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="the shared directory (a subdirectory is made "
                    "and removed)")
    ap.add_argument("--out", help="write the JSON results here (also printed)")
    ap.add_argument("--writers", type=int, default=4, help="node processes (default 4)")
    ap.add_argument("--size", default="1GiB", help="bytes of pages each node writes (1GiB)")
    ap.add_argument("--geometry", default="llama3-8b-p16", help="<preset>-p<page tokens> "
                    "(llama3-8b-p16: 2 MiB pages)")
    ap.add_argument("--batch-pages", type=int, default=32, help="pages per read/write call")
    ap.add_argument("--backend", default="posix", choices=("posix", "kvikio"),
                    help="posix (host buffers) or kvikio (a CUDA pool per process)")
    ap.add_argument("--staging-size", default="128MiB", help="staging of each node's own tier "
                    "and of its follower tiers (cluster_peer_staging_size), equal so that own "
                    "and peer reads compare")
    return ap.parse_args(argv)


def _rounding_slack(layout) -> int:
    """Capacity beyond the pages so that none is evicted: a store rounds its capacity down to
    whole stripes, equal over its files (twice the most that rounding can take)."""
    from gdskv.config import TierConfig
    cfg = TierConfig()
    stripe = max(1, cfg.io_chunk_size // layout.slot_bytes) * layout.slot_bytes
    return 2 * cfg.files_per_dir * stripe


def _node(rank: int, args, root: str, barrier, results) -> None:
    """One node: write, wait for all, (rank 0) read own, read everyone's; report timings."""
    import torch

    from gdskv.cluster import ClusterStore
    from gdskv.config import TierConfig

    layout = experiment_helpers.geometry(args.geometry)
    pages_each = parse_size(args.size, what="--size") // layout.page_bytes
    device = torch.device("cuda") if args.backend == "kvikio" else torch.device("cpu")
    staging = parse_size(args.staging_size, what="--staging-size")
    config = TierConfig(directories=(root,), cluster=True, node_id=f"node{rank}",
                        backend=args.backend, staging_size=staging,
                        cluster_peer_staging_size=staging,
                        capacity=pages_each * layout.slot_bytes + _rounding_slack(layout))
    batch = args.batch_pages
    buf = torch.randint(0, 256, (batch, layout.page_bytes), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(rank)).to(device)
    keys = {n: [f"node{n}/page-{j}" for j in range(pages_each)] for n in range(args.writers)}

    def stamp(rows: torch.Tensor, first_id: int) -> None:
        ids = torch.arange(first_id, first_id + rows.shape[0], dtype=torch.int64)
        rows[:, :PAGE_ID_BYTES] = ids.view(torch.uint8).view(-1, PAGE_ID_BYTES).to(device)

    def read(cs, node: int, stop: int = pages_each) -> tuple[int, int]:
        """Read one node's pages batch by batch: (pages hit, pages with a wrong stamp)."""
        hits = wrong = 0
        for b in range(0, min(stop, pages_each), batch):
            ks = keys[node][b:b + batch]
            got = cs.get_pages(ks, [[buf[i]] for i in range(len(ks))])
            hits += sum(got)
            ids = buf[:len(ks), :PAGE_ID_BYTES].cpu().contiguous().view(torch.int64).view(-1)
            want = torch.arange(node * pages_each + b, node * pages_each + b + len(ks))
            wrong += int(((ids != want) & torch.tensor(got)).sum())
        return hits, wrong

    out: dict = {"rank": rank}
    with ClusterStore(layout, config, device=device) as cs:
        t0 = time.perf_counter()
        for b in range(0, pages_each, batch):
            ks = keys[rank][b:b + batch]
            stamp(buf[:len(ks)], rank * pages_each + b)
            assert all(cs.put_pages(ks, [[buf[i]] for i in range(len(ks))])), "put failed"
        out["write_seconds"] = time.perf_counter() - t0
        barrier.wait()                                   # 1: every node wrote
        while True:  # every node's last page visible here (its journal caught up)
            cs.refresh()
            if len(cs.peers) == args.writers - 1 and all(cs.contains(keys[n][-1]) for n in keys):
                break
            time.sleep(0.05)
        out["backend"] = cs.stats()["backend"]
        read(cs, rank, stop=batch)  # untimed warm-up: the process's first read call
        barrier.wait()                                   # 2: every node sees all; parent drops
        barrier.wait()                                   # 3: caches dropped
        if rank == 0:
            t = time.monotonic()
            hits, wrong = read(cs, 0)
            out["own"] = {"start": t, "end": time.monotonic(), "hits": hits, "wrong": wrong}
        barrier.wait()                                   # 4: own read done; parent drops
        barrier.wait()                                   # 5: caches dropped
        t = time.monotonic()
        hits = wrong = 0
        for k in range(args.writers):
            h, w = read(cs, (rank + 1 + k) % args.writers)
            hits, wrong = hits + h, wrong + w
        out["all"] = {"start": t, "end": time.monotonic(), "hits": hits, "wrong": wrong}
        out["peer_hits"] = cs.stats()["cluster"].get("peer_hits", 0)
        out["slabs"] = [f.path for f in cs.store.files]
    results.put(out)


def main(args) -> dict:
    layout = experiment_helpers.geometry(args.geometry)
    pages_each = parse_size(args.size, what="--size") // layout.page_bytes
    if pages_each < 1 or args.writers < 2 or args.batch_pages < 1:
        raise SystemExit("cluster_read: --size must hold one page, --writers >= 2, "
                         "--batch-pages >= 1")
    root = tempfile.mkdtemp(prefix="gdskv-cluster-read-", dir=args.dir)
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(args.writers + 1), ctx.Queue()
    procs = [ctx.Process(target=_node, args=(r, args, root, barrier, results))
             for r in range(args.writers)]
    try:
        for p in procs:
            p.start()
        drops = []
        barrier.wait()  # 1
        barrier.wait()  # 2
        slabs = [os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs
                 if f.startswith("slab-")]
        drops.append(drop_page_cache(slabs))
        barrier.wait()  # 3
        barrier.wait()  # 4
        drops.append(drop_page_cache(slabs))
        barrier.wait()  # 5
        nodes = sorted((results.get(timeout=3600) for _ in procs), key=lambda r: r["rank"])
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        shutil.rmtree(root, ignore_errors=True)
    own = nodes[0]["own"]
    own_bytes = own["hits"] * layout.page_bytes
    start = min(n["all"]["start"] for n in nodes)
    end = max(n["all"]["end"] for n in nodes)
    all_bytes = sum(n["all"]["hits"] for n in nodes) * layout.page_bytes
    own_gbps = own_bytes / (own["end"] - own["start"]) / 1e9
    agg_gbps = all_bytes / (end - start) / 1e9
    return {
        "experiment": "cluster_read", "dir": args.dir, "fs_type": fs_type(args.dir),
        "host": platform.node(), "cpus": os.cpu_count(), "backend": nodes[0]["backend"],
        "geometry": args.geometry, "page_bytes": layout.page_bytes, "writers": args.writers,
        "bytes_per_writer": pages_each * layout.page_bytes, "batch_pages": args.batch_pages,
        "staging_size": args.staging_size, "page_cache_drops": drops,
        "write_seconds": [n["write_seconds"] for n in nodes],
        "own": {"bytes": own_bytes, "seconds": own["end"] - own["start"], "gbps": own_gbps,
                "misses": pages_each - own["hits"], "wrong_pages": own["wrong"]},
        "all": {"bytes": all_bytes, "seconds": end - start, "gbps": agg_gbps,
                "per_node_gbps": [n["all"]["hits"] * layout.page_bytes /
                                  (n["all"]["end"] - n["all"]["start"]) / 1e9 for n in nodes],
                "misses": args.writers ** 2 * pages_each - sum(n["all"]["hits"] for n in nodes),
                "wrong_pages": sum(n["all"]["wrong"] for n in nodes),
                "peer_hits": sum(n["peer_hits"] for n in nodes)},
        "aggregate_over_own": agg_gbps / own_gbps,
    }


def report(r: dict) -> str:
    """The short summary: one node alone, all nodes at once, and the checks."""
    own, every = r["own"], r["all"]
    per_node = ", ".join(f"{g:.2f}" for g in every["per_node_gbps"])
    misses = own["misses"] + every["misses"]
    wrong = own["wrong_pages"] + every["wrong_pages"]
    mib = r["bytes_per_writer"] / 2**20
    return (f"cluster_read on {r['dir']} ({r['fs_type']}), {r['backend']}, {r['writers']} "
            f"nodes x {mib:.0f} MiB, {r['geometry']}\n"
            f"  own (node 0 alone, its pages):  {own['gbps']:.2f} GB/s\n"
            f"  all (every node, every page):   {every['gbps']:.2f} GB/s aggregate "
            f"({r['aggregate_over_own']:.2f}x own); per node {per_node}\n"
            f"  misses {misses}, wrong pages {wrong}")


if __name__ == "__main__":
    result = main(parsed := _args())
    experiment_helpers.print_result(result, parsed.out, report(result))
