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
the path before in-place host I/O), for a before/after in one run. ``raw_block`` (one pre-sized
file) and ``nixl_store odirect`` (NIXL POSIX) join where ``lmcache-rust-raw-block-io`` and
``nixl`` import; ``nixl_store`` keeps its index in its process, so its store and load run in one
bench run. ``--in-process`` runs every bench in this process (the adapters are still built anew
per run), which saves seconds of imports per run.

Results it produced: ``cpu-2026-11-23/lmcache/results.md``, ``h100-2026-11-23/lmcache/`` and
``h100-2026-11-23/lmcache-2/`` (bench/RESULTS.md, LMCache L2)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile

#: `lmcache bench l2` as a module of this interpreter (works where lmcache was installed with
#: --target and has no `lmcache` script on the PATH, as on the GPU machine)
BENCH = [sys.executable, "-m", "lmcache.cli.main"]
#: --in-process: call the bench's entry point here instead of a process per run
IN_PROCESS = False


def stored_objects(keys: int, in_flight: int, rounds: int) -> int:
    """Room for every object a store run writes (its warm-up round too), two rounds to spare."""
    return keys * in_flight * (rounds + 3)


def adapters(directory: str, object_bytes: int, objects: int) -> dict[str, dict]:
    # room for ``objects``: each takes a slot (object + its 4 KiB trailer) and the store uses
    # its capacity in whole stripes, as many per slab file, so a tight capacity holds fewer
    # objects than capacity / object (then stores fail: the bench runs without LMCache's
    # eviction). Two stripes per file to spare.
    capacity = (object_bytes + 4096) * objects + 2 * 4 * (16 << 20)
    gdskv = {"type": "plugin", "module_path": "gdskv.adapters.lmcache",
             "class_name": "GdskvL2Adapter",
             "adapter_params": {"directories": [directory], "capacity": capacity,
                                "object_bytes": object_bytes}}
    none = json.loads(json.dumps(gdskv))
    none["adapter_params"]["sync"] = "none"
    # the path before objects moved in place: every object through the staging buffer
    staged = json.loads(json.dumps(none))
    staged["adapter_params"]["in_place"] = False
    specs = {"gdskv": gdskv, "gdskv sync=none": none, "gdskv staged sync=none": staged,
             "fs_native": {"type": "fs_native", "base_path": directory},
             "fs_native odirect": {"type": "fs_native", "base_path": directory,
                                   "use_odirect": True}}
    if importlib.util.find_spec("lmcache_rust_raw_block_io"):
        # one pre-sized file (prepare() sizes it): its metadata region, then a slot (object +
        # the adapter's 4 KiB header) per object; O_DIRECT is its default
        specs["raw_block"] = {"type": "raw_block",
                              "device_path": os.path.join(directory, "raw_block.bin"),
                              "slot_bytes": object_bytes + 4096,
                              "meta_total_bytes": RAW_BLOCK_META, "use_odirect": True}
    if importlib.util.find_spec("nixl"):
        # NIXL's POSIX plugin, one file per object (pool_size files); O_DIRECT like gdskv
        specs["nixl_store odirect"] = {"type": "nixl_store", "backend": "POSIX",
                                       "pool_size": objects,
                                       "backend_params": {"file_path": directory,
                                                          "use_direct_io": "true"}}
    return specs


#: raw_block's metadata region
RAW_BLOCK_META = 16 << 20


def prepare(spec: dict, object_bytes: int, objects: int) -> None:
    """Make what an adapter needs before it starts (raw_block: its pre-sized file)."""
    if spec["type"] == "raw_block":
        with open(spec["device_path"], "wb") as fh:
            fh.truncate(RAW_BLOCK_META + objects * (object_bytes + 4096))


def drop_page_cache(directory: str) -> None:
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def bench(spec: dict, op: str | None, kb: int, keys: int, in_flight: int, rounds: int,
          align: int, out: str) -> dict[str, dict]:
    """One `lmcache bench l2` run: ``op`` alone, or (None) every operation in turn.
    Returns the bench's metrics per operation name."""
    cmd = [*BENCH, "bench", "l2", "--l2-adapter", json.dumps(spec), *(["--only", op] if op else []),
           "--num-keys", str(keys), "--data-size-kb", str(kb), "--in-flight", str(in_flight),
           "--rounds", str(rounds), "--warmup-rounds", "1", "--l1-align-bytes", str(align),
           "--format", "json", "--output", out, "-q"]
    if IN_PROCESS:
        # the bench's own entry point in this process (imports paid once); it builds the
        # adapter anew, so a load run recovers the store's files as after a restart
        from lmcache.cli.main import main as lmcache_main
        if os.path.exists(out):
            os.remove(out)
        lmcache_main(cmd[len(BENCH):])
        if not os.path.exists(out):
            raise RuntimeError(f"lmcache {' '.join(cmd[len(BENCH):])} wrote no {out}")
    else:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "LMCACHE_DISABLE_BANNER": "1"})
        if run.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{run.stdout[-2000:]}"
                               f"{run.stderr[-2000:]}")
    with open(out) as fh:
        metrics = json.load(fh)["metrics"]
    return {m["operation"].lower(): m for k, m in metrics.items() if k.startswith("op_")}


#: adapter types whose index lives in their process (nixl_store): store and load run in one
#: process, so the page cache is not dropped between them; they read with O_DIRECT, which
#: does not go through it
ONE_PROCESS = {"nixl_store"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--media", nargs="+", required=True, help="directories to run on")
    p.add_argument("--sizes-kb", nargs="+", type=int, default=[2048, 64])
    p.add_argument("--in-flight", nargs="+", type=int, default=[1, 8])
    p.add_argument("--batch-mb", type=int, default=32, help="bytes per submit")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only-adapters", nargs="*", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--in-process", action="store_true",
                   help="run every bench in this process (saves the per-process start-up: "
                        "seconds of torch and lmcache imports each)")
    args = p.parse_args()
    global IN_PROCESS
    IN_PROCESS = args.in_process
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for medium in args.media:
        for kb in args.sizes_kb:
            keys = max(1, args.batch_mb * 1024 // kb)
            for in_flight in args.in_flight:
                scratch = tempfile.mkdtemp(prefix="lmcache-l2-", dir=medium)
                try:
                    objects = stored_objects(keys, in_flight, args.rounds)
                    for name, spec in adapters(scratch, kb << 10, objects).items():
                        if args.only_adapters and name not in args.only_adapters:
                            continue
                        d = tempfile.mkdtemp(dir=scratch)
                        spec = json.loads(json.dumps(spec).replace(json.dumps(scratch),
                                                                   json.dumps(d)))
                        prepare(spec, kb << 10, objects)
                        tag = f"{os.path.basename(medium.rstrip('/'))}_{kb}k_if{in_flight}_" \
                              f"{name.replace(' ', '_').replace('=', '-')}"
                        out = os.path.join(args.out, tag)
                        if spec["type"] in ONE_PROCESS:
                            res = bench(spec, None, kb, keys, in_flight, args.rounds, kb << 10,
                                        f"{out}_all.json")
                        else:
                            res = bench(spec, "store", kb, keys, in_flight, args.rounds,
                                        kb << 10, f"{out}_store.json")
                            drop_page_cache(d)
                            res |= bench(spec, "load", kb, keys, in_flight, args.rounds,
                                         kb << 10, f"{out}_load.json")
                        rows.append((medium, kb, in_flight, name, res))
                        print(medium, kb, in_flight, name,
                              {op: (res[op]["throughput_avg_mbps"], res[op]["total_success"],
                                    res[op]["total_keys"]) for op in ("store", "load")},
                              flush=True)
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
