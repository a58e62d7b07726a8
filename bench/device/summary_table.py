"""A markdown table over result JSON files (gdskv-bench and ddbase), with the ratios that matter.

``python bench/device/summary_table.py OUT_DIR`` reads ``OUT_DIR/<place>/<geometry>*.json`` and
prints one row per job: write/read GB/s, gdskv against raw on the same backend, gdskv against HiCacheFile
and dd, verify outcome, O_DIRECT, compat mode, whether the page cache was dropped before reads.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from collections import defaultdict

HICACHE_SUFFIX = "-hicache"


def _rows(out_dir: str) -> list[dict]:
    rows = []
    for path in sorted(glob.glob(os.path.join(out_dir, "**", "*.json"), recursive=True)):
        rel = os.path.relpath(path, out_dir)
        parts = rel.split(os.sep)
        place = parts[0] if len(parts) > 1 else "-"
        geometry = os.path.splitext(parts[-1])[0]
        # device_results.sh writes HiCacheFile's jobs beside gdskv's, as <geometry>-hicache.json
        geometry = geometry.removesuffix(HICACHE_SUFFIX)
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if "gdskv_sweep" in doc:
            continue
        for job in doc.get("jobs", []):
            g = job.get("gdskv", {})
            if not g:
                continue
            engine = g.get("engine", "?")
            backend = g.get("backend") or "?"
            if engine == "dd":
                geometry_key = "dd"
            else:
                geometry_key = geometry
            inv = g.get("invalidate") or {}
            ver = g.get("verify") or {}
            rows.append({
                "place": place, "geometry": geometry_key, "job": job.get("jobname", "?"),
                "engine": engine, "backend": backend,
                "asked_backend": (job.get("job options") or {}).get("backend", ""),
                "write": job.get("write", {}).get("bw_bytes", 0) / 1e9,
                "read": job.get("read", {}).get("bw_bytes", 0) / 1e9,
                "error": job.get("error", 0), "failed": g.get("failed", ""),
                "verify": ("ok" if ver.get("ok") else "FAIL") if ver else "-",
                "o_direct": g.get("o_direct"), "compat": g.get("compat_mode", "n/a"),
                "gpu_direct": g.get("gpu_direct"),
                "dropped": ("ram" if inv.get("in_ram") else ("yes" if inv.get("done") else "no"))
                if inv else "-",
            })
    return rows


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def table(out_dir: str) -> str:
    rows = _rows(out_dir)
    by_key = defaultdict(dict)
    for r in rows:
        if r["engine"] in ("raw", "hicachefile", "dd"):
            k = (r["place"], r["engine"], r["asked_backend"] if r["engine"] == "raw" else "")
            if r["engine"] == "dd":
                by_key[(r["place"], "dd")][""] = r
            else:
                by_key[(r["place"], r["geometry"])][k[1:]] = r
    lines = ["| place | geometry | job | backend | write GB/s | read GB/s | w/raw | r/raw | "
             "w/hicache | r/hicache | w/dd | r/dd | verify | O_DIRECT | compat | cache dropped |",
             "|" + "---|" * 16]
    for r in rows:
        base = by_key.get((r["place"], r["geometry"]), {})
        raw = base.get(("raw", r["asked_backend"])) if r["engine"] == "gdskv" else None
        hc = base.get(("hicachefile", "")) if r["engine"] in ("gdskv", "raw") else None
        dd = by_key.get((r["place"], "dd"), {}).get("") if r["engine"] != "dd" else None
        if r["failed"]:
            lines.append(f"| {r['place']} | {r['geometry']} | {r['job']} | {r['asked_backend']} "
                         f"| FAILED: {r['failed'][:80]} |" + " |" * 11)
            continue
        lines.append(
            f"| {r['place']} | {r['geometry']} | {r['job']} | {r['backend']} "
            f"| {r['write']:.2f} | {r['read']:.2f} "
            f"| {_ratio(r['write'], raw['write']) if raw else '-'} "
            f"| {_ratio(r['read'], raw['read']) if raw else '-'} "
            f"| {_ratio(r['write'], hc['write']) if hc else '-'} "
            f"| {_ratio(r['read'], hc['read']) if hc else '-'} "
            f"| {_ratio(r['write'], dd['write']) if dd else '-'} "
            f"| {_ratio(r['read'], dd['read']) if dd else '-'} "
            f"| {r['verify']} | {r['o_direct']} | {r['compat']} | {r['dropped']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python bench/device/summary_table.py OUT_DIR", file=sys.stderr)
        return 2
    sys.stdout.write(table(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
