"""A hybrid model's L3 read (KV + its sidecar pool) against the KV read alone, in one call.

What SGLang's cache controller does for each 128-page batch of a prefetch of a model with a
KV-derived sidecar pool (``CacheController._page_transfer_kv_batch``): ``batch_get_v1`` of the KV
pages, then ``batch_get_v2`` of the sidecar's pages for the same keys. This drives the SGLang
adapter's data path through gdskv alone (no sglang needed), the KV read alone being a plain
model's: its tier reads page-format regions of a ``page_first_direct`` host pool
(``Tier.get_pages``, as the adapter's v1 path does). The hybrid read is, with
``--sidecar-store``:

- ``kv-page`` (the adapter's default for a pool SGLang declares KV-derived): the sidecar's page
  rides in its KV page (:func:`gdskv.adapters.sglang.sidecar.kv_slot_layout` and
  ``kv_slot_config``), so ``batch_get_v1`` reads each page's KV region and sidecar region in
  one read, and ``batch_get_v2`` is answered from that read
  (:class:`gdskv.adapters.sglang.sidecar.LastRead`, timed);
- ``own``: the sidecar in a store of its own (:class:`gdskv.layout.BytePageLayout`, set up by
  the adapter's :func:`gdskv.adapters.sglang.sidecar.store_config`), read by a second call into
  its page-first regions of the sidecar host buffer (the adapter's zero-copy ``regions`` mode).

Model: DeepSeek-V3.2 (DSA) by default: MLA KV, 61 layers x 576 bf16 per token, and the DSA
indexer (``INDEXER``, ``ALL_PAGES``), 61 layers x 132 B per token (128 fp8 key bytes + one fp32
scale per 128), both in SGLang's 64-token pages: 4.29 MiB of KV and 0.49 MiB of indexer a page,
so the sidecar adds 11.5 % to the bytes read.

Each pass reads every page once, batch by batch, after dropping the slab files from the page
cache (``fadvise``; O_DIRECT reads do not use it anyway). Batches alternate "KV alone" and "KV +
sidecar", and the next pass swaps them, so each pair of neighbouring batches compares the two
reads moments apart. Every byte gdskv read is checked against what was written (outside the
timing). The sidecar's cost is the hybrid time over the KV-alone time, minus one, against its
share of the bytes (sidecar bytes over KV bytes): it should cost no more. Two figures: the
total over all pairs (what a prefetch of many batches waits for) and the median over pairs
(less moved by one slow batch), each with the 2.5-97.5 % range of 2000 bootstrap resamples of
the pairs.

With ``--raw`` (kv-page, the default there) every other pair of batches in a pass is read with
plain ``preadv`` instead of gdskv, the same slots of the same files (one read a page, on as
many threads, the stores' own descriptors: O_DIRECT where they have it), and the next pass
swaps which pairs: what the medium itself charges for the hybrid page's bytes, measured at the
same moments as gdskv.

    python bench/experiments/hybrid_read.py --dir /mnt/nvme/bench --out hybrid.json

Result it produced (bench/RESULTS.md, "Hybrid models"), under bench/results/:
``cpu-2026-11-23/hybrid-read/`` (the development machine, /dev/shm, under load: noise-bound;
``own``, then the only way), ``h100-2026-11-25/kv-page/`` (both ways, the H100 machine) and
``cpu-2026-11-25/kv-page/`` (both ways, the development machine, with CPU time per byte) and
``h100-2026-11-25/kv-page-direct/`` (the KV page with its indexer under O_DIRECT, with plain
``preadv`` of the same slots in passes of their own, after gdskv's) and
``h100-2026-11-25/kv-page-pinned-rows/`` and ``h200-2026-11-25/kv-page-pinned-rows/`` (plain
``preadv`` interleaved with gdskv's reads, totals and medians; the scratch rows' memory).
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import platform
import random
import shutil
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

import experiment_helpers
from gdskv.adapters.sglang.sidecar import (
    CONTROLLER_BATCH_PAGES,
    LastRead,
    kv_slot_config,
    kv_slot_layout,
    store_config,
)
from gdskv.bench.cache import drop_page_cache
from gdskv import host_pages
from gdskv.backends import posix
from gdskv.config import DirectIO, TierConfig
from gdskv.layout import BytePageLayout, KVLayout, align_up
from gdskv.memory import alloc_host, host_numpy
from gdskv.tier import Tier

#: name: (KV layout fields, sidecar bytes per token, sidecar pool name)
MODELS = {
    "deepseek-v3.2": (dict(num_layers=61, page_size=64, head_dim=576, kv_heads=1, mla=True,
                           dtype="bf16", model_name="deepseek-ai/DeepSeek-V3.2"),
                      61 * 132, "indexer"),
}


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="directory on the drive under test (a "
                    "subdirectory is made and removed)")
    ap.add_argument("--out", help="write the JSON results here (also printed)")
    ap.add_argument("--model", default="deepseek-v3.2", choices=sorted(MODELS))
    ap.add_argument("--pages", type=int, default=1024, help="KV pages written and read per pass")
    ap.add_argument("--passes", type=int, default=4, help="timed passes over all pages")
    ap.add_argument("--batch-pages", type=int, default=CONTROLLER_BATCH_PAGES,
                    help="pages per read call (SGLang's STORAGE_BATCH_SIZE by default)")
    ap.add_argument("--backend", default="auto", help="gdskv backend (auto: kvikio where the "
                    "tier stages on CUDA, posix otherwise)")
    ap.add_argument("--device", default="cpu", help="where the tiers stage pages: cpu (the "
                    "adapter's default) or cuda")
    ap.add_argument("--sidecar-store", choices=["kv-page", "own"], default="kv-page",
                    help="the sidecar's page in its KV page (the adapter's default for a "
                    "KV-derived pool) or in a store of its own")
    ap.add_argument("--hybrid-store-first", action="store_true", help="create (and so "
                    "preallocate) the hybrid read's store before the KV-alone store: where on the "
                    "drive each store lands, checked")
    ap.add_argument("--sidecar-direct-io", choices=["adapter", "on", "off"], default="adapter",
                    help="the sidecar store's O_DIRECT: as the SGLang adapter sets it (default), "
                    "or forced (to compare)")
    ap.add_argument("--no-readahead-hint", action="store_true", help="posix buffered reads "
                    "without their POSIX_FADV_WILLNEED hint (to compare)")
    ap.add_argument("--staging-size", default="256MiB", help="KV tier staging (GDSKV_STAGING_SIZE)")
    ap.add_argument("--raw", action=argparse.BooleanOptionalAction, default=True,
                    help="every other pair of batches read with plain preadv of the same slots "
                    "on as many threads (no gdskv), interleaved with gdskv's: what the medium "
                    "charges for the hybrid page's bytes (kv-page only)")
    ap.add_argument("--plain-memory", choices=sorted(MEMORY_KINDS), default="default",
                    help="the plain reads' buffers: as gdskv's host pools (default: pinned where "
                    "CUDA is usable), pageable (an anonymous mapping), huge (the same, advised to "
                    "transparent huge pages) or pinned (CUDA's)")
    ap.add_argument("--scratch-memory", choices=["gdskv"] + sorted(MEMORY_KINDS),
                    default="gdskv", help="gdskv's scratch rows (the indexer's unaligned "
                    "region is read into them): as gdskv allocates them, or forced (to compare)")
    ap.add_argument("--io-threads", type=int, help="GDSKV_IO_THREADS for both stores (and the "
                    "plain reads)")
    return ap.parse_args(argv)


def _huge_page_mapping(nbytes: int) -> torch.Tensor:
    """``nbytes`` of an anonymous mapping (page aligned) advised to transparent huge pages."""
    m = mmap.mmap(-1, max(nbytes, 4096))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    return torch.from_numpy(np.frombuffer(m, dtype=np.uint8))[:nbytes]


#: host memory an O_DIRECT read may land in: the kinds compared (on the GPU machines' disk the
#: kind changed the read's speed: bench/RESULTS.md, "Pinned scratch rows")
MEMORY_KINDS = {
    "pageable": lambda n: alloc_host(n, pin=False),   # an anonymous mapping
    "huge": _huge_page_mapping,
    "pinned": lambda n: alloc_host(n, pin=True),
    # gdskv's and SGLang's host buffers: pinned where CUDA is usable, pageable otherwise
    "default": lambda n: alloc_host(n),
}


def _storage_read_bytes() -> int:
    """Bytes this process has had fetched from storage (``/proc/self/io`` ``read_bytes``: page
    cache fills and O_DIRECT reads, not tmpfs); 0 where the kernel does not say."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _host_pool(num_pages: int, page_bytes: int, seed: int) -> torch.Tensor:
    """A page-first host buffer of random bytes, pinned where CUDA is there and 4 KiB aligned
    (SGLang pins its host pools, and pinned buffers start on a page boundary: without CUDA, an
    unaligned buffer would send the O_DIRECT KV reads through staging here but not there)."""
    g = torch.Generator().manual_seed(seed)
    buf = alloc_host(num_pages * page_bytes).view(num_pages, page_bytes)
    buf.copy_(torch.randint(0, 256, (num_pages, page_bytes), dtype=torch.uint8, generator=g))
    return buf


