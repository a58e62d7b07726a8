"""What a run measured, per job and direction, and the fio-shaped numbers derived from it.

Latencies are kept as exact samples (one per batch), so percentiles are exact order statistics
rather than fio's histogram buckets. Bandwidth samples are taken over fixed windows of
completions, as fio's ``bw`` log does every 500 ms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: fio's default ``percentile_list``
FIO_PERCENTILES = (1.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 95.0, 99.0,
                   99.5, 99.9, 99.95, 99.99)
#: fio's bandwidth/IOPS sampling window
SAMPLE_WINDOW_NS = 500_000_000

EIO = 5         # fio's "error" for failed I/Os (here: pages not stored / not restored)
EILSEQ = 84     # fio's "error" for a verify mismatch


@dataclass
class DirStats:
    """One direction (read or write) of one job or one clone."""
    io_bytes: int = 0
    total_ios: int = 0
    failed_ios: int = 0            # batches with at least one failed page
    failed_pages: int = 0
    runtime_ns: int = 0
    slat_ns: list[int] = field(default_factory=list)
    clat_ns: list[int] = field(default_factory=list)
    done_ns: list[int] = field(default_factory=list)     # completion times from phase start
    done_bytes: list[int] = field(default_factory=list)

    def add(self, slat: int, clat: int, done: int, nbytes: int) -> None:
        self.slat_ns.append(slat)
        self.clat_ns.append(clat)
        self.done_ns.append(done)
        self.done_bytes.append(nbytes)
        self.io_bytes += nbytes
        self.total_ios += 1

    @staticmethod
    def merge(parts: list["DirStats"]) -> "DirStats":
        """Clones run side by side: bytes add up, the runtime is the longest clone's."""
        out = DirStats()
        for p in parts:
            out.io_bytes += p.io_bytes
            out.total_ios += p.total_ios
            out.failed_ios += p.failed_ios
            out.failed_pages += p.failed_pages
            out.runtime_ns = max(out.runtime_ns, p.runtime_ns)
            out.slat_ns += p.slat_ns
            out.clat_ns += p.clat_ns
            out.done_ns += p.done_ns
            out.done_bytes += p.done_bytes
        return out

    # -- derived ------------------------------------------------------------------------------
    @property
    def runtime_ms(self) -> int:
        return int(round(self.runtime_ns / 1e6)) if self.io_bytes else 0

    @property
    def bw_bytes(self) -> int:
        """Bytes per second over the direction's runtime."""
        return int(self.io_bytes * 1e9 / self.runtime_ns) if self.runtime_ns and self.io_bytes \
            else 0

    @property
    def iops(self) -> float:
        return self.total_ios * 1e9 / self.runtime_ns if self.runtime_ns and self.total_ios \
            else 0.0

    def samples(self) -> tuple[list[float], list[float]]:
        """Per-window bandwidth (KiB/s) and IOPS, fio's bw/iops log."""
        if not self.done_ns:
            return [], []
        done = np.asarray(self.done_ns, dtype=np.int64)
        nbytes = np.asarray(self.done_bytes, dtype=np.int64)
        end = max(int(done.max()), 1)
        windows = max(1, end // SAMPLE_WINDOW_NS)
        width = end / windows
        idx = np.minimum((done / width).astype(np.int64), windows - 1)
        b = np.bincount(idx, weights=nbytes, minlength=windows)
        n = np.bincount(idx, minlength=windows)
        secs = width / 1e9
        return list(b / 1024 / secs), list(n / secs)


def lat_stats(samples_ns: list[int], percentiles: bool = True) -> dict[str, Any]:
    """fio's ``clat_ns``/``lat_ns``/``slat_ns`` object."""
    if not samples_ns:
        return {"min": 0, "max": 0, "mean": 0.0, "stddev": 0.0, "N": 0}
    a = np.asarray(samples_ns, dtype=np.int64)
    out: dict[str, Any] = {"min": int(a.min()), "max": int(a.max()), "mean": float(a.mean()),
                           "stddev": float(a.std(ddof=1)) if a.size > 1 else 0.0,
                           "N": int(a.size)}
    if percentiles:
        # Nearest rank (the sample at rank ceil(p/100 * N)), as fio ranks its samples;
        # always an observed value, never an interpolation.
        vals = np.percentile(a, FIO_PERCENTILES, method="inverted_cdf")
        out["percentile"] = {f"{p:.6f}": int(v) for p, v in zip(FIO_PERCENTILES, vals)}
    return out


def _sample_stats(values: list[float]) -> tuple[float, float, float, float, int]:
    if not values:
        return 0.0, 0.0, 0.0, 0.0, 0
    a = np.asarray(values, dtype=np.float64)
    return (float(a.min()), float(a.max()), float(a.mean()),
            float(a.std(ddof=1)) if a.size > 1 else 0.0, int(a.size))


def dir_json(d: DirStats, group_bw_bytes: int | None = None) -> dict[str, Any]:
    """fio's ``jobs[].read`` / ``jobs[].write`` object, same names and types."""
    bw_s, iops_s = d.samples()
    bmin, bmax, bmean, bdev, bn = _sample_stats(bw_s)
    imin, imax, imean, idev, inn = _sample_stats(iops_s)
    lat = [s + c for s, c in zip(d.slat_ns, d.clat_ns)]
    agg = 100.0 * d.bw_bytes / group_bw_bytes if group_bw_bytes else (100.0 if d.io_bytes else 0.0)
    return {
        "io_bytes": int(d.io_bytes),
        "io_kbytes": int(d.io_bytes // 1024),
        "bw_bytes": int(d.bw_bytes),
        "bw": int(d.bw_bytes // 1024),
        "iops": float(d.iops),
        "runtime": int(d.runtime_ms),
        "total_ios": int(d.total_ios),
        "short_ios": 0,
        "drop_ios": int(d.failed_ios),
        "slat_ns": lat_stats(d.slat_ns, percentiles=False),
        "clat_ns": lat_stats(d.clat_ns),
        "lat_ns": lat_stats(lat, percentiles=False),
        "bw_min": int(bmin),
        "bw_max": int(bmax),
        "bw_agg": float(agg),
        "bw_mean": float(bmean),
        "bw_dev": float(bdev),
        "bw_samples": int(bn),
        "iops_min": int(imin),
        "iops_max": int(imax),
        "iops_mean": float(imean),
        "iops_stddev": float(idev),
        "iops_samples": int(inn),
    }


@dataclass
class JobResult:
    """One reported job: a whole job (group_reporting) or one clone of it."""
    name: str
    groupid: int
    jobs: int                      # clones folded into this result
    read: DirStats
    write: DirStats
    options: dict[str, str]
    gdskv: dict[str, Any]
    error: int = 0
    elapsed_s: float = 0.0
    usr_cpu: float = 0.0           # percent of one CPU over the job's wall time
    sys_cpu: float = 0.0
    ctx: int = 0
    majf: int = 0
    minf: int = 0
    start_time: float = 0.0        # time.time() at start, for the normal report's header
    description: str = ""
    clone: int | None = None

    @property
    def job_runtime_ms(self) -> int:
        return max(self.read.runtime_ms, self.write.runtime_ms)


def fmt_num(value: float, units: tuple[str, ...], base: int, maxdigits: int = 4) -> str:
    """fio's num2str, close enough: scale until at most ``maxdigits`` integer digits."""
    i = 0
    while abs(value) >= 10 ** maxdigits and i < len(units) - 1:
        value /= base
        i += 1
    if value == 0 or abs(value) >= 100:
        text = f"{value:.0f}"
    elif abs(value) >= 10:
        text = f"{value:.1f}"
    else:
        text = f"{value:.2f}" if i else (f"{value:.0f}" if value == int(value) else f"{value:.2f}")
    return text + units[i]


def fmt_bytes_iec(n: float) -> str:
    return fmt_num(n, ("B", "KiB", "MiB", "GiB", "TiB", "PiB"), 1024)


def fmt_bytes_si(n: float) -> str:
    return fmt_num(n, ("B", "kB", "MB", "GB", "TB", "PB"), 1000)


def fmt_size_exact(n: int) -> str:
    """2MiB, 1098KiB, 4000B: the largest binary unit that divides the size exactly."""
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return f"{n}B"


def fmt_bw(bytes_per_s: float) -> str:
    """fio's bandwidth: ``511MiB/s (536MB/s)``."""
    return f"{fmt_bytes_iec(bytes_per_s)}/s ({fmt_bytes_si(bytes_per_s)}/s)"


def yes_no(value: Any) -> str:
    """One style for booleans in the normal report; anything else (``n/a``) as it is."""
    return ("yes" if value else "no") if isinstance(value, bool) else str(value)


def plural(n: int, word: str) -> str:
    """``1 page``, ``4 pages``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def fmt_count(n: float) -> str:
    return fmt_num(n, ("", "k", "M", "G"), 1000)


def gbps(nbytes_per_s: float) -> float:
    return nbytes_per_s / 1e9


def is_finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)
