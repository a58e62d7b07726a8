"""``gdskv-bench``: the command line. Parses, runs the jobs, prints fio-shaped reports.

Exit status: 0 when every job ran clean, 1 when a job had failed I/Os or a verify failure,
2 for bad options (argparse's convention), with one ``gdskv-bench: error: ...`` line.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence

from .options import Invocation, JobOptions, OptionError, build_parser, parse_args
from .report import render, to_json
from .measurements import DirStats, JobResult, fmt_bw, lat_stats
from .placement import SetupError
from .runner import Progress, resolve, run_job
from .sweep import plot, series, write_point

PROGRESS_AFTER_S = 2.0


class _Bar:
    """A rich progress bar on stderr, shown only once a phase has run for 2 s."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.started = time.monotonic()
        self.bar = None
        self.task = None
        self.label = None

    def tick(self) -> None:
        p = self.progress
        if self.label != p.label:
            self.label, self.started = p.label, time.monotonic()
            if self.bar is not None:
                self.bar.update(self.task, description=p.label, total=p.total or None,
                                completed=0)
        if self.bar is None:
            if time.monotonic() - self.started < PROGRESS_AFTER_S:
                return
            from rich.console import Console
            from rich.progress import (BarColumn, DownloadColumn, Progress as RichProgress,
                                       TextColumn, TimeElapsedColumn, TransferSpeedColumn)
            self.bar = RichProgress(TextColumn("{task.description}"), BarColumn(),
                                    DownloadColumn(binary_units=True), TransferSpeedColumn(),
                                    TimeElapsedColumn(), console=Console(file=sys.stderr),
                                    transient=True)
            self.bar.start()
            self.task = self.bar.add_task(p.label, total=p.total or None)
        self.bar.update(self.task, completed=p.done, total=p.total or None)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _make_progress(inv: Invocation) -> tuple[Progress | None, _Bar | None]:
    if inv.output_format != ("normal",) or not sys.stderr.isatty():
        return None, None
    p = Progress()
    bar = _Bar(p)
    p.tick = bar.tick  # type: ignore[attr-defined]
    return p, bar


def _engines_for(job: JobOptions, compare: bool) -> tuple[list[str], list[str]]:
    if not compare:
        return [job.ioengine], []
    from .engines import EngineUnavailable, sglang_hicache
    try:
        sglang_hicache()
        return ["gdskv", "raw", "hicachefile"], []
    except EngineUnavailable as exc:
        return ["gdskv", "raw"], [f"compare: hicachefile skipped: {exc}"]


def run_invocation(inv: Invocation, jobs: Sequence[JobOptions], progress=None
                   ) -> tuple[list[JobResult], list[str], list[dict]]:
    """Run jobs (each engine of each job in compare mode, ``compare_rounds`` times); results,
    note lines, ratios."""
    rounds = inv.compare_rounds if inv.compare else 1
    plans = []
    notes: list[str] = []
    for job in jobs:
        engines, why = _engines_for(job, inv.compare)
        notes += why
        group = []
        for r in range(rounds):
            # every other round in reverse (ABBA): drift of the machine during the run then
            # weighs on each engine alike
            for e in engines if r % 2 == 0 else engines[::-1]:
                j = job
                if inv.compare:  # distinct job names per engine (and round) for JSON consumers
                    j = job.copy()
                    j.values["name"] = f"{job.name}.{e}" + (f".r{r + 1}" if rounds > 1 else "")
                group.append((e, r, resolve(j, e)))  # check every job before running any
        plans.append((job.name, group))
    results: list[JobResult] = []
    ratios: list[dict] = []
    gid = 0
    for name, group in plans:
        per_round: list[dict[str, list[JobResult]]] = [{} for _ in range(rounds)]
        for engine, r, plan in group:
            try:
                rs = run_job(plan, gid, progress)
            except OptionError:
                raise
            except Exception as exc:  # noqa: BLE001 - as fio: report the job failed, go on
                print(f"gdskv-bench: job {plan.opts.name!r} (ioengine={plan.engine}, "
                      f"backend={plan.opts.backend}) failed: {type(exc).__name__}: {exc}",
                      file=sys.stderr)
                rs = [failed_result(plan, gid, exc)]
            gid += 1
            per_round[r][engine] = rs
            results += rs
        if inv.compare:
            ratios.append(_ratios(name, per_round))
    return results, notes, ratios


