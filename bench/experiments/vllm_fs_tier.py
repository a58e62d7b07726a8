"""gdskv's vLLM secondary tier against vLLM's own ``tiering/fs`` tier, on the same blocks.

Both tiers are built the way vLLM builds them (``SecondaryTierFactory.create_secondary_tier``)
over one CPU-primary memoryview of ``(num_chunks, block_bytes)`` rows, in sub-directories of
one directory, in one process, and get the same job sequence: every job submitted at once (as
the tiering manager cascades many requests' blocks), then ``get_finished_jobs`` polled until all
are done, timed from the first submit. Reads are into other primary rows, after the page cache
of each tier's files was dropped (``posix_fadvise(DONTNEED)`` on every file; a no-op on tmpfs,
where the files *are* memory), and every byte is compared.

Geometry: Llama-3-8B (32 layers, 8 KV heads, head_dim 128, bf16) at vLLM's default block size
of 16 tokens: 2 MiB per block and worker (TP 1).

A third line, ``raw-rows``, is no tier: the rows go straight to and from one preallocated file
with an xxh3 pass each, on the same threads. It is the ceiling for a checksumming tier on that
storage and machine. A fourth, ``memcpy``, copies the rows from one half of the primary to the
other on the same threads: one pass over the bytes, what any tier on memory-speed storage
(/dev/shm: a read there *is* a copy out of the page cache) can at best do.

gdskv moves the primary's rows in place (``put_pages``/``get_pages`` straight between the row
and the slab file, checksum on the row). ``gdskv-staged`` is the same tier with ``in_place=false``:
every row through the staging buffer (the path before the in-place one). ``gdskv-unmapped`` is
``gdskv-sync-data`` with ``map_memory_files=false``: on tmpfs, reads by ``preadv`` and a
checksum pass instead of one copy-and-checksum pass from the slab files' mappings (the default
since 2026-11-28).

Durability, side by side: vLLM's fs tier writes a temp file and renames it, with no fsync;
gdskv runs twice, ``sync=data`` (fdatasync before a page is READY, the default) and
``sync=none`` (no fsync, like the fs tier).

Results it produced: ``cpu-2026-11-23/vllm-fs-tier/`` (the development machine, /dev/shm and
disk), and on the GPU machine, where it runs from the carried ``.whl-vllm/``
(``fetch_vllm_fs.sh``), ``h200-2026-11-28/many-threads/`` and ``h200-2026-11-28/quick-reader/``
(calls 3-5). gdskv's runs record its quick restores and spills (``quick_*``).

Run in .venv-vllm (tests/run_vllm.sh builds it)::

    .venv-vllm/bin/python bench/experiments/vllm_fs_tier.py --directory /dev/shm/bench \
        --size 1GiB --job-blocks 16 --repeat 3 --output out.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import statistics
import sys
import time
from datetime import date

import numpy as np

LLAMA3_8B_BLOCK = 32 * 2 * 16 * 8 * 128 * 2  # layers x (K,V) x tokens x heads x dim x bf16


def _vllm():
    from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig,
                                           OffloadingGroupConfig, OffloadingModelConfig,
                                           OffloadingParallelConfig)
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.fs import io as fs_io
    return (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
            OffloadingModelConfig, OffloadingParallelConfig, OffloadingSpecFactory,
            TransferJob, SecondaryTierFactory, fs_io)


def make_spec():
    (Cache, Config, Group, Model, Parallel, Factory, *_rest) = _vllm()
    cfg = Config(
        groups=(Group(tokens_per_block=16, layer_names=tuple(f"l{i}" for i in range(32)),
                      group_id=0),),
        worker_kv_bytes_per_block=LLAMA3_8B_BLOCK, enable_kv_cache_events=False,
        extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 30},
        engine_id="bench", model=Model(name="meta-llama/Meta-Llama-3-8B", dtype="bfloat16"),
        cache=Cache(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=Parallel(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                          data_parallel_index=0, data_parallel_size=1,
                          data_parallel_rank_local=None, is_parallelism_agnostic=False))
    return Factory.create_spec(cfg)


def drop_cache(root: str) -> int:
    """posix_fadvise(DONTNEED) every file under ``root``; returns how many."""
    n = 0
    for d, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


def raw_rows(root: str, rows: np.ndarray, view: memoryview, n: int, threads: int):
    """The ceiling for any tier that checksums: rows straight to and from one preallocated file
    (O_DIRECT where the file system takes it) on ``threads`` threads, an xxh3 pass per row, no
    staging, no metadata, no durability. Returns (write s, read s, O_DIRECT used)."""
    import xxhash
    from concurrent.futures import ThreadPoolExecutor
    size = rows.shape[1]
    path = os.path.join(root, "rows.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, n * size)
    os.close(fd)
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
        direct = True
    except OSError:
        fd, direct = os.open(path, os.O_RDWR), False
    flat = view.cast("B")

    def write(i):
        xxhash.xxh3_64_intdigest(flat[i * size:(i + 1) * size])
        os.pwritev(fd, [flat[i * size:(i + 1) * size]], i * size)

    def read(i):
        os.preadv(fd, [flat[(n + i) * size:(n + i + 1) * size]], i * size)
        xxhash.xxh3_64_intdigest(flat[(n + i) * size:(n + i + 1) * size])

    try:
        with ThreadPoolExecutor(threads) as pool:
            t0 = time.perf_counter()
            list(pool.map(write, range(n)))
            wt = time.perf_counter() - t0
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            rows[n:] = 0
            t0 = time.perf_counter()
            list(pool.map(read, range(n)))
            rt = time.perf_counter() - t0
    finally:
        os.close(fd)
    return wt, rt, direct


def copy_rows(rows: np.ndarray, n: int, threads: int) -> float:
    """Seconds to copy rows 0..n-1 onto rows n..2n-1 on ``threads`` threads (numpy releases
    the GIL while it copies)."""
    from concurrent.futures import ThreadPoolExecutor
    rows[n:] = 0

    def copy(i):
        np.copyto(rows[n + i], rows[i])

    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(copy, range(n)))
        return time.perf_counter() - t0


def run_jobs(tier, TransferJob, keys, chunks, job_blocks: int, *, load: bool, first_id: int):
    jobs = {}
    t0 = time.perf_counter()
    for j, start in enumerate(range(0, len(keys), job_blocks)):
        job = TransferJob(first_id + j, keys[start:start + job_blocks],
                          np.asarray(chunks[start:start + job_blocks]), load, None)
        (tier.submit_load if load else tier.submit_store)(job)
        jobs[job.job_id] = job
    failed = 0
    while jobs:
        for r in tier.get_finished_jobs():
            jobs.pop(r.job_id)
            failed += not r.success
        time.sleep(0.0005)
    return time.perf_counter() - t0, failed


def bench(args) -> dict:
    (*_cfg, TransferJob, Factory, fs_io) = _vllm()
    from gdskv.adapters.vllm.secondary import GdskvSecondaryTier  # noqa: F401 (import check)
    spec = make_spec()
    n = args.size // LLAMA3_8B_BLOCK
    # page-aligned, like vLLM's primary (an mmap): O_DIRECT needs aligned buffers
    region = mmap.mmap(-1, 2 * n * LLAMA3_8B_BLOCK)
    rows = np.frombuffer(region, dtype=np.uint8).reshape(2 * n, LLAMA3_8B_BLOCK)
    rows[:n] = np.random.default_rng(0).integers(0, 256, (n, LLAMA3_8B_BLOCK), dtype=np.uint8)
    view = memoryview(region).cast("B", (2 * n, LLAMA3_8B_BLOCK))
    engines = {
        "vllm-fs": {"type": "fs", "n_read_threads": args.threads, "n_write_threads": args.threads},
        "gdskv-sync-data": {"type": "GdskvSecondaryTier",
                            "module_path": "gdskv.adapters.vllm.secondary", "sync": "data",
                            "capacity": str(2 * args.size), "io_threads": args.threads},
        "gdskv-sync-none": {"type": "GdskvSecondaryTier",
                            "module_path": "gdskv.adapters.vllm.secondary", "sync": "none",
                            "capacity": str(2 * args.size), "io_threads": args.threads},
        "gdskv-unmapped": {"type": "GdskvSecondaryTier",
                           "module_path": "gdskv.adapters.vllm.secondary", "sync": "data",
                           "capacity": str(2 * args.size), "io_threads": args.threads,
                           "map_memory_files": "false"},
        "gdskv-staged": {"type": "GdskvSecondaryTier",
                         "module_path": "gdskv.adapters.vllm.secondary", "sync": "data",
                         "capacity": str(2 * args.size), "io_threads": args.threads,
                         "in_place": "false"},
        "raw-rows": {"type": "raw"},
        "memcpy": {"type": "memcpy"},
    }
    out = {"date": str(date.today()), "host": platform.node(), "cpus": os.cpu_count(),
           "python": sys.version.split()[0], "directory": args.directory,
           "block_bytes": LLAMA3_8B_BLOCK, "blocks": n, "bytes": n * LLAMA3_8B_BLOCK,
           "job_blocks": args.job_blocks, "threads": args.threads, "repeat": args.repeat,
           "vllm_fs_io_C": bool(fs_io._HAS_FSIO_C),
           "durability": {"vllm-fs": "tmp file + rename, no fsync",
                          "gdskv-sync-data": "fdatasync slab files + journal before READY",
                          "gdskv-sync-none": "no fsync (like vllm-fs)",
                          "gdskv-unmapped": "as gdskv-sync-data, reads by preadv where the "
                                            "store is on tmpfs (map_memory_files=false)",
                          "gdskv-staged": "as gdskv-sync-data, through the staging buffer",
                          "raw-rows": "no fsync; one file, no metadata (a ceiling, not a tier)",
                          "memcpy": "no storage: one copy of the rows (the memory ceiling)"},
           "runs": {}}
    extra = {k: json.loads(v) if v.isdigit() or v in ("true", "false") else v
             for k, v in (opt.split("=", 1) for opt in args.gdskv)}
    engines = {name: dict(cfg, **extra) if name.startswith("gdskv") else cfg
               for name, cfg in engines.items() if name in args.engines.split(",")}
    out["gdskv_options"] = extra
    for rep in range(args.repeat):
        for name, cfg in engines.items():
            root = os.path.join(args.directory, name)
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root)
            if cfg["type"] in ("raw", "memcpy"):
                if cfg["type"] == "raw":
                    wt, rt, direct = raw_rows(root, rows, view, n, args.threads)
                else:
                    wt = rt = copy_rows(rows, n, args.threads)
                    direct = None
                ok = bool(np.array_equal(rows[:n], rows[n:]))
                run = {"write_GBps": n * LLAMA3_8B_BLOCK / wt / 1e9,
                       "read_GBps": n * LLAMA3_8B_BLOCK / rt / 1e9, "write_s": wt, "read_s": rt,
                       "verified": ok, "o_direct": direct}
                out["runs"].setdefault(name, []).append(run)
                shutil.rmtree(root, ignore_errors=True)
                print(f"rep {rep} {name:16s} write {run['write_GBps']:6.2f} GB/s  read "
                      f"{run['read_GBps']:6.2f} GB/s  verified={ok}", flush=True)
                continue
            cfg = dict(cfg, **({"root_dir": root} if cfg["type"] == "fs" else
                               {"directories": root}))
            tier = Factory.create_secondary_tier(cfg, view, spec)
            keys = [os.urandom(32) + b"\0\0\0\0" for _ in range(n)]
            wt, wfail = run_jobs(tier, TransferJob, keys, list(range(n)), args.job_blocks,
                                 load=False, first_id=0)
            dropped = drop_cache(root)
            rows[n:] = 0
            rt, rfail = run_jobs(tier, TransferJob, keys, list(range(n, 2 * n)),
                                 args.job_blocks, load=True, first_id=1 << 20)
            ok = bool(np.array_equal(rows[:n], rows[n:])) and not wfail and not rfail
            run = {"write_GBps": n * LLAMA3_8B_BLOCK / wt / 1e9,
                   "read_GBps": n * LLAMA3_8B_BLOCK / rt / 1e9, "write_s": wt, "read_s": rt,
                   "failed_jobs": wfail + rfail, "verified": ok, "files_dropped": dropped}
            if name.startswith("gdskv"):
                st = tier.stats()
                run.update(o_direct=st["o_direct"], o_direct_reason=st["o_direct_reason"],
                           backend=st["backend"], in_place=st["in_place"],
                           **{k: st.get(k, 0) for k in ("pages_written_in_place",
                                                        "pages_read_in_place",
                                                        "region_pages_written_staged",
                                                        "region_pages_read_staged",
                                                        "quick_restores", "quick_spills",
                                                        "quick_calls_handed_on")},
                           quick_restore=st["quick_restore"])
            else:
                run.update(o_direct=bool(tier._use_o_direct))
            out["runs"].setdefault(name, []).append(run)
            tier.shutdown()
            shutil.rmtree(root, ignore_errors=True)
            print(f"rep {rep} {name:16s} write {run['write_GBps']:6.2f} GB/s  read "
                  f"{run['read_GBps']:6.2f} GB/s  verified={ok}", flush=True)
    med = {name: {k: statistics.median(r[k] for r in runs) for k in ("write_GBps", "read_GBps")}
           for name, runs in out["runs"].items()}
    out["median"] = med
    base = med.get("vllm-fs")
    out["ratio_vs_vllm_fs"] = {name: {k: m[k] / base[k] for k in m} for name, m in med.items()
                               } if base else {}
    return out


def main(argv=None) -> int:
    from gdskv.config import parse_size
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--directory", required=True)
    p.add_argument("--size", default="1GiB", type=parse_size)
    p.add_argument("--job-blocks", type=int, default=16, help="blocks per job (2 MiB each)")
    p.add_argument("--threads", type=int, default=16, help="I/O threads of each tier")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--gdskv", action="append", default=[], metavar="FIELD=VALUE",
                   help="a TierConfig option for both gdskv runs (repeatable)")
    p.add_argument("--engines", default="vllm-fs,gdskv-sync-data,gdskv-sync-none,gdskv-staged,"
                   "raw-rows,memcpy")
    p.add_argument("--output")
    args = p.parse_args(argv)
    out = bench(args)
    print(json.dumps({"median": out["median"], "ratio_vs_vllm_fs": out["ratio_vs_vllm_fs"]},
                     indent=1))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if all(r["verified"] for runs in out["runs"].values() for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
