"""GPU check of the NIXL backend against raw kvikio, on one directory.

    python bench/experiments/nixl_gpu_check.py --dir /path/on/disk --out nixl_gpu.json [--size 1GiB]

1. A GPU buffer of --size random bytes goes through ``NixlBackend`` (device cuda, plugin auto:
   GDS_MT/GDS where they work, else POSIX with pinned host staging, reported) into --files
   slab files as --bs extents striped over the files, and back into a second GPU buffer;
   bit-exact check; write and read GB/s (write includes fsync of the files; page cache dropped
   before reads when root).
2. The same bytes with raw kvikio: one contiguous GPU buffer, ``kvikio.CuFile(path, "r+")``
   pwrite/pread of one slice per file, ``num_threads`` 16, ``task_size`` 16 MiB.
JSON (numbers, NIXL describe(), kvikio compat mode, device) goes to --out; a short table last.

Result it produced (bench/RESULTS.md, "NIXL backend"), under bench/results/:
``h200-2026-11-22/nixl-gpu-check/nixl_gpu_check.json``: GDS_MT's file registration failing
(error 5027) and the POSIX fallback at 1.02x / 1.14x raw kvikio.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch

from experiment_helpers import drop_all_caches, open_slab, preallocate
from gdskv.backends.base import Extent
from gdskv.backends.nixl import NixlBackend
from gdskv.config import TierConfig, parse_size


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def run_nixl(args, src: torch.Tensor, dst: torch.Tensor) -> dict:
    size, per = args.size, args.size // args.files
    files = [open_slab(os.path.join(args.dir, f"nixl{i}.bin"), per, i) for i in range(args.files)]
    ext = [Extent(k % args.files, (k // args.files) * args.bs, args.bs, k * args.bs)
           for k in range(size // args.bs)]
    out: dict = {"files": args.files, "bs": args.bs, "o_direct": files[0].direct}
    cfg = TierConfig(nixl_plugin=args.plugin, nixl_posix_queue=args.queue,
                     io_chunk_size=args.chunk)
    try:
        with NixlBackend(cfg, torch.device("cuda")) as b:
            t0 = time.perf_counter()
            b.attach(files)
            out["attach_s"] = time.perf_counter() - t0
            out["describe"] = b.describe()
            writes, reads = [], []
            for rep in range(args.reps):
                def w():
                    res = b.write(src, ext).result()
                    if not res.ok:
                        raise RuntimeError(f"NIXL write failed: {list(res.errors.items())[:3]}")
                    for f in files:
                        os.fsync(f.fd)
                writes.append(timed(w))
                out["caches_dropped"] = drop_all_caches()
                dst.zero_()

                def r():
                    res = b.read(dst, ext).result()
                    if not res.ok:
                        raise RuntimeError(f"NIXL read failed: {list(res.errors.items())[:3]}")
                reads.append(timed(r))
                out[f"bit_exact_rep{rep}"] = bool(torch.equal(src, dst))
            out["describe_after"] = b.describe()
    finally:
        for f in files:
            os.close(f.fd)
            if not args.keep:
                os.unlink(f.path)
    out["write_s"], out["read_s"] = writes, reads
    out["write_GBps"] = size / min(writes) / 1e9
    out["read_GBps"] = size / min(reads) / 1e9
    out["bit_exact"] = all(v for k, v in out.items() if k.startswith("bit_exact_rep"))
    return out


def run_kvikio(args, src: torch.Tensor, dst: torch.Tensor) -> dict:
    import kvikio
    import kvikio.defaults

    kvikio.defaults.set({"num_threads": args.kvikio_threads, "task_size": 16 << 20})
    size, per = args.size, args.size // args.files
    paths = [os.path.join(args.dir, f"kvikio{i}.bin") for i in range(args.files)]
    for p in paths:
        preallocate(p, per)
    out: dict = {"files": args.files, "num_threads": args.kvikio_threads, "task_size": 16 << 20}
    try:
        out["compat_mode_preferred"] = bool(kvikio.defaults.is_compat_mode_preferred())
    except Exception as exc:  # noqa: BLE001
        out["compat_mode_preferred"] = f"unknown ({exc})"
    writes, reads = [], []
    handles = [kvikio.CuFile(p, "r+") for p in paths]
    try:
        for rep in range(args.reps):
            def w():
                futs = [h.pwrite(src[i * per:(i + 1) * per]) for i, h in enumerate(handles)]
                n = sum(f.get() for f in futs)
                assert n == size, f"kvikio wrote {n} of {size} bytes"
                for p in paths:   # CuFile keeps its fds private: fsync through a fresh one
                    fd = os.open(p, os.O_RDONLY)
                    os.fsync(fd)
                    os.close(fd)
            writes.append(timed(w))
            out["caches_dropped"] = drop_all_caches()
            dst.zero_()

            def r():
                futs = [h.pread(dst[i * per:(i + 1) * per]) for i, h in enumerate(handles)]
                n = sum(f.get() for f in futs)
                assert n == size, f"kvikio read {n} of {size} bytes"
            reads.append(timed(r))
            out[f"bit_exact_rep{rep}"] = bool(torch.equal(src, dst))
    finally:
        for h in handles:
            h.close()
        if not args.keep:
            for p in paths:
                os.unlink(p)
    out["write_s"], out["read_s"] = writes, reads
    out["write_GBps"] = size / min(writes) / 1e9
    out["read_GBps"] = size / min(reads) / 1e9
    out["bit_exact"] = all(v for k, v in out.items() if k.startswith("bit_exact_rep"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="directory for the slab files (the disk)")
    ap.add_argument("--out", default="nixl_gpu_check.json")
    ap.add_argument("--size", default="1GiB", help="bytes moved each way (>= 1GiB for the check)")
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--bs", default="16MiB", help="NIXL extent size")
    ap.add_argument("--chunk", default="8MiB", help="NIXL io_chunk_size (piece per descriptor)")
    ap.add_argument("--plugin", default="auto", help="auto|GDS|GDS_MT|POSIX")
    ap.add_argument("--queue", default="aio", help="POSIX plugin queue: aio|uring|posix_aio")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--kvikio-threads", type=int, default=16)
    ap.add_argument("--skip-kvikio", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the files")
    args = ap.parse_args()
    args.size, args.bs, args.chunk = (parse_size(args.size), parse_size(args.bs),
                                      parse_size(args.chunk))
    if args.size % (args.files * args.bs):
        ap.error("--size must be a multiple of --files * --bs")
    if not torch.cuda.is_available():
        sys.exit("nixl_gpu_check needs a CUDA device")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    os.makedirs(args.dir, exist_ok=True)

    g = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randint(0, 256, (args.size,), dtype=torch.uint8, device="cuda", generator=g)
    dst = torch.empty_like(src)
    report = {"device": torch.cuda.get_device_name(), "size": args.size, "dir": args.dir,
              "root": os.geteuid() == 0}
    report["nixl"] = run_nixl(args, src, dst)
    if not args.skip_kvikio:
        try:
            report["kvikio"] = run_kvikio(args, src, dst)
        except Exception as exc:  # noqa: BLE001 - still write the NIXL numbers
            report["kvikio"] = {"error": f"{type(exc).__name__}: {exc}"}
    k = report.get("kvikio", {})
    if "write_GBps" in k:
        report["nixl_vs_kvikio"] = {"write": report["nixl"]["write_GBps"] / k["write_GBps"],
                                    "read": report["nixl"]["read_GBps"] / k["read_GBps"]}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)

    d = report["nixl"]["describe"]
    print(f"\nNIXL plugin {d['plugin']} gpu_direct={d['gpu_direct']} "
          f"fallback: {d['fallback_reason']}")
    print(f"{'method':<8} {'write GB/s':>10} {'read GB/s':>10} {'bit-exact':>9}")
    for name in ("nixl", "kvikio"):
        r = report.get(name, {})
        if "write_GBps" in r:
            print(f"{name:<8} {r['write_GBps']:>10.2f} {r['read_GBps']:>10.2f} "
                  f"{str(r['bit_exact']):>9}")
        elif r:
            print(f"{name:<8} error: {r.get('error')}")
    if "nixl_vs_kvikio" in report:
        v = report["nixl_vs_kvikio"]
        print(f"nixl/kvikio: write {v['write']:.0%}, read {v['read']:.0%}")


if __name__ == "__main__":
    main()