def failed_result(plan, gid: int, exc: BaseException) -> JobResult:
    """A job that could not run (backend unavailable, store error...): fio's err= plus why."""
    import errno
    code = exc.errno if isinstance(getattr(exc, "errno", None), int) else errno.EINVAL
    lay = plan.layout
    return JobResult(name=plan.opts.name, groupid=gid, jobs=plan.opts.numjobs, read=DirStats(),
                     write=DirStats(), options=dict(plan.opts.given),
                     gdskv={"engine": plan.engine, "backend": plan.opts.backend,
                            "mem": plan.mem, "layout": lay.to_dict(),
                            "page_bytes": lay.page_bytes, "slot_bytes": lay.slot_bytes,
                            "failed": f"{type(exc).__name__}: {exc}"},
                     error=code or errno.EINVAL, start_time=time.time())


def _bw(rs: list[JobResult], direction: str) -> int:
    return sum(getattr(r, direction).bw_bytes for r in rs)


#: completion-latency percentiles the compare summary sets side by side (fio's names)
COMPARE_PERCENTILES = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("p99.9", 99.9))


def _clat_percentiles(rs: list[JobResult], direction: str) -> dict[str, int]:
    samples = [c for r in rs for c in getattr(r, direction).clat_ns]
    if not samples:
        return {}
    pct = lat_stats(samples)["percentile"]
    return {name: pct[f"{p:.6f}"] for name, p in COMPARE_PERCENTILES}


