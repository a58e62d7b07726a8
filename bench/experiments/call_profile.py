"""Where one batch's time goes: per-call wall time of gdskv vs raw, and a cProfile of gdskv.

gdskv-bench gives throughput; this gives the reason behind a gdskv/raw ratio. It runs the
bench's own ``gdskv`` and ``raw`` engines (same pages, same backend, same directory) one call at a
time in this thread, prints the median call time of each, then cProfile's top functions for the
gdskv calls (wall time in this thread: waits on I/O futures and GPU syncs show up as such).

    python bench/experiments/call_profile.py --directory /dev/shm/x --bs 64M --size 1G \
        --backend kvikio [--phases | --timeline | --trace FILE] [--iodepth N] [--json FILE]

``--timeline`` answers "which steps are on a call's critical path": it stamps the time (from
the call's start, in the calling thread) when each of a few steps *ends* (TIMELINE: the read's
submit, the I/O's end, the verify + scatter queued, the stream synced, ...) and reports their
medians per call, the calling thread's CPU time per call, and the garbage collections that ran
during calls (how many, how long, and the p50/p99 of calls with and without one).

Results it produced (bench/RESULTS.md, "Where the time goes"), under bench/results/:
``h100-2026-11-22/call-profile/call_profile_shm.json`` (64 MiB calls, ``--phases``, the first
write call), ``h100-2026-11-22/batch128/call_profile_shm_256M.json`` (256 MiB calls) and
``h100-2026-11-23/call-overhead-4/timeline/`` (``--timeline`` at 1 and 8 pages per call).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from gdskv.config import TierConfig, parse_size

from gdskv.bench.cache import drop_page_cache
from gdskv.bench.engines import EngineSpec, make_engine
from gdskv.bench.presets import get_preset


# What ``--phases`` times (in the calling thread only): "module:Class.attr" or "module:func".
PHASES = ("gdskv.tier:Tier._pool_copier", "gdskv.tier:Tier._copier_for",
          "gdskv.pool:KVPool.check_token_slots",
          "gdskv.directory:PageDirectory.pin", "gdskv.directory:PageDirectory.unpin",
          "gdskv.directory:PageDirectory.reserve", "gdskv.directory:PageDirectory.commit",
          "gdskv.store:SlabStore.extents", "gdskv.kernels:gather_pages",
          "gdskv.kernels:scatter_pages", "gdskv.checksum:GpuPageChecksummer.compute",
          "gdskv.checksum:PageChecksummer.compute",
          "gdskv.spill_call:SpillCall._finish_write", "gdskv.restore_call:RestoreCall._finish_read",
          "gdskv.data_call:CallContext.verify_sums", "gdskv.journal:Journal.append", "os:fdatasync",
          "concurrent.futures:Future.result", "gdskv.backends.kvikio:KvikioBackend._submit",
          "gdskv.backends.posix:PosixBackend._submit", "gdskv.tier:Tier._run",
          "gdskv.data_call:CallContext.take_part", "gdskv.spill_call:copies_done", "gdskv.restore_call:copies_done",
          "gdskv.staging:StagingParts._ready", "gdskv.tier:Tier._engine_event",
          "gdskv.restore_call:RestoreCall.run", "gdskv.spill_call:SpillCall.run",
          "gdskv.copiers:PoolCopier.prepare", "gdskv.copiers:PoolCopier.__call__",
          "gdskv.directory:PageDirectory.algorithms",
          "gdskv.staging:StagingParts.give_back", "gdskv.kernels:page_checksums",
          "gdskv.stats:TierStats.add", "gdskv.gpu_verdicts:GpuVerdicts.__init__",
          "gdskv.gpu_verdicts:GpuVerdicts.scatter", "gdskv.gpu_verdicts:GpuVerdicts.read_back",
          "gdskv.restore_call:RestoreCall._settle", "gdskv.restore_call:RestoreCall._gpu_verdicts",
          "gdskv.kernels:page_partial_sums", "gdskv.kernels:scatter_pages_verified",
          "gdskv.spill_call:SpillCall._gpu_spill", "gdskv.gpu_spill:GpuSpill.__init__",
          "gdskv.gpu_spill:GpuSpill.gather", "gdskv.gpu_spill:GpuSpill.sums",
          "gdskv.launch_graphs:LaunchGraphs.run", "gdskv.slot_trailer:write_into",
          "gdskv.spill_call:SpillCall._trailers", "gdskv.metrics:TierMetrics.call")


# What ``--timeline`` stamps (when each returns, calling thread only), per op.
TIMELINE = ("gdskv.tier:Tier._check_open", "gdskv.tier:Tier._refuse_byte_pages",
            "gdskv.tier:Tier._copier_for", "gdskv.admission:AdmissionFilter.admit",
            "gdskv.call_gate:CallGate.enter_shared", "gdskv.streams:OnStream.__enter__",
            "gdskv.staging:StagingParts.try_take", "gdskv.store:SlabStore.extents",
            "gdskv.copiers:PoolCopier.chunk_slots", "gdskv.launch_graphs:LaunchGraphs.run",
            "torch.cuda.graphs:CUDAGraph.replay", "gdskv.spill_call:SpillCall._gpu_spill",
            "gdskv.restore_call:RestoreCall._gpu_verdicts", "gdskv.spill_call:SpillCall._trailers",
            "gdskv.tier:Tier._engine_event", "gdskv.directory:PageDirectory.pin",
            "gdskv.directory:PageDirectory.reserve",
            "gdskv.gpu_spill:GpuSpill.gather", "gdskv.gpu_spill:GpuSpill.sums",
            "gdskv.slot_trailer:write_into", "gdskv.spill_call:copies_done", "gdskv.restore_call:copies_done",
            "gdskv.backends.kvikio:KvikioBackend._submit",
            "gdskv.backends.posix:PosixBackend._submit",
            "gdskv.copiers:PoolCopier.prepare", "gdskv.backends.kvikio:KvikioBackend._wait",
            "gdskv.gpu_verdicts:GpuVerdicts.scatter", "gdskv.store:SlabStore.sync",
            "gdskv.persistence:PersistentDirectory.journal_commits", "gdskv.spill_call:SpillCall._finish_write",
            "gdskv.restore_call:RestoreCall._settle", "gdskv.directory:PageDirectory.unpin",
            "gdskv.stats:TierStats.add", "gdskv.restore_call:RestoreCall.run", "gdskv.spill_call:SpillCall.run",
            "gdskv.tier:Tier._run", "gdskv.streams:CallStream.enter",
            "gdskv.streams:CallStream.leave", "gdskv.backends.base:WaitingFuture.result",
            "gdskv.data_call:CallContext.failed_positions", "gdskv.restore_call:RestoreCall._unpin",
            "gdskv.metrics:TierMetrics.call", "gdskv.call_gate:CallGate.leave_shared",
            "gdskv.tier:Tier._call_stream", "gdskv.staging:StagingParts.give_back")


class _Timeline:
    """Per-call stamps (s since the call's start) of when TIMELINE's steps returned, plus the
    calling thread's CPU time per call and the garbage collections that ran meanwhile."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self._now: dict | None = None
        self._t0 = 0.0
        self._gc_t0 = 0.0

    def begin(self) -> None:
        self._now = {}
        self._gcs: list = []
        self._cpu0 = time.thread_time()
        self._t0 = time.perf_counter()

    def end(self) -> None:
        now, self._now = self._now, None
        self.calls.append({"steps": now, "wall": time.perf_counter() - self._t0,
                           "cpu": time.thread_time() - self._cpu0, "gc": self._gcs})

    def stamp(self, name: str) -> None:
        now = self._now
        if now is None:
            return
        t = time.perf_counter() - self._t0
        k, key = 1, name
        while key in now:  # a step a call runs more than once: name#2, name#3, ...
            k += 1
            key = f"{name}#{k}"
        now[key] = t

    def on_gc(self, phase: str, info: dict) -> None:
        if self._now is None:
            return
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self._gcs.append((info["generation"], time.perf_counter() - self._gc_t0))

    def summary(self) -> dict:
        if not self.calls:
            return {}
        steps: dict[str, list[float]] = {}
        for c in self.calls:
            for k, v in c["steps"].items():
                steps.setdefault(k, []).append(v)
        walls = [c["wall"] for c in self.calls]
        with_gc = [c["wall"] for c in self.calls if c["gc"]]
        without = [c["wall"] for c in self.calls if not c["gc"]]
        gcs = [g for c in self.calls for g in c["gc"]]

        def pct(xs, q):
            return round(1e3 * sorted(xs)[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None
        return {
            "calls": len(walls), "wall_ms_p50": pct(walls, 0.5), "wall_ms_p99": pct(walls, 0.99),
            "cpu_ms_median": round(1e3 * statistics.median(c["cpu"] for c in self.calls), 3),
            "steps_end_ms_median": {k: round(1e3 * statistics.median(v), 3) for k, v in
                                    sorted(steps.items(), key=lambda kv: statistics.median(kv[1]))},
            "steps_calls_seen": {k: len(v) for k, v in steps.items()},
            "gc": {"collections": len(gcs),
                   "by_generation": {g: sum(1 for x, _ in gcs if x == g) for g in (0, 1, 2)},
                   "ms_max": round(1e3 * max((t for _, t in gcs), default=0.0), 3),
                   "calls_with_gc": len(with_gc),
                   "p50_ms_with_gc": pct(with_gc, 0.5), "p50_ms_without_gc": pct(without, 0.5),
                   "p99_ms_without_gc": pct(without, 0.99)},
            "slowest_calls": [{"wall_ms": round(1e3 * c["wall"], 3), "gc": c["gc"],
                               "steps_end_ms": {k: round(1e3 * v, 3)
                                                for k, v in c["steps"].items()}}
                              for c in sorted(self.calls, key=lambda c: -c["wall"])[:3]]}


def _wrap_each(specs, wrap) -> list:
    """Replace each "module:Class.attr" / "module:func" of ``specs`` with ``wrap(spec, fn)``;
    returns what to restore. A name the code under test does not have (an older commit) is
    skipped."""
    import importlib

    undo = []
    for spec in specs:
        mod_name, attr = spec.split(":")
        *path, name = attr.split(".")
        try:
            owner = importlib.import_module(mod_name)
            for part in path:
                owner = getattr(owner, part)
            fn = getattr(owner, name)
        except (AttributeError, ImportError):
            continue
        setattr(owner, name, wrap(spec, fn))
        undo.append((owner, name, fn))
    return undo


def _install_timeline(timeline: _Timeline) -> list:
    """Wrap each of TIMELINE to stamp its return on ``timeline``; returns what to restore."""
    def wrap(spec: str, fn):
        label = spec.split(":")[1].split(".")[-1]

        def stamped(*a, **kw):
            try:
                return fn(*a, **kw)
            finally:
                timeline.stamp(label)
        return stamped

    return _wrap_each(TIMELINE, wrap)


def _install_phase_timers(totals: dict, threads: tuple[str, ...]) -> list:
    """Wrap each of PHASES with a wall-clock accumulator (summed over the calling threads);
    returns what to restore."""
    lock = threading.Lock()

    def wrap(spec: str, fn):
        def timed(*a, **kw):
            if not threading.current_thread().name.startswith(threads):
                return fn(*a, **kw)  # not a calling thread (backend threads, the waiter)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                with lock:
                    n, t = totals.get(spec, (0, 0.0))
                    totals[spec] = (n + 1, t + time.perf_counter() - t0)
        return timed

    return _wrap_each(PHASES, wrap)


@contextlib.contextmanager
def _trace(path: str | None):
    """A torch.profiler trace (CPU ops and all CUDA activity, other libraries' copies too)."""
    if not path:
        yield
        return
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield
    prof.export_chrome_trace(path)


def _calls(engine, op: str, batches: int, ppb: int, profile: cProfile.Profile | None,
           iodepth: int = 1, first_call_hook=None, timeline: _Timeline | None = None
           ) -> tuple[list[float], float]:
    """Per-call wall times, and the wall time of all calls (``iodepth`` threads at once)."""
    def one(b: int) -> float:
        if b == 1 and first_call_hook is not None:  # (exact at iodepth 1)
            first_call_hook()
        pages = list(range(b * ppb, (b + 1) * ppb))
        args = engine.call_args(op, 0, pages)  # untimed, as in gdskv-bench
        if timeline is not None:
            timeline.begin()
        t0 = time.perf_counter()
        n = engine.run(op, args)
        if timeline is not None:
            timeline.end()
        if n != ppb:
            raise RuntimeError(f"{engine.name} {op}: {n} of {ppb} pages")
        return time.perf_counter() - t0

    start = time.perf_counter()
    if profile is not None:
        profile.enable()
    try:
        if iodepth == 1:
            times = [one(b) for b in range(batches)]
        else:
            with ThreadPoolExecutor(iodepth, thread_name_prefix="profile-") as pool:
                times = list(pool.map(one, range(batches)))
    finally:
        if profile is not None:
            profile.disable()
    return times, time.perf_counter() - start


def run(args) -> dict:
    if args.plain_verify:
        from gdskv.restore_call import RestoreCall
        # Any signature: the patch must outlive changes to the method's arguments.
        RestoreCall._gpu_verdicts = lambda self, *args, **kwargs: None
    preset = get_preset(args.model)
    layout = preset.layout(args.page_tokens)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ppb = max(1, parse_size(args.bs) // layout.page_bytes)
    batches = max(1, parse_size(args.size) // (ppb * layout.page_bytes))
    out: dict = {"iodepth": args.iodepth, "model": args.model, "page_tokens": args.page_tokens, "pages_per_call": ppb,
                 "call_bytes": ppb * layout.page_bytes, "calls": batches, "engines": {}}
    profiles = {}
    phase_totals: dict = {}
    if args.timeline and args.iodepth != 1:
        raise SystemExit("--timeline times one call at a time: use --iodepth 1")
    for kind in ("raw", "gdskv"):
        with tempfile.TemporaryDirectory(dir=args.directory) as d:
            config = TierConfig.from_env(directories=(d,), backend=args.backend,
                                         capacity=2 * batches * ppb * layout.slot_bytes)
            spec = EngineSpec(name="profile", layout=layout, config=config, device=device,
                              threads=1, pages=batches * ppb, seed=1, randomize=False,
                              verify=False, batch_pages=ppb)
            engine = make_engine(kind, spec)
            engine.open()
            try:
                timelines = {op: _Timeline() for op in ("write", "read")} \
                    if args.timeline else {"write": None, "read": None}
                prof = cProfile.Profile() \
                    if kind == "gdskv" and not (args.phases or args.timeline) else None
                if args.timeline:
                    undo_tl = _install_timeline(timelines["write"])
                    gc.callbacks.append(timelines["write"].on_gc)
                undo = _install_phase_timers(
                    phase_totals, ("MainThread",) if args.iodepth == 1 else ("profile-",)) if kind == "gdskv" and args.phases \
                    else []
                try:
                    first: dict = {}
                    w, w_all = _calls(engine, "write", batches, ppb,
                                      prof if args.profile_op in ("both", "write") else None,
                                      args.iodepth, lambda: first.update(phase_totals),
                                      timelines["write"])
                    after_writes = dict(phase_totals)
                    if args.timeline:  # the same stamps, now onto the read timeline
                        gc.callbacks.remove(timelines["write"].on_gc)
                        for owner, name, fn in undo_tl:
                            setattr(owner, name, fn)
                        undo_tl = _install_timeline(timelines["read"])
                        gc.callbacks.append(timelines["read"].on_gc)
                    drop_page_cache(engine.files())
                    trace = _trace(args.trace and f"{args.trace}.{kind}.json")
                    with trace:
                        r, r_all = _calls(engine, "read", batches, ppb,
                                          prof if args.profile_op in ("both", "read") else None,
                                          args.iodepth, timeline=timelines["read"])
                finally:
                    for owner, name, fn in undo:
                        setattr(owner, name, fn)
                    if args.timeline:
                        for owner, name, fn in undo_tl:
                            setattr(owner, name, fn)
                        if timelines["read"].on_gc in gc.callbacks:
                            gc.callbacks.remove(timelines["read"].on_gc)
                if prof is not None:
                    profiles[kind] = prof
            finally:
                engine.close()
        out["engines"][kind] = {
            "write_ms_median": 1e3 * statistics.median(w), "read_ms_median": 1e3 * statistics.median(r),
            "write_ms": [round(1e3 * x, 3) for x in w], "read_ms": [round(1e3 * x, 3) for x in r],
            "write_gbps": batches * out["call_bytes"] / w_all / 1e9,
            "read_gbps": batches * out["call_bytes"] / r_all / 1e9}
        if args.timeline:
            out["engines"][kind]["timeline"] = {op: t.summary() for op, t in timelines.items()}
    if phase_totals and first:
        out["gdskv_first_write_phases_ms"] = {
            k: round(1e3 * t, 3) for k, (n, t) in
            sorted(first.items(), key=lambda kv: -kv[1][1])}
    if phase_totals:
        out["gdskv_phases_ms_per_call"] = {
            k: round(1e3 * t / (2 * batches), 3) for k, (n, t) in
            sorted(phase_totals.items(), key=lambda kv: -kv[1][1])}
        # the same, per read call and per write call
        for op, totals in (("write", after_writes), ("read", {
                k: (n - after_writes.get(k, (0, 0.0))[0], t - after_writes.get(k, (0, 0.0))[1])
                for k, (n, t) in phase_totals.items()})):
            out[f"gdskv_{op}_phases_ms_per_call"] = {
                k: round(1e3 * t / batches, 3) for k, (n, t) in
                sorted(totals.items(), key=lambda kv: -kv[1][1]) if n}
    for kind, prof in profiles.items():
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
        out[f"{kind}_profile_tottime"] = s.getvalue()
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--directory", default=tempfile.gettempdir())
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--page-tokens", type=int, default=16)
    p.add_argument("--bs", default="64M")
    p.add_argument("--size", default="1G")
    p.add_argument("--backend", default="auto")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--iodepth", type=int, default=1, help="calls in flight (threads)")
    p.add_argument("--profile-op", choices=("both", "read", "write"), default="both",
                   help="which calls cProfile covers")
    p.add_argument("--trace", help="write torch.profiler traces of the read phase to "
                   "TRACE.raw.json and TRACE.gdskv.json")
    p.add_argument("--switch-interval", type=float,
                   help="sys.setswitchinterval (s): how long a thread may hold the GIL")
    p.add_argument("--phases", action="store_true",
                   help="time the tier's steps (per call, this thread) instead of cProfile")
    p.add_argument("--timeline", action="store_true",
                   help="stamp when each step of a call ends (critical path), the calling "
                        "thread's CPU time and garbage collections per call (raw and gdskv)")
    p.add_argument("--plain-verify", action="store_true",
                   help="verify restores the plain way (checksums read back per chunk, compared "
                        "on the host) instead of on the GPU: the A/B for gdskv.gpu_verdicts")
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args(argv)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    res = run(args)
    for kind, e in res["engines"].items():
        print(f"{kind:6s} write {e['write_ms_median']:7.2f} ms/call {e['write_gbps']:6.2f} GB/s   "
              f"read {e['read_ms_median']:7.2f} ms/call {e['read_gbps']:6.2f} GB/s")
        print(f"       write ms: {e['write_ms'][:6]} ... max {max(e['write_ms'])}\n"
              f"       read ms:  {e['read_ms'][:6]} ... max {max(e['read_ms'])}")
    for k, ms in res.get("gdskv_first_write_phases_ms", {}).items():
        print(f"  first write call: {ms:8.3f} ms  {k}")
    for op in ("read", "write"):
        for k, ms in res.get(f"gdskv_{op}_phases_ms_per_call", {}).items():
            print(f"  {op:5s} {ms:8.3f} ms/call  {k}")
    for kind, e in res["engines"].items():
        for op, t in e.get("timeline", {}).items():
            if not t:
                continue
            print(f"{kind} {op}: p50 {t['wall_ms_p50']} ms, p99 {t['wall_ms_p99']} ms, "
                  f"calling thread's CPU {t['cpu_ms_median']} ms/call; gc {t['gc']}")
            for k, ms in t["steps_end_ms_median"].items():
                print(f"    {ms:8.3f} ms  {k} ends")
    print(res.get("gdskv_profile_tottime", ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
