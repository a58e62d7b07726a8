"""Issue-3 targets on a GPU machine: tier spill/restore vs raw kvikio vs dd, same directory.

For each directory (the disk, and /dev/shm where the disk is not the limit) and each geometry:
  dd        O_DIRECT write (conv=fdatasync) and read of the same byte count
  raw       kvikio pwrite of ONE contiguous GPU buffer (+ fdatasync), pread back
  tier      Tier.put / Tier.get of the same bytes as KV pages gathered from / scattered to a
            GPU pool at random slots (checksums, journal and fdatasync included)
Page cache is dropped before every read (when root). Ratios tier/raw are the figures of merit.

    python bench/experiments/tier_vs_kvikio.py --dir /var/tmp/gdskv --dir /dev/shm/gdskv \
        --size 2G --out results.json

Results it produced (bench/RESULTS.md, "How close to raw kvikio"), under bench/results/:
``h200-2026-11-22/tier-vs-kvikio/`` (its README says which call made which file; the files name
the MLA geometry ``mla-p64``, which is ``deepseek-v3-p64`` here, the same layout).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time

import torch

from experiment_helpers import GEOMETRIES, drop_all_caches, preallocate
from gdskv.config import TierConfig, parse_size
from gdskv.layout import KVLayout
from gdskv.tier import Tier


def dd(directory: str, nbytes: int) -> dict:
    path = os.path.join(directory, "dd.bin")
    bs = 8 << 20
    count = nbytes // bs
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", f"bs={bs}", f"count={count}",
                    "oflag=direct", "conv=fdatasync"], check=True, capture_output=True)
    w = time.perf_counter() - t0
    drop_all_caches()
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={bs}", "iflag=direct"],
                   check=True, capture_output=True)
    r = time.perf_counter() - t0
    os.unlink(path)
    return {"write_gbps": count * bs / w / 1e9, "read_gbps": count * bs / r / 1e9}


def raw_kvikio(directory: str, nbytes: int, cfg: TierConfig) -> dict:
    import kvikio
    import kvikio.defaults
    kvikio.defaults.set({"num_threads": cfg.io_threads, "task_size": cfg.io_chunk_size,
                         "bounce_buffer_size": cfg.io_chunk_size,
                         "auto_direct_io_read": True, "auto_direct_io_write": True})
    path = os.path.join(directory, "raw.bin")
    preallocate(path, nbytes)
    fd = os.open(path, os.O_RDWR)
    buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    back = torch.empty_like(buf)
    f = kvikio.CuFile(path, "r+")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    f.pwrite(buf).get()
    os.fdatasync(fd)
    w = time.perf_counter() - t0
    drop_all_caches()
    t0 = time.perf_counter()
    f.pread(back).get()
    r = time.perf_counter() - t0
    ok = bool(torch.equal(buf, back))
    f.close()
    os.close(fd)
    os.unlink(path)
    return {"write_gbps": nbytes / w / 1e9, "read_gbps": nbytes / r / 1e9, "verified": ok,
            "compat_mode": bool(kvikio.defaults.is_compat_mode_preferred())}


def tier_run(directory: str, nbytes: int, layout: KVLayout, cfg: TierConfig) -> dict:
    pages = max(1, nbytes // layout.page_bytes)
    slots = pages * layout.page_size
    shape = (layout.num_layers, slots, layout.kv_heads, layout.head_dim)
    parts = 1 if layout.mla else 2
    pool = tuple(torch.randint(-32768, 32767, shape, dtype=torch.int16, device="cuda")
                 .view(torch.bfloat16) for _ in range(parts))
    pool_arg = pool[0] if layout.mla else pool
    src = torch.randperm(slots, device="cuda")
    dst = torch.randperm(slots, device="cuda")
    keys = [f"{layout.page_size}-{i}" for i in range(pages)]
    store = os.path.join(directory, "tier")
    os.makedirs(store, exist_ok=True)
    cfg = cfg.replace(directories=(store,), capacity=pages * layout.slot_bytes + (256 << 20))
    with Tier(layout, cfg, device="cuda") as tier:
        # One-time costs out of the timing: Triton JIT of gather/scatter/checksum, CUDA context.
        warm = [f"warm-{i}" for i in range(2)]
        tier.put(warm, pool_arg, src[:2 * layout.page_size])
        tier.get(warm, pool_arg, src[:2 * layout.page_size])
        tier.evict(warm)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ok_put = all(tier.put(keys, pool_arg, src))
        w = time.perf_counter() - t0
        out = tuple(torch.zeros_like(p) for p in pool)
        dropped = drop_all_caches()
        t0 = time.perf_counter()
        ok_get = all(tier.get(keys, out[0] if layout.mla else out, dst))
        r = time.perf_counter() - t0
        exact = all(torch.equal(a.view(torch.int16)[:, src], b.view(torch.int16)[:, dst])
                    for a, b in zip(pool, out))
        stats = tier.stats()
    shutil.rmtree(store)
    moved = pages * layout.page_bytes
    return {"write_gbps": moved / w / 1e9, "read_gbps": moved / r / 1e9, "pages": pages,
            "bytes": moved, "stored": ok_put, "hits": ok_get, "bit_exact": exact,
            "cache_dropped": dropped, "backend": stats["backend"], "gpu_direct": stats["gpu_direct"],
            "backend_detail": stats["backend_detail"], "o_direct": stats["o_direct"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dir", action="append", required=True, help="directory to test (repeat)")
    ap.add_argument("--size", default="2G", help="bytes per direction per run (default 2G)")
    ap.add_argument("--geometry", action="append", choices=list(GEOMETRIES))
    ap.add_argument("--backend", default="kvikio")
    ap.add_argument("--staging", default=None, help="tier staging_size (default: config's)")
    ap.add_argument("--depth", type=int, default=None, help="tier pipeline_depth")
    ap.add_argument("--checksum-cost", action="store_true",
                    help="also run the first geometry with checksums off (verify=False)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    nbytes = parse_size(args.size)
    cfg = TierConfig(backend=args.backend, directories=("/unused",))
    if args.staging:
        cfg = cfg.replace(staging_size=parse_size(args.staging))
    if args.depth:
        cfg = cfg.replace(pipeline_depth=args.depth)
    results = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
               "size": nbytes, "config": {"io_threads": cfg.io_threads,
                                          "io_chunk_size": cfg.io_chunk_size,
                                          "staging_size": cfg.staging_size,
                                          "pipeline_depth": cfg.pipeline_depth,
                                          "sync": cfg.sync.value}, "runs": []}
    rows = []
    for base in args.dir:
        os.makedirs(base, exist_ok=True)
        d = tempfile.mkdtemp(dir=base)
        entry = {"dir": base, "dd": dd(d, nbytes), "raw_kvikio": raw_kvikio(d, nbytes, cfg),
                 "tier": {}}
        names = args.geometry or list(GEOMETRIES)
        for name in names:
            entry["tier"][name] = tier_run(d, nbytes, GEOMETRIES[name], cfg)
        if args.checksum_cost:
            entry["tier"][names[0] + " no-checksum"] = tier_run(
                d, nbytes, GEOMETRIES[names[0]], cfg.replace(verify=False))
        shutil.rmtree(d)
        results["runs"].append(entry)
        raw = entry["raw_kvikio"]
        rows.append((base, "dd O_DIRECT", entry["dd"]["write_gbps"], entry["dd"]["read_gbps"], "", ""))
        rows.append((base, "raw kvikio", raw["write_gbps"], raw["read_gbps"], "1.00", "1.00"))
        for name, t in entry["tier"].items():
            rows.append((base, f"tier {name}", t["write_gbps"], t["read_gbps"],
                         f"{t['write_gbps'] / raw['write_gbps']:.2f}",
                         f"{t['read_gbps'] / raw['read_gbps']:.2f}"))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\n{results['device']}  {nbytes / 2**30:.2f} GiB per run, backend {args.backend}")
    print(f"{'dir':<16} {'engine':<22} {'write GB/s':>10} {'read GB/s':>10} {'w/raw':>6} {'r/raw':>6}")
    for d, eng, w, r, wr, rr in rows:
        print(f"{d:<16} {eng:<22} {w:>10.2f} {r:>10.2f} {wr:>6} {rr:>6}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