def _ratios(name: str, per_round: list[dict[str, list[JobResult]]]) -> dict:
    """One job's comparison: each engine's bandwidth (the mean of its rounds') and its clat
    percentiles over every round's calls pooled, the gdskv/raw (and gdskv/hicachefile)
    ratios of these, and with several rounds, each round's ratios on its own."""
    engines = list(per_round[0])
    out: dict = {"job": name, "rounds": len(per_round), "bw_bytes": {}, "clat_ns": {},
                 "ratios": {}}
    by_round: list[dict] = [{} for _ in per_round]
    for direction in ("write", "read"):
        round_bws = [{e: _bw(rnd[e], direction) for e in engines} for rnd in per_round]
        bws = {e: sum(b[e] for b in round_bws) // len(per_round) for e in engines}
        out["bw_bytes"][direction] = bws
        # Per call completion latency, as fio reports it: a small restore's time to first
        # token waits on its p50/p99, which throughput alone hides.
        clat = {e: _clat_percentiles([x for rnd in per_round for x in rnd[e]], direction)
                for e in engines}
        out["clat_ns"][direction] = {e: c for e, c in clat.items() if c}
        out["ratios"].update(_ratio_cells(direction, bws, clat))
        if len(per_round) > 1:
            for cells, rnd, b in zip(by_round, per_round, round_bws):
                cells.update(_ratio_cells(direction, b, {
                    e: _clat_percentiles(rnd[e], direction) for e in engines}))
    if len(per_round) > 1:
        out["ratios_by_round"] = by_round
    return out


def _ratio_cells(direction: str, bws: dict[str, int], clat: dict[str, dict]) -> dict:
    """gdskv's bandwidth over raw's and hicachefile's, and its clat percentiles over raw's."""
    out = {}
    g = bws.get("gdskv", 0)
    if g and bws.get("raw"):
        out[f"{direction}: gdskv/raw"] = g / bws["raw"]
    if g and bws.get("hicachefile"):
        out[f"{direction}: gdskv/hicachefile"] = g / bws["hicachefile"]
    mine, raw = clat.get("gdskv"), clat.get("raw")
    if mine and raw:
        for pname, _ in COMPARE_PERCENTILES:
            if raw[pname]:
                out[f"{direction}: clat {pname} gdskv/raw"] = mine[pname] / raw[pname]
    return out


def _ratio_lines(ratios: list[dict]) -> list[str]:
    lines = []
    for r in ratios:
        lines.append("")
        rounds = r.get("rounds", 1)
        lines.append(f"Compare {r['job']}:" if rounds == 1 else
                     f"Compare {r['job']} ({rounds} rounds, ABBA; bandwidth: the rounds' mean,"
                     " clat: their calls pooled):")
        for direction, bws in r["bw_bytes"].items():
            if not any(bws.values()):
                continue
            cells = ", ".join(f"{e}={fmt_bw(bw)}" for e, bw in bws.items())
            rat = ", ".join(f"{k.split(': ')[1]}={v:.2f}x" for k, v in r["ratios"].items()
                            if k.startswith(direction) and ": clat " not in k)
            lines.append(f"  {direction:>5}: {cells}" + (f"  ({rat})" if rat else ""))
            clat = r.get("clat_ns", {}).get(direction, {})
            for pname, _ in COMPARE_PERCENTILES if clat else ():
                cells = ", ".join(f"{e}={c[pname] / 1e3:.0f}us" for e, c in clat.items())
                ratio = r["ratios"].get(f"{direction}: clat {pname} gdskv/raw")
                lines.append(f"         clat {pname:>5}: {cells}"
                             + (f"  (gdskv/raw={ratio:.2f}x)" if ratio else ""))
            by_round = r.get("ratios_by_round", [])
            for label, key in (("bw", "gdskv/raw"), ("clat p50", "clat p50 gdskv/raw"),
                               ("clat p99", "clat p99 gdskv/raw")):
                key = f"{direction}: {key}"
                if by_round and all(key in rr for rr in by_round):
                    lines.append(f"  by round, {label} gdskv/raw: "
                                 + " ".join(f"{rr[key]:.2f}x" for rr in by_round))
    return lines


def _emit(text: str, inv: Invocation) -> None:
    if inv.output:
        with open(inv.output, "a", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
        sys.stdout.flush()


def _status(results: list[JobResult]) -> int:
    return 1 if any(r.error for r in results) else 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        inv = parse_args(argv)
        if inv.output:
            open(inv.output, "w").close()  # fio truncates --output
        if inv.metrics_port is not None:
            _serve_metrics(inv.metrics_port)
        progress, bar = _make_progress(inv)
        try:
            if inv.sweep:
                return _sweep(inv, progress)
            results, notes, ratios = run_invocation(inv, inv.jobs, progress)
        finally:
            if bar is not None:
                bar.stop()
    except OptionError as exc:
        if not isinstance(exc, SetupError):  # a setup problem is not a usage problem
            build_parser().print_usage(sys.stderr)
        print(f"gdskv-bench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gdskv-bench: interrupted", file=sys.stderr)
        return 130
    extra = ([""] + notes if notes else []) + _ratio_lines(ratios)
    _emit(render(results, inv.output_format, extra,
                 {"gdskv_compare": ratios} if ratios else None), inv)
    return _status(results)


def _serve_metrics(port: int) -> None:
    """Serve the default registry (every tier's gdskv_* series) for the run's length."""
    from prometheus_client import start_http_server
    try:
        start_http_server(port)
    except OSError as exc:
        raise OptionError(f"--metrics-port {port}: cannot listen there ({exc.strerror}); "
                          "pick a free port") from None


def _sweep(inv: Invocation, progress) -> int:
    key, values = inv.sweep
    sweep_dir = inv.sweep_dir or os.path.join(os.getcwd(), "gdskv-sweep")
    points = []
    all_results: list[JobResult] = []
    table = ["", f"Sweep over {key} (bandwidth of KV payload; JSON and PNG in {sweep_dir}):"]
    for text, value in values:
        jobs = [j.replace(**{key: value}) for j in inv.jobs]
        for j in jobs:
            j.given[key] = text
            j.apply_kb_base()  # a swept size reads in the job's kb_base, as the job's own do
        results, notes, ratios = run_invocation(inv, jobs, progress)
        doc = to_json(results, {"gdskv_sweep": {"key": key, "value": text},
                                **({"gdskv_compare": ratios} if ratios else {})})
        write_point(sweep_dir, key, text, doc)
        points.append((float(value), doc))
        all_results += results
        _emit(render(results, inv.output_format,
                     ([""] + notes if notes else []) + _ratio_lines(ratios)), inv)
    lines = series(points)
    png = plot(lines, key, os.path.join(sweep_dir, f"sweep-{key}.png"))
    names = {float(v): t for t, v in values}
    for label, pts in lines.items():
        table.append(f"  {label:28s} " + "  ".join(f"{names.get(x, x)}={fmt_bw(y * 1e9)}"
                                                   for x, y in pts))
    table.append(f"  plot: {png}")
    if "normal" in inv.output_format:
        _emit("\n".join(table) + "\n", inv)
    return _status(all_results)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