class PlainReads:
    """Plain reads of pages' slots: the payload rounded up to 4 KiB, one ``preadv`` a page into
    a buffer of the reading thread's own, on ``threads`` threads, through the store's own file
    descriptors (O_DIRECT where it has it)."""

    def __init__(self, threads: int, max_bytes: int, memory: str = "pageable") -> None:
        self._local = threading.local()
        self._max = align_up(max_bytes)
        self._alloc = MEMORY_KINDS[memory]
        self._pool = ThreadPoolExecutor(threads, initializer=self._buffer)

    def _buffer(self) -> None:  # each thread's, made when the thread starts (untimed warm-up)
        self._local.buf = host_numpy(self._alloc(self._max))

    def _read(self, fd: int, offset: int, nbytes: int) -> None:
        if os.preadv(fd, [self._local.buf[:nbytes]], offset) != nbytes:
            raise RuntimeError("a plain read came back short")

    def batch(self, tier: Tier, keys: list) -> float:
        """Seconds to read the slots of ``keys`` (pinned meanwhile, outside the clock)."""
        slots = tier.pin(keys)
        try:
            if any(s is None for s in slots):
                raise RuntimeError("a page to read plainly is not stored")
            where = [tier.store.location(s) for s in slots]
            nbytes = align_up(tier.layout.page_bytes)
            t0 = time.perf_counter()
            for f in [self._pool.submit(self._read, tier.store.files[fi].fd, off, nbytes)
                      for fi, off in where]:
                f.result()
            return time.perf_counter() - t0
        finally:
            tier.unpin([s for s in slots if s is not None])

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _pairs(times: list, engine: str) -> list:
    """(KV-alone seconds, hybrid seconds) of each pair of neighbouring batches (positions 2i,
    2i + 1) that ``engine`` read, of equal size."""
    out = []
    for a, b in zip(times[::2], times[1::2]):
        if a["engine"] == b["engine"] == engine and a["pages"] == b["pages"]:
            kv, hy = (b, a) if a["hybrid"] else (a, b)
            out.append((kv["s"], hy["s"]))
    return out


