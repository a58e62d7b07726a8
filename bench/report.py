"""Reports in fio's three shapes: normal text, JSON (fio's field names) and terse (``;``).

A script written against fio's JSON reads ours: ``jobs[].read|write`` carry fio's keys with
fio's types (checked against a real fio 3.33 sample in the tests). What fio has no name for
goes in a per-job ``gdskv`` object (engine, backend, GPU-direct, compat mode, O_DIRECT, page
engine path, layout, page bytes, page-cache drop, verify outcome, break-even).
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Sequence
from typing import Any

from .measurements import (FIO_PERCENTILES, DirStats, JobResult, dir_json, fmt_bw,
                           fmt_bytes_iec, fmt_bytes_si, fmt_count, fmt_size_exact, lat_stats,
                           plural, yes_no)

VERSION = "gdskv-bench-0.1.0"
TERSE_VERSION = 3


def _group_bw(results: Sequence[JobResult], groupid: int, direction: str) -> int:
    return sum(getattr(r, direction).bw_bytes for r in results if r.groupid == groupid)


# -- JSON -------------------------------------------------------------------------------------

def job_json(r: JobResult, results: Sequence[JobResult]) -> dict[str, Any]:
    empty = DirStats()
    return {
        "jobname": r.name,
        "groupid": r.groupid,
        "error": r.error,
        "eta": 0,
        "elapsed": int(round(r.elapsed_s)),
        "job options": dict(r.options),
        "read": dir_json(r.read, _group_bw(results, r.groupid, "read")),
        "write": dir_json(r.write, _group_bw(results, r.groupid, "write")),
        "trim": dir_json(empty),
        "job_runtime": r.job_runtime_ms,
        "usr_cpu": float(r.usr_cpu),
        "sys_cpu": float(r.sys_cpu),
        "ctx": int(r.ctx),
        "majf": int(r.majf),
        "minf": int(r.minf),
        "gdskv": r.gdskv,
    }


def to_json(results: Sequence[JobResult], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    now = time.time()
    out: dict[str, Any] = {
        "fio version": VERSION,
        "timestamp": int(now),
        "timestamp_ms": int(now * 1000),
        "time": time.strftime("%a %b %d %H:%M:%S %Y", time.localtime(now)),
        "jobs": [job_json(r, results) for r in results],
    }
    if extra:
        out.update(extra)
    return out


# -- normal -----------------------------------------------------------------------------------

def _lat_unit(values: Sequence[float]) -> tuple[str, float]:
    """fio prints usec, or msec once every figure is over 1000 usec."""
    if values and min(values) > 1000_000:
        return "msec", 1e6
    return "usec", 1e3


def _dir_lines(label: str, d: DirStats) -> list[str]:
    if not d.total_ios:
        return []
    lines = [f"  {label}: IOPS={fmt_count(d.iops)}, BW={fmt_bw(d.bw_bytes)}"
             f"({fmt_bytes_iec(d.io_bytes)}/{d.runtime_ms}msec)"]
    st = lat_stats(d.clat_ns)
    unit, div = _lat_unit([st["min"], st["max"], st["mean"]])
    lines.append(f"    clat ({unit}): min={st['min'] / div:.0f}, max={st['max'] / div:.0f}, "
                 f"avg={st['mean'] / div:.2f}, stdev={st['stddev'] / div:.2f}")
    lt = lat_stats([s + c for s, c in zip(d.slat_ns, d.clat_ns)], percentiles=False)
    unit_l, div_l = _lat_unit([lt["min"], lt["max"], lt["mean"]])
    lines.append(f"     lat ({unit_l}): min={lt['min'] / div_l:.0f}, max={lt['max'] / div_l:.0f}, "
                 f"avg={lt['mean'] / div_l:.2f}, stdev={lt['stddev'] / div_l:.2f}")
    pct = st["percentile"]
    punit, pdiv = _lat_unit(list(pct.values()))
    lines.append(f"    clat percentiles ({punit}):")
    cells = [f"{p:5.2f}th=[{pct[f'{p:.6f}'] / pdiv:5.0f}]" for p in FIO_PERCENTILES]
    for i in range(0, len(cells), 4):
        lines.append("     | " + ", ".join(cells[i:i + 4]) + ("," if i + 4 < len(cells) else ""))
    if d.failed_ios:
        lines.append(f"    failed: batches={d.failed_ios}, pages={d.failed_pages}")
    return lines


def _gdskv_lines(g: dict[str, Any]) -> list[str]:
    if g.get("failed"):
        return [f"  gdskv: engine={g.get('engine')}, backend={g.get('backend')}: "
                f"FAILED: {g['failed']}"]
    lay = g.get("layout", {})
    geo = (f"{lay.get('model_name') or '?'} {'MLA' if lay.get('mla') else 'MHA'} "
           f"layers={lay.get('num_layers')} kv_heads={lay.get('kv_heads')} "
           f"head_dim={lay.get('head_dim')} {lay.get('dtype')} page_tokens={lay.get('page_size')}")
    lines = [f"  gdskv: engine={g.get('engine')}, backend={g.get('backend')}, "
             f"mem={g.get('mem')}, gpu_direct={yes_no(bool(g.get('gpu_direct')))}, "
             f"compat_mode={yes_no(g.get('compat_mode'))}, "
             f"O_DIRECT={yes_no(bool(g.get('o_direct')))}",
             f"  layout: {geo}, page={fmt_size_exact(g.get('page_bytes', 0))} "
             f"(slot {fmt_size_exact(g.get('slot_bytes', 0))}), "
             f"batch={plural(g.get('pages_per_batch') or 0, 'page')}, "
             f"iodepth={g.get('iodepth')}"]
    if g.get("page_engine"):  # gdskv's host page I/O and checksums: native or python
        pe = g.get("page_engine_detail") or {}
        lines.append(f"  page engine: {g['page_engine']} ({pe.get('reason', '?')}; CRC-32C by "
                     f"{pe.get('checksum', '?')})")
    store = g.get("store")
    if store:
        fs = "/".join(g.get("fs_types") or ["?"])
        # the job's own directories, as `gdskv info` takes them (a fresh one per job and
        # engine under each directory given, so runs never reuse a store)
        where = shlex.join(store["directories"])
        lines.append(
            f"  store: {f'kept in {where}' if store['kept'] else f'{where}, removed (unlink=1)'} "
            f"({fs}; made under the directory from {store['directories_from']}"
            f"{'; slab bytes only, no page directory' if g.get('engine') == 'raw' else ''}), "
            f"capacity={fmt_size_exact(store['capacity'])} "
            f"({store['capacity_from']}), "
            f"{plural(store['files_per_dir'], 'slab file')} per directory, "
            f"preallocated={yes_no(bool(store['preallocate']))}")
    if g.get("note"):
        lines.append(f"  note: {g['note']}")
    inv = g.get("invalidate")
    if inv:
        lines.append(f"  page cache before reads: {inv.get('summary')}")
    ver = g.get("verify")
    if ver:
        state = "OK" if ver.get("ok") else "FAILED"
        lines.append(f"  verify: {state} pages_checked={ver.get('pages_checked')}, "
                     f"mismatched={ver.get('mismatched')}, missing={ver.get('missing')}")
    be = g.get("break_even")
    if be:
        restore = be.get("restore_us_per_token")
        lines.append(
            f"  break-even @ {be['prefill_tflops']:g} TFLOPS: recompute="
            f"{be['recompute_us_per_token']:.2f} usec/token, restore="
            + (f"{restore:.2f} usec/token" if restore is not None else "n/a (no read phase)")
            + f", break-even disk bandwidth={fmt_bw(be['break_even_bytes_per_s'])}"
            + (f", restore is {be['restore_speedup']:.2f}x faster than recompute"
               if be.get("restore_speedup") else ""))
    return lines


def to_normal(results: Sequence[JobResult], extra_lines: Sequence[str] = ()) -> str:
    out: list[str] = []
    for r in results:
        stamp = time.strftime("%a %b %d %H:%M:%S %Y", time.localtime(r.start_time or time.time()))
        out.append(f"{r.name}: (groupid={r.groupid}, jobs={r.jobs}): err={r.error:2d}: "
                   f"pid={_pid()}: {stamp}")
        if r.description:
            out.append(f"  Description  : [{r.description}]")
        out += _dir_lines(" read", r.read)
        out += _dir_lines("write", r.write)
        out.append(f"  cpu          : usr={r.usr_cpu:.2f}%, sys={r.sys_cpu:.2f}%, ctx={r.ctx}, "
                   f"majf={r.majf}, minf={r.minf}")
        out += _gdskv_lines(r.gdskv)
    for gid in sorted({r.groupid for r in results}):
        group = [r for r in results if r.groupid == gid]
        out.append("")
        out.append(f"Run status group {gid} (all jobs):")
        for label, direction in (("   READ", "read"), ("  WRITE", "write")):
            ds = [getattr(r, direction) for r in group if getattr(r, direction).total_ios]
            if not ds:
                continue
            total = DirStats.merge(ds)
            bws = [d.bw_bytes for d in ds]
            runs = [d.runtime_ms for d in ds]
            out.append(
                f"{label}: bw={fmt_bytes_iec(total.bw_bytes)}/s ({fmt_bytes_si(total.bw_bytes)}/s), "
                f"{fmt_bytes_iec(min(bws))}/s-{fmt_bytes_iec(max(bws))}/s "
                f"({fmt_bytes_si(min(bws))}/s-{fmt_bytes_si(max(bws))}/s), "
                f"io={fmt_bytes_iec(total.io_bytes)} ({fmt_bytes_si(total.io_bytes)}), "
                f"run={min(runs)}-{max(runs)}msec")
    out += list(extra_lines)
    return "\n".join(out) + "\n"


def _pid() -> int:
    import os
    return os.getpid()


# -- terse ------------------------------------------------------------------------------------

def _terse_dir(d: DirStats) -> list[str]:
    """fio terse v3 fields of one direction (latencies in usec, bandwidth in KiB/s)."""
    j = dir_json(d)
    f: list[str] = [str(j["io_kbytes"]), str(j["bw"]), str(int(round(j["iops"]))), str(j["runtime"])]
    for key in ("slat_ns", "clat_ns"):
        s = j[key]
        f += [str(s["min"] // 1000), str(s["max"] // 1000), f"{s['mean'] / 1000:.6f}",
              f"{s['stddev'] / 1000:.6f}"]
        if key == "clat_ns":
            pct = s.get("percentile", {})
            f += [f"{p:.6f}%={pct.get(f'{p:.6f}', 0) // 1000}" for p in FIO_PERCENTILES]
            f += ["0%=0"] * 3   # fio pads the percentile list to 20 entries
    s = j["lat_ns"]
    f += [str(s["min"] // 1000), str(s["max"] // 1000), f"{s['mean'] / 1000:.6f}",
          f"{s['stddev'] / 1000:.6f}"]
    f += [str(j["bw_min"]), str(j["bw_max"]), f"{j['bw_agg']:.6f}%", f"{j['bw_mean']:.6f}",
          f"{j['bw_dev']:.6f}"]
    return f


def to_terse(results: Sequence[JobResult]) -> str:
    """fio terse v3 lines, fields 1-92 (header, read, write, cpu). fio's later fields (IO depth
    distributions, disk util) are not measured here and left out."""
    lines = []
    for r in results:
        f = [str(TERSE_VERSION), VERSION, r.name, str(r.groupid), str(r.error)]
        f += _terse_dir(r.read) + _terse_dir(r.write)
        f += [f"{r.usr_cpu:.6f}%", f"{r.sys_cpu:.6f}%", str(r.ctx), str(r.majf), str(r.minf)]
        lines.append(";".join(f))
    return "\n".join(lines) + "\n"


def render(results: Sequence[JobResult], formats: Sequence[str],
           extra_lines: Sequence[str] = (), extra_json: dict[str, Any] | None = None) -> str:
    parts = []
    for fmt in formats:
        if fmt == "normal":
            parts.append(to_normal(results, extra_lines))
        elif fmt == "json":
            parts.append(json.dumps(to_json(results, extra_json), indent=2) + "\n")
        elif fmt == "terse":
            parts.append(to_terse(results))
        else:
            raise ValueError(f"unknown output format {fmt!r}")
    return "".join(parts)
