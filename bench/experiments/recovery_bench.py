"""Restart recovery time: how long opening a store takes to rebuild the directory of N pages.

Recovery reads only the journal (no slab data is read at open: pages are verified when read),
so the store is made by the tier (lazy slab files, so 100k slots take no disk space) and filled
with N COMMIT records appended through :class:`gdskv.journal.Journal` in batches, exactly the
records the tier's put path writes. ``--puts`` stores real pages through ``Tier.put_pages``
instead (slower to set up, same recovery work). Prints the seconds to open the tier.

    python bench/experiments/recovery_bench.py [--pages 100000] [--puts] [--dir DIR] [--scan]
        [--cold]

``--scan`` deletes the journal before each open, so recovery is the header scan of every slot's
trailer (:mod:`gdskv.header_scan`); the records' trailers are written into the slab files as the
put path writes them (one 4 KiB block per page: 100k pages take 400 MiB of disk).

Result it produced (bench/RESULTS.md, "CPU"): 100k pages recovered in 0.5-0.7 s on the idle
2-core development machine, up to 1.5 s under load (printed, not kept as a file).
With ``--scan``: 100k pages, 1.7 s of scan in a 2.1 s open on the same machine, files in the page
cache (printed, not kept as a file). tests/test_recovery_time.py runs it at 20k pages (100k
under ``-m slow``), tests/test_header_scan.py with ``--scan`` at 20k.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from gdskv import slot_trailer
from gdskv.config import TierConfig
from gdskv.journal import Record, RecordKind
from gdskv.layout import FORMAT_VERSION, KVLayout
from gdskv.store import JOURNAL
from gdskv.tier import Tier
from experiment_helpers import drop_all_caches

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
                recs = [Record(RecordKind.COMMIT, j.next_seq(), n, 0x9E3779B97F4A7C15 ^ n, algo,
                               f"page-{n:012d}") for n in range(start, min(start + 4096, pages))]
                _write_trailers(tier, recs)
                j.append(recs)
            j.records_written = 0  # close() must not compact records its directory never saw


def _write_trailers(tier: Tier, records: list[Record]) -> None:
    """Each record's slot trailer, where the put path would have written it."""
    sb, tb = LAYOUT.slot_bytes, slot_trailer.TRAILER_BYTES
    for r in records:
        f, off = tier.store.location(r.slot)
        os.pwrite(_buffered_fd(tier, f), slot_trailer.encode(
            FORMAT_VERSION, tier.store.store_id, r.slot, r.key, r.seq, r.checksum, r.algorithm),
            off + sb - tb)


_FDS: dict[str, int] = {}


def _buffered_fd(tier: Tier, f: int) -> int:
    """A plain descriptor of slab file ``f`` (the store's may be O_DIRECT: no unaligned I/O)."""
    path = tier.store.files[f].path
    if path not in _FDS:
        _FDS[path] = os.open(path, os.O_WRONLY)
    return _FDS[path]


def close_trailer_files() -> None:
    for fd in _FDS.values():
        os.fsync(fd)
        os.close(fd)
    _FDS.clear()


def measure(directory: str, pages: int, *, scan: bool = False) -> float:
    cfg = config(directory, pages)
    if scan:
        os.unlink(os.path.join(directory, JOURNAL))
    t0 = time.perf_counter()
    tier = Tier(LAYOUT, cfg, device="cpu")
    seconds = time.perf_counter() - t0
    try:
        assert len(tier.directory) == pages, (len(tier.directory), pages)
        assert scan == bool(tier.stats().get("header_scan_pages")), "scan expected only with --scan"
    finally:
        tier.close()
    return seconds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=100_000)
    ap.add_argument("--puts", action="store_true", help="store real pages through the tier")
    ap.add_argument("--dir", default=None, help="store directory (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cold", action="store_true",
                    help="drop the page cache before each open (root; the GPU machine's disk)")
    ap.add_argument("--scan", action="store_true",
                    help="delete the journal before each open: time the header scan")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        os.chmod(d, 0o700)
        build(d, args.pages, puts=args.puts)
        close_trailer_files()
        times = []
        for _ in range(args.repeat):
            if args.cold and not drop_all_caches():
                raise SystemExit("--cold needs root (writes /proc/sys/vm/drop_caches)")
            times.append(measure(d, args.pages, scan=args.scan))
    how = "header scan" if args.scan else "journal"
    print(f"recovered {args.pages} pages ({how}): open took {min(times):.3f} s (best of {args.repeat}; "
          f"all {', '.join(f'{t:.3f}' for t in times)})")


if __name__ == "__main__":
    main()
