"""Where each call of a gdskv-bench job spends its time, and how much I/O is in flight (issue 14).

Runs ``gdskv-bench`` itself (same job files, same options) with stamps on the kvikio backend's
submit and wait, the tier's directory reservation, staging-part take, trailer encoding, gather
launch, GPU sync and chunk commit, taken only inside the engines' timed calls. Then, for each
run of an engine (a round of ``--compare-rounds`` is one run), it prints:

- the run's span, the bytes its writes moved over it, and the median call;
- ``inflight``: the bytes whose write was submitted and not yet waited for, averaged over the
  span, and ``idle``: the time with none in flight (what a call's host work costs the device
  when only its own I/O could have run);
- the median time from a call's start to the first time it reached each stamp, in µs
  (``submit``: its first write was handed to kvikio; ``waited``: its first write's wait ended).

    python bench/experiments/job_phases.py --events /tmp/ev.json -- \\
        --compare --compare-rounds=2 --output=/tmp/out.txt my-job.ini

Everything after ``--`` goes to gdskv-bench. kvikio backend, write jobs (``rw=write``).

Results it produced: ``h200-2026-11-26/call-overhead-10/call7/`` (64 MiB and 256 MiB spills,
one and four calls in flight; see that folder's README).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

#: the stamps a call's first arrival at is reported for, in the order a spill reaches them
STAMPS = ("reserved", "taken", "trailed", "gathered", "synced", "submit", "submitted", "wait",
          "waited", "committed")


class Recorder:
    """Stamps ``(engine, what, time, detail, thread)`` taken inside an engine's timed call."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self._call = threading.local()

    def stamp(self, what: str, detail=None) -> None:
        engine = getattr(self._call, "engine", None)
        if engine is not None:  # list.append is atomic under the GIL
            self.events.append((engine, what, time.perf_counter(), detail,
                                threading.get_ident()))

    def around(self, cls, name: str, before: str | None, after: str) -> None:
        """Stamp ``before`` and ``after`` around every call of ``cls.name``."""
        inner = getattr(cls, name)

        def stamped(*args, **kwargs):
            if before:
                self.stamp(before)
            try:
                return inner(*args, **kwargs)
            finally:
                self.stamp(after)
        setattr(cls, name, stamped)

    def engine_calls(self, cls) -> None:
        """Mark ``cls.run`` (an engine's timed call) so stamps inside it are kept."""
        inner, name = cls.run, cls.name

        def run(engine_self, op, args):
            self._call.engine = name
            self.stamp("call", op)
            try:
                return inner(engine_self, op, args)
            finally:
                self.stamp("end")
                self._call.engine = None
        cls.run = run


def install(rec: Recorder) -> None:
    from gdskv import directory, gpu_spill, tier
    from gdskv.backends import kvikio
    from gdskv.bench import engines

    submit = kvikio.KvikioBackend._submit

    def stamped_submit(backend, op, buffer, extents):
        rec.stamp("submit", sum(e.length for e in extents))
        fut = submit(backend, op, buffer, extents)
        rec.stamp("submitted")
        return fut
    kvikio.KvikioBackend._submit = stamped_submit
    rec.around(kvikio.KvikioBackend, "_wait", "wait", "waited")
    rec.around(directory.PageDirectory, "reserve", None, "reserved")
    rec.around(tier.Tier, "_take_write_part", None, "taken")
    rec.around(tier.Tier, "_trailers", None, "trailed")
    rec.around(gpu_spill.GpuSpill, "gather", None, "gathered")
    rec.around(tier.Tier, "_copies_done", None, "synced")
    rec.around(tier.Tier, "_finish_write", None, "committed")
    for cls in (engines.GdskvEngine, engines.RawEngine):
        rec.engine_calls(cls)


def calls_of(events: list) -> list[dict]:
    """The write calls: their engine, start, end, first arrival at each stamp, and their I/Os
    as ``[submit time, bytes, time its wait ended]``."""
    calls, open_calls = [], {}
    for engine, what, t, detail, thread in sorted(events, key=lambda e: e[2]):
        if what == "call":
            open_calls[thread] = {"engine": engine, "op": detail, "t0": t, "first": {}, "io": []}
            continue
        call = open_calls.get(thread)
        if call is None:
            continue
        call["first"].setdefault(what, t)
        if what == "submit":
            call["io"].append([t, detail, None])
        elif what == "waited":
            for io in call["io"]:
                if io[2] is None:
                    io[2] = t
        elif what == "end":
            call["t1"] = t
            calls.append(open_calls.pop(thread))
    return [c for c in calls if c["op"] == "write"]


def runs_of(calls: list[dict], gap_s: float = 0.1) -> list[list[dict]]:
    """Calls grouped into runs: one engine's calls with no gap longer than ``gap_s``."""
    runs: list[list[dict]] = []
    for call in sorted(calls, key=lambda c: c["t0"]):
        if not runs or runs[-1][-1]["engine"] != call["engine"] or \
                call["t0"] - max(c["t1"] for c in runs[-1]) > gap_s:
            runs.append([])
        runs[-1].append(call)
    return runs


def summary(run: list[dict]) -> str:
    t0, t1 = min(c["t0"] for c in run), max(c["t1"] for c in run)
    edges = sorted(edge for c in run for start, nbytes, end in c["io"] if end is not None
                   for edge in ((start, nbytes), (end, -nbytes)))
    in_flight, last, area, idle = 0, t0, 0.0, 0.0
    for t, change in edges:
        area += in_flight * (t - last)
        idle += (t - last) if in_flight == 0 else 0.0
        in_flight += change
        last = t
    idle += t1 - last
    moved = sum(nbytes for c in run for _, nbytes, _ in c["io"])
    firsts = " ".join(
        f"{k}={1e6 * statistics.median(c['first'][k] - c['t0'] for c in run if k in c['first']):.0f}"
        for k in STAMPS if any(k in c["first"] for c in run))
    return (f"{run[0]['engine']:5s} calls={len(run):3d} span={1e3 * (t1 - t0):6.1f}ms "
            f"{moved / (t1 - t0) / 2**30:5.1f}GiB/s "
            f"call={1e3 * statistics.median(c['t1'] - c['t0'] for c in run):6.2f}ms "
            f"inflight={area / (t1 - t0) / 2**20:5.0f}MiB idle={1e3 * idle:5.1f}ms | "
            f"first (us): {firsts}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", required=True, help="write every stamp here (JSON)")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER,
                    help="-- then gdskv-bench's arguments")
    args = ap.parse_args()
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    rec = Recorder()
    install(rec)
    from gdskv.bench.cli import main as bench_main
    rc = bench_main(bench_args)
    with open(args.events, "w") as f:
        json.dump(rec.events, f)
    for run in runs_of(calls_of(rec.events)):
        if len(run) >= 4:
            print(summary(run))
    return rc


if __name__ == "__main__":
    sys.exit(main())
