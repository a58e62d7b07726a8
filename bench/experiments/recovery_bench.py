"""Restart recovery time: how long opening a store takes to rebuild the directory of N pages.

Recovery reads only the journal (no slab data is read at open: pages are verified when read),
so the store is made by the tier (lazy slab files, so 100k slots take no disk space) and filled
with N COMMIT records appended through :class:`gdskv.journal.Journal` in batches, exactly the
records the tier's put path writes. ``--puts`` stores real pages through ``Tier.put_pages``
instead (slower to set up, same recovery work). Prints the seconds to open the tier.

    python bench/experiments/recovery_bench.py [--pages 100000] [--puts] [--dir DIR]

Result it produced (bench/RESULTS.md, "CPU"): 100k pages recovered in 0.5-0.6 s on the idle
2-core development machine, up to 1.5 s under load (printed, not kept as a file).
tests/test_recovery_time.py runs it at 20k pages (100k under ``-m slow``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from gdskv.config import TierConfig
from gdskv.journal import Record, RecordKind
from gdskv.layout import KVLayout
from gdskv.tier import Tier

#: 1 layer x 1 token x 8-wide rows: 32 B pages; each takes a 4 KiB slot
LAYOUT = KVLayout(num_layers=1, page_size=1, head_dim=8)


def config(directory: str, pages: int) -> TierConfig:
    # capacity rounds down to whole stripes in every file: ask for one stripe per file more
    return TierConfig(directories=(directory,), preallocate=False, files_per_dir=4,
                      capacity=pages * LAYOUT.slot_bytes + 4 * (8 << 20), io_chunk_size=8 << 20,
                      staging_size=8 << 20)


def build(directory: str, pages: int, *, puts: bool) -> None:
    cfg = config(directory, pages)
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        if puts:
            batch = 4096
            for start in range(0, pages, batch):
                keys = [f"page-{n:012d}" for n in range(start, min(start + batch, pages))]
                data = [[torch.full((LAYOUT.page_bytes,), n % 251, dtype=torch.uint8)]
                        for n in range(len(keys))]
                assert all(tier.put_pages(keys, data))
        else:
            csum = tier._checksums
            algo = csum.algorithm
            j = tier.journal
            for start in range(0, pages, 4096):
                j.append(Record(RecordKind.COMMIT, j.next_seq(), n, 0x9E3779B97F4A7C15 ^ n, algo,
                                f"page-{n:012d}") for n in range(start, min(start + 4096, pages)))
            j.records_written = 0  # close() must not compact records its directory never saw


def measure(directory: str, pages: int) -> float:
    cfg = config(directory, pages)
    t0 = time.perf_counter()
    tier = Tier(LAYOUT, cfg, device="cpu")
    seconds = time.perf_counter() - t0
    try:
        assert len(tier.directory) == pages, (len(tier.directory), pages)
    finally:
        tier.close()
    return seconds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=100_000)
    ap.add_argument("--puts", action="store_true", help="store real pages through the tier")
    ap.add_argument("--dir", default=None, help="store directory (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        os.chmod(d, 0o700)
        build(d, args.pages, puts=args.puts)
        times = [measure(d, args.pages) for _ in range(args.repeat)]
    print(f"recovered {args.pages} pages: open took {min(times):.3f} s (best of {args.repeat}; "
          f"all {', '.join(f'{t:.3f}' for t in times)})")


if __name__ == "__main__":
    main()
