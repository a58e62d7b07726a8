"""Where one batch's time goes: per-call wall time of gdskv vs raw, and a cProfile of gdskv.

gdskv-bench gives throughput; this gives the reason behind a gdskv/raw ratio. It runs the
bench's own ``gdskv`` and ``raw`` engines (same pages, same backend, same directory) one call at a
time in this thread, prints the median call time of each, then cProfile's top functions for the
gdskv calls (wall time in this thread: waits on I/O futures and GPU syncs show up as such).

    python bench/experiments/call_profile.py --directory /dev/shm/x --bs 64M --size 1G \
        --backend kvikio [--phases | --trace FILE] [--iodepth N] [--json FILE]

Results it produced (bench/RESULTS.md, "Where the time goes"), under bench/results/:
``h100-2026-11-22/call-profile/call_profile_shm.json`` (64 MiB calls, ``--phases``, the first
write call) and ``h100-2026-11-22/batch128/call_profile_shm_256M.json`` (256 MiB calls).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
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
          "gdskv.tier:Tier._finish_write", "gdskv.tier:Tier._finish_read",
          "gdskv.tier:Tier._verify_sums", "gdskv.journal:Journal.append", "os:fdatasync",
          "concurrent.futures:Future.result", "gdskv.backends.kvikio:KvikioBackend._submit",
          "gdskv.backends.posix:PosixBackend._submit", "gdskv.tier:Tier._run",
          "gdskv.tier:Tier._take_part", "gdskv.tier:Tier._copies_done",
          "gdskv.staging:StagingParts._ready", "gdskv.tier:Tier._engine_event",
          "gdskv.tier:Tier._get", "gdskv.tier:Tier._put",
          "gdskv.copiers:PoolCopier.prepare", "gdskv.copiers:PoolCopier.__call__",
          "gdskv.directory:PageDirectory.algorithms", "gdskv.tier:Tier._scatter_event",
          "gdskv.staging:StagingParts.give_back", "gdskv.kernels:page_checksums",
          "gdskv.stats:TierStats.add", "gdskv.gpu_verdicts:GpuVerdicts.__init__",
          "gdskv.gpu_verdicts:GpuVerdicts.scatter", "gdskv.gpu_verdicts:GpuVerdicts.read_back",
          "gdskv.tier:Tier._settle", "gdskv.tier:Tier._gpu_verdicts",
          "gdskv.kernels:page_partial_sums", "gdskv.kernels:scatter_pages_verified",
          "gdskv.tier:Tier._gpu_spill", "gdskv.gpu_spill:GpuSpill.__init__",
          "gdskv.gpu_spill:GpuSpill.gather", "gdskv.gpu_spill:GpuSpill.sums",
          "gdskv.launch_graphs:LaunchGraphs.run", "gdskv.slot_trailer:write_into",
          "gdskv.tier:Tier._trailers", "gdskv.metrics:TierMetrics.call")


def _install_phase_timers(totals: dict, threads: tuple[str, ...]) -> list:
    """Wrap each of PHASES with a wall-clock accumulator (summed over the calling threads);
    returns what to restore."""
    import importlib

    lock = threading.Lock()
    undo = []
    for spec in PHASES:
        mod_name, attr = spec.split(":")
        *path, name = attr.split(".")
        try:  # (a phase the code under test does not have -- an older commit -- is skipped)
            owner = importlib.import_module(mod_name)
            for part in path:
                owner = getattr(owner, part)
            fn = getattr(owner, name)
        except (AttributeError, ImportError):
            continue

        def timed(*a, _fn=fn, _spec=spec, **kw):
            if not threading.current_thread().name.startswith(threads):
                return _fn(*a, **kw)  # not a calling thread (backend threads, the waiter)
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                with lock:
                    n, t = totals.get(_spec, (0, 0.0))
                    totals[_spec] = (n + 1, t + time.perf_counter() - t0)

        setattr(owner, name, timed)
        undo.append((owner, name, fn))
    return undo


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
           iodepth: int = 1, first_call_hook=None) -> tuple[list[float], float]:
    """Per-call wall times, and the wall time of all calls (``iodepth`` threads at once)."""
    def one(b: int) -> float:
        if b == 1 and first_call_hook is not None:  # (exact at iodepth 1)
            first_call_hook()
        pages = list(range(b * ppb, (b + 1) * ppb))
        t0 = time.perf_counter()
        n = engine.write(0, pages) if op == "write" else engine.read(0, pages)
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
        from gdskv.tier import Tier
        Tier._gpu_verdicts = lambda self, drain, todo: None
    preset = get_preset(args.model)
    layout = preset.layout(args.page_tokens)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ppb = max(1, parse_size(args.bs) // layout.page_bytes)
    batches = max(1, parse_size(args.size) // (ppb * layout.page_bytes))
    out: dict = {"iodepth": args.iodepth, "model": args.model, "page_tokens": args.page_tokens, "pages_per_call": ppb,
                 "call_bytes": ppb * layout.page_bytes, "calls": batches, "engines": {}}
    profiles = {}
    phase_totals: dict = {}
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
                prof = cProfile.Profile() if kind == "gdskv" and not args.phases else None
                undo = _install_phase_timers(
                    phase_totals, ("MainThread",) if args.iodepth == 1 else ("profile-",)) if kind == "gdskv" and args.phases \
                    else []
                try:
                    first: dict = {}
                    w, w_all = _calls(engine, "write", batches, ppb,
                                      prof if args.profile_op in ("both", "write") else None,
                                      args.iodepth, lambda: first.update(phase_totals))
                    after_writes = dict(phase_totals)
                    drop_page_cache(engine.files())
                    trace = _trace(args.trace and f"{args.trace}.{kind}.json")
                    with trace:
                        r, r_all = _calls(engine, "read", batches, ppb,
                                          prof if args.profile_op in ("both", "read") else None,
                                          args.iodepth)
                finally:
                    for owner, name, fn in undo:
                        setattr(owner, name, fn)
                if prof is not None:
                    profiles[kind] = prof
            finally:
                engine.close()
        out["engines"][kind] = {
            "write_ms_median": 1e3 * statistics.median(w), "read_ms_median": 1e3 * statistics.median(r),
            "write_ms": [round(1e3 * x, 3) for x in w], "read_ms": [round(1e3 * x, 3) for x in r],
            "write_gbps": batches * out["call_bytes"] / w_all / 1e9,
            "read_gbps": batches * out["call_bytes"] / r_all / 1e9}
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
    print(res.get("gdskv_profile_tottime", ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
