"""GPU benchmark of the gather/scatter and checksum kernels against the device's D2D copy rate.

Measures, on one CUDA device in one process:

- D2D copy bandwidth: ``dst.copy_(src)`` of a >= 1 GiB buffer, counting bytes read + written;
- gather and scatter bandwidth (bytes read + written = 2 x payload) for a >= 256 MiB page batch
  at random token slots of a per-layer pool, for Llama-3-8B (32 layers, 8 KV heads x 128, bf16)
  with 16- and 64-token pages and an MLA model (61 layers, 576 latent, bf16, 64-token pages);
- the page checksum kernel (bytes read);

each also as % of the D2D rate, plus the host time per call. Timings: CUDA events around
back-to-back calls (see ``_time_ms``). Every kernel's output is checked against the torch
reference once before it is timed.

Usage: ``python bench/experiments/kernel_bench.py --out results.json [--sweep]``; ``--sweep``
also times a few other tile shapes per geometry (to tune the defaults in kernels/triton_gather.py).

Results it produced (bench/RESULTS.md, "Gather / scatter kernels"), under bench/results/:
``h200-2026-11-22/kernels/`` (its README says which run made which file). Those files name the
geometries ``llama3-8b/p16``, ``llama3-8b/p64`` and ``mla-61x576/p64``; here they are
``llama3-8b-p16``, ``llama3-8b-p64`` and ``deepseek-v3-p64``, the same layouts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time

import torch

from experiment_helpers import GEOMETRIES

# (block_t, block_c, num_warps) tried with --sweep, by row length in 4-byte words.
SWEEP = {
    512: [(8, 512, 8), (4, 512, 4), (8, 512, 4), (16, 512, 8), (32, 512, 8), (16, 256, 8)],
    288: [(64, 64, 8), (64, 64, 4), (64, 32, 8), (128, 32, 8), (32, 128, 8), (16, 512, 8)],
}
CHECKSUM_SWEEP = [(2048, 4, 8), (1024, 8, 4), (4096, 4, 8), (2048, 8, 8), (1024, 4, 4)]


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def _time_ms(fn, total_ms: float = 100.0, reps: int = 5) -> float:
    """Median over ``reps`` of the mean time of back-to-back calls (CUDA events).

    Back-to-back calls measure the steady rate of a stream of batches, and keep the host's
    per-call time (validation, launch) off the clock as long as it is shorter than the GPU's.
    (triton's do_bench zeroes a 256 MiB buffer before every call: the dirty L2 it leaves is
    written back inside the timed region, a bias against short kernels.)
    """
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    n = max(3, int(total_ms / reps / max(start.elapsed_time(end), 1e-3)))
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / n)
    return float(statistics.median(times))


def _host_us(fn, calls: int = 200) -> float:
    """Host time per call (validation + launch) on a tiny batch, GPU not the bottleneck."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def d2d_copy(nbytes: int) -> dict:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src))
    del src, dst
    return {"bytes": nbytes, "ms": ms, "gbps": _gbps(2 * nbytes, ms)}


