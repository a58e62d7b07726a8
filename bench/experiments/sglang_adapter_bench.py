"""gdskv's SGLang adapter vs SGLang's own HiCacheFile, on the same host pool pages.

Both backends are created by SGLang's ``StorageBackendFactory`` over one SGLang host pool and
driven the way SGLang's cache controller drives them, in batches of ``STORAGE_BATCH_SIZE`` (128)
pages: gdskv through the zero-copy calls (``batch_set_v1`` / ``batch_get_v1``, what
``"interface_v1": 1`` selects); HiCacheFile through the per-page path the controller uses for it
(``batch_set`` of ``get_data_page`` / ``batch_get`` into dummy pages + ``set_from_flat_data_page``).
Both write into sub-directories of ``--dir``. Reads come back into other host pages and are
checked byte for byte against what was written.

Page cache: gdskv uses O_DIRECT where the file system takes it; HiCacheFile is buffered, so its
reads right after its writes may come from RAM. ``--drop-caches`` (root) writes
``/proc/sys/vm/drop_caches`` before each read pass; the JSON says whether that worked.

    python bench/experiments/sglang_adapter_bench.py --dir /mnt/nvme/bench --out adapter.json

The host pools come from tests/sglang_pools.py (SGLang's own classes where they import).
Results it produced (bench/RESULTS.md, "SGLang adapter"), under bench/results/:
``h200-2026-11-22/sglang-adapter/`` (bench/device/sglang_device_run.sh): 1.66-1.89x
HiCacheFile's reads on the H200's disk.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time

import torch

from experiment_helpers import drop_all_caches, load_test_helper


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="directory on the drive under test")
    ap.add_argument("--out", help="write the JSON results here (also printed)")
    ap.add_argument("--layout", default="page_first_direct",
                    choices=["page_first_direct", "page_first"])
    ap.add_argument("--mla", action="store_true", help="MLA pool (one latent row per token)")
    ap.add_argument("--pages", type=int, default=512, help="pages per pass")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--mla-dim", type=int, default=576)
    ap.add_argument("--repeat", type=int, default=3, help="timed passes per operation")
    ap.add_argument("--gdskv-backend", default="auto", help="gdskv backend (auto|posix|kvikio|nixl)")
    ap.add_argument("--gdskv-device", default="cpu", help="gdskv staging device (cpu|cuda)")
    ap.add_argument("--drop-caches", action="store_true",
                    help="drop the page cache before read passes (needs root)")
    ap.add_argument("--backends", default="gdskv,file", help="comma list of gdskv,file")
    return ap.parse_args(argv)


def _config(args, extra: dict):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=args.mla, enable_storage_metrics=False,
        is_page_first_layout=True, model_name="bench-model", extra_config=extra)


def _page_bytes(pool, page: int, page_size: int) -> torch.Tensor:
    return pool.get_data_page(page * page_size, flat=True).view(torch.uint8)


def run(args) -> dict:
    from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    pools = load_test_helper("sglang_pools")
    make_host_pool, pool_kind = pools.make_host_pool, pools.pool_kind

    ps, n = args.page_size, args.pages
    pool = make_host_pool(mla=args.mla, layout=args.layout, page_size=ps, layers=args.layers,
                          heads=args.heads, head_dim=args.head_dim, mla_dim=args.mla_dim,
                          pages=2 * n)
    g = torch.Generator().manual_seed(0)
    raw = pool.kv_buffer.view(torch.uint8)
    # random bytes (so nothing compresses or dedups); filled in slices to bound temporaries
    flat = raw.view(-1)
    step = 1 << 28
    for i in range(0, flat.numel(), step):
        m = min(step, flat.numel() - i)
        flat[i:i + m] = torch.randint(0, 256, (m,), dtype=torch.uint8, generator=g)
    src_pages = list(range(n))
    dst_pages = list(range(n, 2 * n))

    def indices(pages):
        return torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in pages]).to(torch.int64)

    src_idx, dst_idx = indices(src_pages), indices(dst_pages)
    page_bytes = _page_bytes(pool, 0, ps).numel()
    keys_for = lambda r: [f"{r:04d}-{i:08d}-" + "0" * 48 for i in range(n)]  # noqa: E731

    results = {"pool": pool_kind(), "layout": args.layout, "mla": args.mla, "pages": n,
               "page_size": ps, "page_bytes": page_bytes, "batch_pages": STORAGE_BATCH_SIZE,
               "bytes_per_pass": n * page_bytes, "backends": {}}

    def batches(keys, idx):
        for i in range(0, len(keys), STORAGE_BATCH_SIZE):
            b = keys[i:i + STORAGE_BATCH_SIZE]
            yield b, idx[i * ps:(i + len(b)) * ps], i

    for name in args.backends.split(","):
        sub = os.path.join(args.dir, f"sglang-bench-{name}")
        shutil.rmtree(sub, ignore_errors=True)
        os.makedirs(sub)
        if name == "gdskv":
            extra = {"backend_name": "gdskv", "module_path": "gdskv.adapters.sglang",
                     "class_name": "GdskvHiCacheStorage", "interface_v1": 1, "directories": sub,
                     "capacity": max(4 * args.repeat * n * page_bytes, 1 << 30),
                     "backend": args.gdskv_backend, "device": args.gdskv_device}
            storage = StorageBackendFactory.create_backend("dynamic", _config(args, extra), pool)

            def write(keys):
                return sum(sum(storage.batch_set_v1(b, ix)) for b, ix, _ in
                           batches(keys, src_idx))

            def read(keys):
                return sum(sum(storage.batch_get_v1(b, ix)) for b, ix, _ in
                           batches(keys, dst_idx))
        elif name == "file":
            storage = StorageBackendFactory.create_backend(
                "file", _config(args, {"file_storage_path": sub}), pool)

            def write(keys):
                done = 0
                for b, _, i in batches(keys, src_idx):
                    data = [pool.get_data_page(src_idx[(i + j) * ps]) for j in range(len(b))]
                    done += len(b) if storage.batch_set(b, data) else 0
                return done

            def read(keys):
                done = 0
                for b, _, i in batches(keys, dst_idx):
                    dummies = [pool.get_dummy_flat_data_page() for _ in b]
                    for j, page in enumerate(storage.batch_get(b, dummies)):
                        if page is not None:
                            pool.set_from_flat_data_page(dst_idx[(i + j) * ps], page)
                            done += 1
                return done
        else:
            raise SystemExit(f"unknown backend {name!r} (gdskv, file)")
        storage.register_mem_pool_host(pool)
        entry = {"write_gbps": [], "read_gbps": [], "dropped_caches": None, "verified": True}
        for r in range(args.repeat):
            keys = keys_for(r)
            t0 = time.perf_counter()
            ok = write(keys)
            t_w = time.perf_counter() - t0
            if ok != n:
                entry["verified"] = False
                entry.setdefault("errors", []).append(f"pass {r}: wrote {ok}/{n} pages")
            if args.drop_caches:
                entry["dropped_caches"] = drop_all_caches()
            zero = pool.get_dummy_flat_data_page()
            for p in dst_pages:  # so the check below sees what this pass read
                pool.set_from_flat_data_page(p * ps, zero)
            t0 = time.perf_counter()
            got = read(keys)
            t_r = time.perf_counter() - t0
            if got != n or not all(torch.equal(_page_bytes(pool, s, ps), _page_bytes(pool, d, ps))
                                   for s, d in zip(src_pages, dst_pages)):
                entry["verified"] = False
                entry.setdefault("errors", []).append(f"pass {r}: read {got}/{n} pages or bytes differ")
            entry["write_gbps"].append(n * page_bytes / t_w / 1e9)
            entry["read_gbps"].append(n * page_bytes / t_r / 1e9)
        if name == "gdskv":
            st = storage.tier_stats()
            entry["tier"] = {k: st.get(k) for k in ("backend", "backend_selected_because",
                                                    "gpu_direct", "o_direct", "o_direct_reason",
                                                    "device")}
        if hasattr(storage, "close"):
            storage.close()
        for k in ("write_gbps", "read_gbps"):
            entry[k + "_best"] = max(entry[k])
        results["backends"][name] = entry
        shutil.rmtree(sub, ignore_errors=True)
    if "gdskv" in results["backends"] and "file" in results["backends"]:
        gd, fi = results["backends"]["gdskv"], results["backends"]["file"]
        results["speedup_write"] = gd["write_gbps_best"] / fi["write_gbps_best"]
        results["speedup_read"] = gd["read_gbps_best"] / fi["read_gbps_best"]
    results["host"] = {"python": sys.version.split()[0], "torch": torch.__version__,
                       "machine": platform.node(),
                       "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    return results


def main(argv=None) -> None:
    args = _args(argv)
    res = run(args)
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