def _ratios(pairs: list, seed: int = 1, resamples: int = 2000) -> dict:
    """Hybrid over KV alone: over all pairs' total time and the median over pairs, each with
    the 2.5-97.5 % range of its value over bootstrap resamples of the pairs."""
    def total(ps):
        return sum(h for _, h in ps) / sum(k for k, _ in ps)

    def median(ps):
        return statistics.median(h / k for k, h in ps)

    rng = random.Random(seed)
    draws = [rng.choices(pairs, k=len(pairs)) for _ in range(resamples)]
    out = {}
    for name, stat in (("total", total), ("median", median)):
        values = sorted(stat(d) for d in draws)
        out[name] = stat(pairs)
        out[f"{name}_range"] = [values[int(0.025 * resamples)],
                                values[int(0.975 * resamples) - 1]]
    return out


def main(args) -> dict:
    kv_fields, side_bytes_per_token, side_name = MODELS[args.model]
    kv_layout = KVLayout(**kv_fields)
    side_layout = BytePageLayout(page_bytes=side_bytes_per_token * kv_layout.page_size,
                                 kind=f"sglang/{side_name}/bench/page_first_direct/regions",
                                 model_name=kv_layout.model_name)
    n = args.pages
    root = os.path.join(args.dir, f"gdskv-hybrid-{os.getpid()}")
    kv_dir, side_dir = os.path.join(root, "kv"), os.path.join(root, side_name)
    os.makedirs(kv_dir)
    os.makedirs(side_dir)
    # room for every page with stripe rounding to spare: nothing is evicted
    base = TierConfig.from_env(directories=(kv_dir,), backend=args.backend,
                               staging_size=args.staging_size,
                               capacity=(n + 256) * kv_layout.slot_bytes,
                               **({"io_threads": args.io_threads} if args.io_threads else {}))
    in_kv_page = args.sidecar_store == "kv-page"
    if in_kv_page:  # the hybrid tier's page: the KV page, then the sidecar's (as the adapter)
        side_bytes = side_layout.page_bytes
        side_layout = kv_slot_layout(kv_layout, "page_first_direct", [(
            f"{side_name}(bench,page_first_direct,regions,{side_bytes})", side_bytes)])
        side_config = kv_slot_config(base, side_layout, kv_layout.page_bytes, [side_bytes],
                                     directories=(side_dir,))
    else:
        side_config = store_config(base, side_layout, directories=(side_dir,),
                                   kv_capacity=base.capacity,
                                   pool_host_bytes=side_layout.page_bytes,
                                   kv_host_bytes=kv_layout.page_bytes)
    side_config = side_config.replace(capacity=(n + 256) * side_layout.slot_bytes)
    sidecar_page_bytes = side_layout.page_bytes - (kv_layout.page_bytes if in_kv_page else 0)
    if args.no_readahead_hint:
        posix.READAHEAD_HINT_BYTES = 1 << 62
    if args.scratch_memory != "gdskv":
        host_pages.alloc_host = lambda n, pin=None: MEMORY_KINDS[args.scratch_memory](n)
    if args.sidecar_direct_io != "adapter":
        side_config = side_config.replace(direct_io=DirectIO(args.sidecar_direct_io))
    # host pools: what SGLang's page_first_direct pools hold, written from `src`, read to `dst`
    kv_src, kv_dst = _host_pool(n, kv_layout.page_bytes, 1), _host_pool(n, kv_layout.page_bytes, 2)
    sd_src = _host_pool(n, sidecar_page_bytes, 3)
    sd_dst = _host_pool(n, sidecar_page_bytes, 4)
    keys = [f"{i:064x}" for i in range(n)]
    bp = args.batch_pages
    batches = [range(i, min(i + bp, n)) for i in range(0, n, bp)]
    # each batch's host indices, as SGLang hands them to both calls (page_size slots a page)
    slots = [torch.arange(b.start * kv_layout.page_size, b.stop * kv_layout.page_size)
             for b in batches]
    last_read = LastRead()

    def sidecar_regions(i: int) -> list:
        """Page i's regions in the hybrid tier: the KV page's, then the sidecar's."""
        return [kv_dst[i], sd_dst[i]] if in_kv_page else [sd_dst[i]]

    result = {"model": args.model, "pages": n, "batch_pages": bp,
              "kv_page_bytes": kv_layout.page_bytes, "sidecar": side_name,
              "sidecar_store": args.sidecar_store,
              "sidecar_page_bytes": sidecar_page_bytes, "device": args.device,
              "dir": args.dir, "host": platform.node(),
              "torch": torch.__version__, "passes": []}
    # seconds, bytes, CPU seconds (all the process's threads: a measure the machine's other
    # load moves less than the wall time), bytes fetched from storage; gdskv's reads only
    per_kind = {"kv": [0.0, 0, 0.0, 0], "kv+sidecar": [0.0, 0, 0.0, 0]}
    pairs = {"gdskv": [], "raw": []}
    sidecar_calls = []  # in a hybrid batch: the sidecar call's time over its KV call's
    raw = args.raw and in_kv_page  # (own: two stores to read, no one slot to compare)
    try:
        with contextlib.ExitStack() as stack:
            order = [(kv_layout, base), (side_layout, side_config)]
            if args.hybrid_store_first:
                order.reverse()
            tiers = [stack.enter_context(Tier(lay, cfg, device=args.device)) for lay, cfg in order]
            kv, side = tiers[::-1] if args.hybrid_store_first else tiers
            plain = PlainReads(base.io_threads, side_layout.page_bytes,
                               args.plain_memory) if raw else None
            if plain is not None:
                stack.callback(plain.close)
            result["hybrid_store_first"] = args.hybrid_store_first
            result["backend"] = kv.backend.name
            result["backend_detail"] = kv.backend.describe()
            result["o_direct"] = kv.store.direct
            result["sidecar_o_direct"] = side.store.direct
            result["readahead_hint"] = not args.no_readahead_hint
            result["raw_interleaved"] = raw
            result["plain_memory"] = args.plain_memory
            result["scratch_memory"] = args.scratch_memory
            for b in batches:  # write once (untimed)
                ks = [keys[i] for i in b]
                sources = [[kv_src[i], sd_src[i]] if in_kv_page else [sd_src[i]] for i in b]
                if not (all(kv.put_pages(ks, [[kv_src[i]] for i in b])) and
                        all(side.put_pages(ks, sources))):
                    raise RuntimeError("a page write failed")
            if plain is not None:  # every plain-read thread started, its buffer made
                for tier in (kv, side):
                    plain.batch(tier, [keys[i] for i in batches[0]])
            slabs = [f.path for f in kv.store.files] + [f.path for f in side.store.files]
            for p in range(args.passes):
                kv_dst.zero_()
                sd_dst.zero_()
                dropped = drop_page_cache(slabs)
                times, read_kv, read_sidecar = [], [], []
                for j, b in enumerate(batches):
                    # batches alternate kinds, and swap them from pass to pass: each pair of
                    # neighbours is one KV-alone and one hybrid read of as many pages, moments
                    # apart (the noise of a shared machine hits both alike); with plain reads,
                    # pairs alternate gdskv and plain reads, swapped from pass to pass too
                    hybrid = (j + p) % 2 == 1
                    engine = "raw" if raw and (j // 2 + p) % 2 else "gdskv"
                    ks = [keys[i] for i in b]
                    if engine == "raw":
                        times.append({"engine": engine, "hybrid": hybrid, "pages": len(b),
                                      "s": plain.batch(side if hybrid else kv, ks)})
                        continue
                    io0, c0, t0 = _storage_read_bytes(), time.process_time(), time.perf_counter()
                    if hybrid and in_kv_page:  # batch_get_v1 reads both; batch_get_v2 asks
                        ok = side.get_pages(ks, [sidecar_regions(i) for i in b])
                        last_read.remember(ks, slots[j], ok)
                        t_kv = time.perf_counter()
                        ok = ok + (last_read.hits(ks, slots[j]) or [False])
                        last_read.forget()
                    else:
                        ok = kv.get_pages(ks, [[kv_dst[i]] for i in b])
                        t_kv = time.perf_counter()
                        if hybrid:
                            ok += side.get_pages(ks, [sidecar_regions(i) for i in b])
                    dt = time.perf_counter() - t0
                    cpu = time.process_time() - c0
                    fetched = _storage_read_bytes() - io0
                    if not all(ok):
                        raise RuntimeError(f"a page read failed (pass {p}, batch {j})")
                    times.append({"engine": engine, "hybrid": hybrid, "pages": len(b), "s": dt,
                                  **({"sidecar_s": t0 + dt - t_kv} if hybrid else {})})
                    read_kv += b
                    if hybrid:
                        read_sidecar += b
                        sidecar_calls.append((t0 + dt - t_kv) / (t_kv - t0))
                    kind = per_kind["kv+sidecar" if hybrid else "kv"]
                    kind[0] += dt
                    kind[2] += cpu
                    kind[3] += fetched
                    kind[1] += len(b) * (kv_layout.page_bytes +
                                         (sidecar_page_bytes if hybrid else 0))
                if not torch.equal(kv_dst[read_kv], kv_src[read_kv]) or not torch.equal(
                        sd_dst[read_sidecar], sd_src[read_sidecar]):
                    raise RuntimeError(f"pass {p}: bytes read differ from bytes written")
                for engine in pairs:
                    pairs[engine] += _pairs(times, engine)
                result["passes"].append({"batches": [
                    {"engine": t["engine"], "kind": "kv+sidecar" if t["hybrid"] else "kv",
                     "pages": t["pages"], "ms": t["s"] * 1e3,
                     **({"sidecar_ms": t["sidecar_s"] * 1e3} if "sidecar_s" in t else {})}
                    for t in times], "cache": dropped.get("summary", "")})
            for name, tier in (("kv", kv), ("sidecar", side)):  # which path the reads took
                st = tier.stats()
                result[f"{name}_pages_read_in_place"] = st.get("pages_read_in_place", 0)
                result[f"{name}_pages_read_staged"] = st.get("region_pages_read_staged", 0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if not pairs["gdskv"]:
        raise RuntimeError(f"no pair of {bp}-page batches read by gdskv: use --pages >= "
                           f"{(4 if raw else 2) * bp}")
    share = sidecar_page_bytes / kv_layout.page_bytes
    result.update({f"{k}_GBps": nbytes / sec / 1e9 for k, (sec, nbytes, *_) in per_kind.items()})
    # CPU time per byte read, the hybrid read's over the KV read's: 1.0 when the sidecar's
    # bytes cost what the KV's do
    cpu_per_byte = {k: cpu / nbytes for k, (_, nbytes, cpu, _) in per_kind.items()}
    # bytes fetched from storage per byte read (1.0: no readahead past what was asked; 0 on
    # tmpfs, whose pages are the data)
    result.update({f"{k}_storage_bytes_per_byte": fetched / nbytes
                   for k, (_, nbytes, _, fetched) in per_kind.items()})
    result.update(cpu_per_byte_hybrid_over_kv=cpu_per_byte["kv+sidecar"] / cpu_per_byte["kv"])
    result.update(sidecar_call_over_kv_call=statistics.median(sidecar_calls))
    ours = _ratios(pairs["gdskv"])
    result.update(pairs=len(pairs["gdskv"]),
                  hybrid_over_kv_per_pair=[h / k for k, h in pairs["gdskv"]],
                  pair_seconds=pairs["gdskv"],
                  sidecar_time_fraction=ours["median"] - 1,
                  sidecar_time_fraction_range=[min(h / k for k, h in pairs["gdskv"]) - 1,
                                               max(h / k for k, h in pairs["gdskv"]) - 1],
                  sidecar_time_fraction_bootstrap=[x - 1 for x in ours["median_range"]],
                  sidecar_total_time_fraction=ours["total"] - 1,
                  sidecar_total_time_fraction_bootstrap=[x - 1 for x in ours["total_range"]],
                  sidecar_byte_fraction=share,
                  sidecar_within_its_share=ours["total"] - 1 <= share)
    if pairs["raw"]:  # what plain reads of the same slots pay for the hybrid page's bytes
        theirs = _ratios(pairs["raw"])
        result.update(raw_pairs=len(pairs["raw"]),
                      raw_hybrid_over_kv_per_pair=[h / k for k, h in pairs["raw"]],
                      raw_pair_seconds=pairs["raw"],
                      raw_sidecar_time_fraction=theirs["median"] - 1,
                      raw_sidecar_time_fraction_bootstrap=[x - 1 for x in theirs["median_range"]],
                      raw_sidecar_total_time_fraction=theirs["total"] - 1,
                      raw_sidecar_total_time_fraction_bootstrap=[
                          x - 1 for x in theirs["total_range"]],
                      # gdskv's KV-alone time over plain reads' (their pairs' totals): what
                      # gdskv adds to a plain model's read on this medium
                      gdskv_kv_over_raw_kv=(sum(k for k, _ in pairs["gdskv"]) / len(pairs["gdskv"]))
                      / (sum(k for k, _ in pairs["raw"]) / len(pairs["raw"])))
    return result


def _fraction(r: dict, prefix: str, name: str) -> str:
    """``+12.3 % [+11.0, +13.9]`` for ``{prefix}sidecar_{name}`` and its bootstrap range."""
    lo, hi = r[f"{prefix}sidecar_{name}_bootstrap"]
    return f"{100 * r[f'{prefix}sidecar_{name}']:+.1f} % [{100 * lo:+.1f}, {100 * hi:+.1f}]"


def report(r: dict) -> str:
    return "\n".join([
        f"{r['model']}: {r['pages']} pages, {r['batch_pages']}-page batches, backend "
        f"{r['backend']}, staging on {r['device']}, {r['dir']}, sidecar store "
        f"{r['sidecar_store']}",
        "| read | GB/s (all bytes read) |", "|---|---|",
        f"| KV alone | {r['kv_GBps']:.2f} |",
        f"| KV + {r['sidecar']} | {r['kv+sidecar_GBps']:.2f} |",
        f"sidecar time over {r['pairs']} pairs: total "
        f"{_fraction(r, '', 'total_time_fraction')}, median "
        f"{_fraction(r, '', 'time_fraction')} for {100 * r['sidecar_byte_fraction']:+.1f} % "
        f"bytes ({'within' if r['sidecar_within_its_share'] else 'OVER'} its share, total); "
        f"the sidecar call alone: {100 * r['sidecar_call_over_kv_call']:.1f} % of the KV call "
        f"before it; CPU time per byte, hybrid over KV alone: "
        f"{r['cpu_per_byte_hybrid_over_kv']:.3f}; bytes fetched from storage per byte read: "
        f"KV {r['kv_storage_bytes_per_byte']:.3f}, hybrid "
        f"{r['kv+sidecar_storage_bytes_per_byte']:.3f}"] + ([
        f"plain preadv of the same slots, interleaved ({r['raw_pairs']} pairs): hybrid over KV "
        f"alone total {_fraction(r, 'raw_', 'total_time_fraction')}, median "
        f"{_fraction(r, 'raw_', 'time_fraction')}; gdskv's KV-alone time over plain reads' "
        f"{r['gdskv_kv_over_raw_kv']:.3f}"] if "raw_pairs" in r else []))


if __name__ == "__main__":
    options = _args()
    res = main(options)
    experiment_helpers.print_result(res, options.out, report(res))