def bench_geometry(name: str, batch_bytes: int, sweep: bool, host: bool) -> dict:
    from gdskv.pool import KVPool
    from gdskv.kernels.reference import gather_pages_reference
    from gdskv.kernels.triton_gather import (LaunchConfig, default_config, gather_pages_triton,
                                       scatter_pages_triton)

    layout = GEOMETRIES[name]
    num_pages = -(-batch_bytes // layout.page_bytes)
    num_tokens = num_pages * layout.page_size
    num_slots = 2 * num_tokens  # pool twice the batch: slots drawn from all of it
    dims = (num_slots, layout.kv_heads, layout.head_dim)
    pool = [[torch.randn(dims, device="cuda").to(layout.torch_dtype)
             for _ in range(layout.num_layers)] for _ in range(layout.kv_count)]
    rows = KVPool(layout, pool[0] if layout.mla else tuple(pool)).rows
    slots = torch.randperm(num_slots, device="cuda")[:num_tokens]
    staging = torch.zeros(num_pages * layout.slot_bytes, dtype=torch.uint8, device="cuda")
    payload = num_pages * layout.page_bytes

    expected = torch.zeros_like(staging)
    gather_pages_reference(rows, layout, slots, expected)
    gather_pages_triton(rows, layout, slots, staging)
    ok_gather = bool(torch.equal(staging, expected))
    del expected
    target = [[torch.zeros_like(r) for r in layers] for layers in rows]
    scatter_pages_triton(target, layout, slots, staging)
    ok_scatter = all(torch.equal(t[slots], r[slots]) for ts, rs in zip(target, rows)
                     for t, r in zip(ts, rs))
    del target

    row_words = layout.row_bytes // 4
    default = default_config(row_words, 4)
    configs = [(default.block_t, default.block_c, default.num_warps)]
    if sweep:
        configs += [c for c in SWEEP.get(row_words, []) if c != configs[0]]
    out = {"layout": layout.to_dict(), "row_bytes": layout.row_bytes,
           "page_bytes": layout.page_bytes, "num_pages": num_pages, "payload_bytes": payload,
           "verified": ok_gather and ok_scatter, "default_config": configs[0], "runs": []}
    for cfg in configs:
        lc = LaunchConfig(*cfg)
        run = {"config": cfg}
        for what, fn in (("gather", gather_pages_triton), ("scatter", scatter_pages_triton)):
            ms = _time_ms(lambda: fn(rows, layout, slots, staging, config=lc))
            run[what] = {"ms": ms, "gbps": _gbps(2 * payload, ms)}
        out["runs"].append(run)
        print(f"  {name} {cfg}: gather {run['gather']['gbps']:.0f} GB/s, "
              f"scatter {run['scatter']['gbps']:.0f} GB/s", flush=True)
    out["gather"] = out["runs"][0]["gather"]
    out["scatter"] = out["runs"][0]["scatter"]
    if host:
        one = slots[:layout.page_size]
        out["host_us_per_call"] = {
            "gather": _host_us(lambda: gather_pages_triton(rows, layout, one, staging)),
            "scatter": _host_us(lambda: scatter_pages_triton(rows, layout, one, staging))}
    del pool, rows, staging
    torch.cuda.empty_cache()
    return out


def bench_checksum(batch_bytes: int, sweep: bool) -> dict:
    from gdskv.kernels.checksum import page_checksums_reference
    from gdskv.kernels.triton_checksum import BLOCK, ITERS, NUM_WARPS, page_checksums_triton

    page_bytes = slot_bytes = 2 * 32 * 16 * 2048  # a Llama-3-8B 16-token page (2 MiB)
    num_pages = -(-batch_bytes // page_bytes)
    staging = torch.randint(0, 256, (num_pages * slot_bytes,), dtype=torch.uint8, device="cuda")
    want = page_checksums_reference(staging[:4 * slot_bytes].cpu(), 4, page_bytes, slot_bytes)
    got = page_checksums_triton(staging, num_pages, page_bytes, slot_bytes)[:4].cpu()
    out = {"page_bytes": page_bytes, "num_pages": num_pages, "verified": bool(torch.equal(got,
                                                                                         want)),
           "runs": []}
    configs = [(BLOCK, ITERS, NUM_WARPS)] + ([c for c in CHECKSUM_SWEEP
                                              if c != (BLOCK, ITERS, NUM_WARPS)]
                                     if sweep else [])
    for block, iters, warps in configs:
        ms = _time_ms(lambda: page_checksums_triton(staging, num_pages, page_bytes, slot_bytes,
                                                    block=block, iters=iters, num_warps=warps))
        out["runs"].append({"config": (block, iters, warps), "ms": ms,
                            "gbps": _gbps(num_pages * page_bytes, ms)})
        print(f"  checksum {(block, iters, warps)}: "
              f"{out['runs'][-1]['gbps']:.0f} GB/s", flush=True)
    out["gbps"] = out["runs"][0]["gbps"]
    out["host_us_per_call"] = _host_us(
        lambda: page_checksums_triton(staging, 1, page_bytes, slot_bytes))
    return out


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--batch-mib", type=int, default=256, help="page batch size (MiB)")
    p.add_argument("--large-batch-mib", type=int, default=1024,
                   help="also time the default tiles at this batch size (0: skip)")
    p.add_argument("--copy-mib", type=int, default=1024, help="D2D copy buffer size (MiB)")
    p.add_argument("--sweep", action="store_true", help="also time other tile shapes")
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernel_bench needs a CUDA device")
    import triton

    batch = args.batch_mib << 20
    result = {
        "device": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": args.commit or _commit(),
        "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "batch_bytes": batch,
    }
    result["d2d"] = d2d_copy(args.copy_mib << 20)
    d2d = result["d2d"]["gbps"]
    print(f"D2D copy: {d2d:.0f} GB/s (read + write)", flush=True)
    result["geometries"] = {name: bench_geometry(name, batch, args.sweep, True)
                            for name in GEOMETRIES}
    if args.large_batch_mib:
        result["large_batch_bytes"] = args.large_batch_mib << 20
        result["geometries_large"] = {
            name: bench_geometry(name, args.large_batch_mib << 20, False, False)
            for name in GEOMETRIES}
    result["checksum"] = bench_checksum(batch, args.sweep)
    for g in [*result["geometries"].values(), *result.get("geometries_large", {}).values()]:
        for run in g["runs"]:
            for what in ("gather", "scatter"):
                run[what]["pct_d2d"] = 100 * run[what]["gbps"] / d2d
    for run in result["checksum"]["runs"]:
        run["pct_d2d"] = 100 * run["gbps"] / d2d
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)

    print(f"\n{result['device']}  D2D copy {d2d:.0f} GB/s (1 GiB, read + write)")
    print(f"{'geometry':<16} {'batch':>6} {'row B':>6} {'gather GB/s':>12} {'%D2D':>6} "
          f"{'scatter GB/s':>13} {'%D2D':>6}  ok")
    for size, key in ((args.batch_mib, "geometries"), (args.large_batch_mib, "geometries_large")):
        for name, g in result.get(key, {}).items():
            ga, sc = g["runs"][0]["gather"], g["runs"][0]["scatter"]
            print(f"{name:<16} {size:>4}Mi {g['row_bytes']:>6} {ga['gbps']:>12.0f} "
                  f"{ga['pct_d2d']:>6.1f} {sc['gbps']:>13.0f} {sc['pct_d2d']:>6.1f}  "
                  f"{g['verified']}")
    c = result["checksum"]["runs"][0]
    print(f"{'checksum':<16} {args.batch_mib:>4}Mi {'':>6} {c['gbps']:>12.0f} "
          f"{c['pct_d2d']:>6.1f} (bytes read)  {result['checksum']['verified']}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
