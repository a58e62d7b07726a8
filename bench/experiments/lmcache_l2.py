"""gdskv against LMCache's own L2 adapters, measured by LMCache's own `lmcache bench l2`.

Each (medium, object size, --in-flight, adapter) runs the bench twice in fresh processes:
``--only store``, then the page cache of every file under the adapter's directory is dropped
(posix_fadvise DONTNEED; on /dev/shm there is no page cache to drop: the medium is memory), then
``--only load`` on the same keys (gdskv's second process also recovers its store from the
journal). Run in .venv-lmcache (tests/run_lmcache.sh builds it):

    .venv-lmcache/bin/python bench/experiments/lmcache_l2.py --media /dev/shm /var/tmp \
        --out bench/results/cpu-2026-11-23/lmcache

Writes one JSON per bench run and results.md (MB/s as the bench reports, MB = 1e6 B).
``gdskv staged sync=none`` is gdskv with ``in_place=false`` (objects through the staging buffer,
the path before in-place host I/O), for a before/after in one run.

Result it produced: ``cpu-2026-11-23/lmcache/results.md`` (bench/RESULTS.md, LMCache L2)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

#: `lmcache bench l2` as a module of this interpreter (works where lmcache was installed with
#: --target and has no `lmcache` script on the PATH, as on the GPU machine)
BENCH = [sys.executable, "-m", "lmcache.cli.main"]


def adapters(directory: str, object_bytes: int, keys: int, in_flight: int) -> dict[str, dict]:
    # warm-up + 3 measured rounds, and room: each object takes a slot (object + its 4 KiB
    # trailer) and the store uses its capacity in whole stripes, as many per slab file, so a
    # tight capacity holds fewer objects than capacity / object (then stores fail: the bench
    # runs without LMCache's eviction). Two stripes per file to spare.
    capacity = (object_bytes + 4096) * keys * in_flight * 6 + 2 * 4 * (16 << 20)
    gdskv = {"type": "plugin", "module_path": "gdskv.adapters.lmcache",
             "class_name": "GdskvL2Adapter",
             "adapter_params": {"directories": [directory], "capacity": capacity,
                                "object_bytes": object_bytes}}
    none = json.loads(json.dumps(gdskv))
    none["adapter_params"]["sync"] = "none"
    # the path before objects moved in place: every object through the staging buffer
    staged = json.loads(json.dumps(none))
    staged["adapter_params"]["in_place"] = False
    return {"gdskv": gdskv, "gdskv sync=none": none, "gdskv staged sync=none": staged,
            "fs_native": {"type": "fs_native", "base_path": directory},
            "fs_native odirect": {"type": "fs_native", "base_path": directory,
                                  "use_odirect": True}}


def drop_page_cache(directory: str) -> None:
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def bench(spec: dict, op: str, kb: int, keys: int, in_flight: int, rounds: int, align: int,
          out: str) -> dict:
    cmd = [*BENCH, "bench", "l2", "--l2-adapter", json.dumps(spec), "--only", op,
           "--num-keys", str(keys), "--data-size-kb", str(kb), "--in-flight", str(in_flight),
           "--rounds", str(rounds), "--warmup-rounds", "1", "--l1-align-bytes", str(align),
           "--format", "json", "--output", out, "-q"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "LMCACHE_DISABLE_BANNER": "1"})
    if run.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    with open(out) as fh:
        metrics = json.load(fh)["metrics"]
    return next(m for k, m in metrics.items() if k.startswith("op_"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--media", nargs="+", required=True, help="directories to run on")
    p.add_argument("--sizes-kb", nargs="+", type=int, default=[2048, 64])
    p.add_argument("--in-flight", nargs="+", type=int, default=[1, 8])
    p.add_argument("--batch-mb", type=int, default=32, help="bytes per submit")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only-adapters", nargs="*", default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for medium in args.media:
        for kb in args.sizes_kb:
            keys = max(1, args.batch_mb * 1024 // kb)
            for in_flight in args.in_flight:
                scratch = tempfile.mkdtemp(prefix="lmcache-l2-", dir=medium)
                try:
                    for name, spec in adapters(scratch, kb << 10, keys, in_flight).items():
                        if args.only_adapters and name not in args.only_adapters:
                            continue
                        d = tempfile.mkdtemp(dir=scratch)
                        spec = json.loads(json.dumps(spec).replace(json.dumps(scratch),
                                                                   json.dumps(d)))
                        tag = f"{os.path.basename(medium.rstrip('/'))}_{kb}k_if{in_flight}_" \
                              f"{name.replace(' ', '_').replace('=', '-')}"
                        res = {}
                        for op in ("store", "load"):
                            res[op] = bench(spec, op, kb, keys, in_flight, args.rounds,
                                            kb << 10, os.path.join(args.out, f"{tag}_{op}.json"))
                            if op == "store":
                                drop_page_cache(d)
                        rows.append((medium, kb, in_flight, name, res))
                        print(medium, kb, in_flight, name,
                              {op: (r["throughput_avg_mbps"], r["total_success"],
                                    r["total_keys"]) for op, r in res.items()}, flush=True)
                finally:
                    shutil.rmtree(scratch, ignore_errors=True)
    with open(os.path.join(args.out, "results.md"), "w") as fh:
        fh.write("| medium | object | in-flight | adapter | store MB/s | load MB/s | "
                 "load hits |\n|---|---|---|---|---|---|---|\n")
        for medium, kb, in_flight, name, res in rows:
            fh.write(f"| {medium} | {kb} KiB | {in_flight} | {name} | "
                     f"{res['store']['throughput_avg_mbps']:.0f} | "
                     f"{res['load']['throughput_avg_mbps']:.0f} | "
                     f"{res['load']['total_success']}/{res['load']['total_keys']} |\n")


if __name__ == "__main__":
    main()
