"""Running a job: phases, ``numjobs`` threads, ``iodepth`` batches in flight, timing.

Phases by ``rw`` (fio's meanings, adapted to pages that must exist before they can be read):

- ``write`` / ``randwrite``: timed writes; with ``verify=1`` then a timed read-back (reported as
  the job's read, as fio's verify reads are) and a byte comparison.
- ``read`` / ``randread``: pages laid out first (untimed, as fio lays out its file), page cache
  dropped, then timed reads.
- ``rw`` / ``randrw``: layout, cache drop, then a timed mix: each batch is a read with
  probability ``rwmixread``%, else a rewrite of that batch; with ``verify=1`` then an untimed
  read-back of every page (after a cache drop), as fio verifies what a mixed job wrote: the mix
  alone may read some batches never (or none at all), and its figures stay the mix's own.

``rand*`` shuffles the batch order and where pages sit (pool positions for gdskv: a scattered
gather; store slots for raw: scattered file offsets). ``runtime`` stops early, ``time_based``
repeats passes until ``runtime``; completions during ``ramp_time`` are not counted. Each batch's
latency is one sample: slat = queueing before it starts (iodepth > 1), clat = the call itself.
"""

from __future__ import annotations

import collections
import resource
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gdskv.config import TierConfig
from gdskv.layout import KVLayout
from gdskv.memory import cuda_available

from .cache import fs_type
from .engines import Engine, EngineSpec, EngineUnavailable, make_engine, sglang_hicache
from .measurements import EIO, EILSEQ, DirStats, JobResult, fmt_size_exact, plural
from .options import JobOptions, OptionError, job_options_dict, size_text
from .placement import Placement, place
from .presets import ModelPreset, break_even, get_preset

#: test hook: called as HOOK(engine) between a job's write phase and its read phase
AFTER_WRITE_HOOK: Callable[[Engine], None] | None = None


@dataclass
class JobPlan:
    opts: JobOptions
    engine: str
    layout: KVLayout
    preset: ModelPreset | None
    device: torch.device
    mem: str
    pages_per_batch: int
    batches: int                  # per thread
    placement: Placement          # tier settings, directories, capacity
    notes: list[str] = field(default_factory=list)

    @property
    def pages(self) -> int:
        return self.pages_per_batch * self.batches

    @property
    def batch_bytes(self) -> int:
        return self.pages_per_batch * self.layout.page_bytes


def resolve(opts: JobOptions, engine: str | None = None) -> JobPlan:
    """Check a job's options together and work out its geometry and where it writes;
    OptionError if they clash, SetupError if this machine cannot run them."""
    engine = engine or opts.ioengine
    preset = get_preset(opts.model) if opts.model else None
    layout = _layout(opts, preset)
    if opts.mem == "gpu" and not cuda_available():
        raise OptionError(f"job {opts.name!r}: option mem=gpu but no CUDA device is usable here")
    mem = opts.mem or ("gpu" if cuda_available() else "host")
    device = torch.device("cuda", torch.cuda.current_device()) if mem == "gpu" \
        else torch.device("cpu")
    ppb, batches, notes = _batching(opts, layout)
    if opts.time_based and not opts.runtime:
        raise OptionError(f"job {opts.name!r}: option time_based needs --runtime")
    if engine == "hicachefile":
        try:
            sglang_hicache()
        except EngineUnavailable as exc:
            raise OptionError(f"option ioengine=hicachefile: {exc}") from None
    if opts.prefill_tflops and preset is None:
        raise OptionError(f"job {opts.name!r}: option prefill_tflops needs --model (the "
                          "preset gives FLOPs per token)")
    placement = place(opts, layout, ppb * batches * opts.numjobs)
    return JobPlan(opts, engine, layout, preset, device, mem, ppb, batches, placement, notes)


def _layout(opts: JobOptions, preset: ModelPreset | None) -> KVLayout:
    if preset is None and None in (opts.layers, opts.head_dim):
        raise OptionError("job %r: give --model (%s) or at least --layers and --head-dim"
                          % (opts.name, "llama3-8b, ..."))
    mla = opts.mla if opts.mla is not None else (preset.mla if preset else False)
    kv_heads = opts.kv_heads if opts.kv_heads is not None else (
        1 if mla else (preset.kv_heads if preset else None))
    if kv_heads is None:
        raise OptionError(f"job {opts.name!r}: --kv-heads is needed without --model")
    try:
        layout = KVLayout(
            num_layers=opts.layers or preset.layers, page_size=opts.page_tokens,
            head_dim=opts.head_dim or preset.head_dim, kv_heads=kv_heads,
            dtype=opts.dtype or (preset.dtype if preset else "bfloat16"), mla=mla,
            model_name=(preset.hf_name if preset else "custom"))
    except ValueError as exc:
        raise OptionError(f"job {opts.name!r}: {exc}") from None
    return layout


def _batching(opts: JobOptions, layout: KVLayout) -> tuple[int, int, list[str]]:
    """Pages per call (bs in whole pages, cut to size) and calls per thread, with a note for
    each rounding: the report says why its io= is not the size asked for."""
    notes = []
    page = fmt_size_exact(layout.page_bytes)
    if opts.size < layout.page_bytes:
        raise OptionError(f"job {opts.name!r}: option size={opts.given.get('size', opts.size)} "
                          f"is less than one page ({page})")
    bs = size_text(opts.given.get("bs"), opts.bs, opts.kb_base)
    ppb = max(1, opts.bs // layout.page_bytes)
    if opts.bs < layout.page_bytes:
        notes.append(f"bs={bs} is less than one page ({page}): 1 page per call")
    elif opts.bs % layout.page_bytes:
        notes.append(f"bs={bs} rounded to {plural(ppb, 'whole page')} of {page}")
    if ppb * layout.page_bytes > opts.size:
        ppb = opts.size // layout.page_bytes
        notes.append(f"batch cut to size: {plural(ppb, 'page')}")
    batch = ppb * layout.page_bytes
    batches = opts.size // batch
    if batches * batch != opts.size:
        notes.append(f"size={size_text(opts.given.get('size'), opts.size, opts.kb_base)} "
                     f"rounded down to {fmt_size_exact(batches * batch)}: "
                     f"{plural(batches, 'call')} of {fmt_size_exact(batch)} "
                     f"({plural(ppb, 'page')}), as a job moves whole calls")
    return ppb, batches, notes


# -- running ------------------------------------------------------------------------------------

class Progress:
    """Counts bytes done; the CLI polls it to draw a progress bar."""

    def __init__(self) -> None:
        self.done = 0
        self.total = 0
        self.label = ""
        self._lock = threading.Lock()

    def start(self, label: str, total: int) -> None:
        with self._lock:
            self.label, self.total, self.done = label, total, 0

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n


@dataclass
class _Phase:
    kind: str                 # "write" | "read" | "mixed"
    timed: bool = True
    label: str = ""           # for the progress bar, when not the kind


def _phases(rw: str, verify: bool) -> list[_Phase]:
    if rw in ("write", "randwrite"):
        return [_Phase("write")] + ([_Phase("read")] if verify else [])
    layout = [_Phase("write", timed=False, label="layout")]
    if rw in ("read", "randread"):
        return layout + [_Phase("read")]
    return layout + [_Phase("mixed")] + ([_Phase("read", timed=False, label="verify")]
                                         if verify else [])


class _ThreadState:
    def __init__(self) -> None:
        self.stats = {"read": DirStats(), "write": DirStats()}
        self.written: set[int] = set()
        self.read_ok: set[int] = set()
        self.read_failed_pages = 0


def _ops(kind: str, batches: int, rng: np.random.Generator, randomize: bool, repeat: bool,
         rwmixread: int) -> Iterator[tuple[str, int]]:
    while True:
        order = rng.permutation(batches) if randomize else range(batches)
        for b in order:
            if kind == "mixed":
                yield ("read" if rng.random() * 100 < rwmixread else "write"), int(b)
            else:
                yield kind, int(b)
        if not repeat:
            return


class _PhaseRun:
    """One phase: ``numjobs`` threads, each keeping up to ``iodepth`` batches in flight."""

    def __init__(self, engine: Engine, plan: JobPlan, phase: _Phase,
                 states: list[_ThreadState], progress: Progress | None) -> None:
        o = plan.opts
        self.engine, self.plan, self.phase, self.states, self.progress = (
            engine, plan, phase, states, progress)
        self.ppb = plan.pages_per_batch
        self.ramp_ns = int(o.ramp_time * 1e9) if phase.timed else 0
        self.runtime_ns = int(o.runtime * 1e9) if (phase.timed and o.runtime) else None
        self.repeat = bool(phase.timed and o.time_based)
        self.errors: list[BaseException] = []

    def run(self) -> None:
        o, threads = self.plan.opts, self.plan.opts.numjobs
        if self.progress is not None:
            total = (self.plan.batches * self.plan.batch_bytes * threads) if not self.repeat \
                else 0
            self.progress.start(f"{o.name} {self.engine.name} "
                                f"{self.phase.label or self.phase.kind}", total)
        barrier = threading.Barrier(threads + 1)
        workers = [threading.Thread(target=self._worker, args=(t, barrier),
                                    name=f"bench-job-{t}", daemon=True) for t in range(threads)]
        for w in workers:
            w.start()
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            pass
        for w in workers:
            while w.is_alive():
                w.join(0.1)
                if self.progress is not None and getattr(self.progress, "tick", None):
                    self.progress.tick()
        if self.errors:
            raise self.errors[0]

    def _call(self, op: str, t: int, b: int) -> tuple[int, int, int]:
        """One batch: (start ns, end ns, pages done)."""
        pages = list(range(b * self.ppb, (b + 1) * self.ppb))
        args = self.engine.call_args(op, t, pages)  # what an engine has in hand: untimed
        start = time.perf_counter_ns()
        ok = self.engine.run(op, args)
        return start, time.perf_counter_ns(), ok

    def _worker(self, t: int, barrier: threading.Barrier) -> None:
        o, st = self.plan.opts, self.states[t]
        rng = np.random.default_rng(
            (o.randseed, t, ("write", "read", "mixed").index(self.phase.kind)))
        pool = ThreadPoolExecutor(o.iodepth, thread_name_prefix=f"bench-{t}") \
            if o.iodepth > 1 else None
        inflight: collections.deque = collections.deque()
        last_done = [0]
        try:
            barrier.wait()
            t0 = time.perf_counter_ns()
            for op, b in _ops(self.phase.kind, self.plan.batches, rng, o.rw.startswith("rand"),
                              self.repeat, o.rwmixread):
                if self.runtime_ns is not None and \
                        time.perf_counter_ns() - t0 >= self.ramp_ns + self.runtime_ns:
                    break
                if any(item[1] == b for item in inflight):  # never overlap ops on one batch
                    while inflight:
                        self._complete(st, inflight.popleft(), pool, t0, last_done)
                while len(inflight) >= o.iodepth:
                    self._complete(st, inflight.popleft(), pool, t0, last_done)
                if op == "write" and b in st.written:
                    self.engine.forget(t, list(range(b * self.ppb, (b + 1) * self.ppb)))  # untimed
                t_submit = time.perf_counter_ns()
                fut = pool.submit(self._call, op, t, b) if pool else self._call(op, t, b)
                inflight.append((op, b, t_submit, fut))
                if pool is None:
                    self._complete(st, inflight.popleft(), pool, t0, last_done)
            while inflight:
                self._complete(st, inflight.popleft(), pool, t0, last_done)
            self._close_runtime(st, t0, last_done[0])
        except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
            self.errors.append(exc)
        finally:
            if pool is not None:
                pool.shutdown(wait=True)

    def _complete(self, st: _ThreadState, item, pool, t0: int, last_done: list[int]) -> None:
        """Account one finished batch: which batches hold data, stats when timed."""
        op, b, t_submit, fut = item
        start, end, ok = fut.result() if pool else fut
        n = self.ppb
        if op == "write":
            st.written.add(b)
        elif ok == n:
            st.read_ok.add(b)
        else:
            st.read_failed_pages += n - ok
            st.read_ok.discard(b)
        if self.progress is not None:
            self.progress.add(ok * self.plan.layout.page_bytes)
        if not self.phase.timed or end - t0 < self.ramp_ns:
            return
        d = st.stats[op]
        d.add(slat=start - t_submit, clat=end - start, done=end - t0 - self.ramp_ns,
              nbytes=ok * self.plan.layout.page_bytes)
        if ok < n:
            d.failed_ios += 1
            d.failed_pages += n - ok
        last_done[0] = max(last_done[0], end)

    def _close_runtime(self, st: _ThreadState, t0: int, last_done: int) -> None:
        """The phase's runtime: from its start (after ramp) to the last counted completion."""
        if not (self.phase.timed and last_done):
            return
        span = max(0, last_done - t0 - self.ramp_ns)
        kinds = ("read", "write") if self.phase.kind == "mixed" else (self.phase.kind,)
        for k in kinds:
            if st.stats[k].total_ios:
                st.stats[k].runtime_ns += span


@dataclass
class _CpuTime:
    """CPU use over the timed phases (fio's ``cpu`` line)."""
    wall: float = 0.0
    usr: float = 0.0
    sys: float = 0.0
    ctx: int = 0
    majf: int = 0
    minf: int = 0

    @staticmethod
    def sample() -> tuple[float, float, int, int, int]:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime, r.ru_stime, r.ru_nvcsw + r.ru_nivcsw, r.ru_majflt, r.ru_minflt

    def add(self, before: tuple, after: tuple, wall: float) -> None:
        self.wall += wall
        self.usr += after[0] - before[0]
        self.sys += after[1] - before[1]
        self.ctx += after[2] - before[2]
        self.majf += after[3] - before[3]
        self.minf += after[4] - before[4]


def run_job(plan: JobPlan, groupid: int, progress: Progress | None = None) -> list[JobResult]:
    """Run one job to completion; returns one result per clone, or one with group_reporting."""
    o = plan.opts
    made: list[str] = []
    start_wall = time.time()
    try:
        for d in plan.placement.base_dirs:
            made.append(tempfile.mkdtemp(prefix=f"gdskv-bench-{o.name}-{plan.engine}-", dir=d))
        config = plan.placement.config.replace(directories=tuple(made),
                                               capacity=plan.placement.capacity)
        spec = EngineSpec(name=o.name, layout=plan.layout, config=config, device=plan.device,
                          threads=o.numjobs, pages=plan.pages, seed=o.randseed,
                          randomize=o.rw.startswith("rand"), verify=o.verify,
                          batch_pages=plan.pages_per_batch, raw_io=o.raw_io)
        engine = make_engine(plan.engine, spec)
        try:
            engine.open()
            return _run_phases(engine, plan, config, made, groupid, progress, start_wall)
        finally:
            engine.close()
    finally:
        if o.unlink:
            for d in made:
                shutil.rmtree(d, ignore_errors=True)


def _run_phases(engine: Engine, plan: JobPlan, config: TierConfig, made: list[str],
                groupid: int, progress: Progress | None, start_wall: float) -> list[JobResult]:
    states = [_ThreadState() for _ in range(plan.opts.numjobs)]
    cpu, invalidations = _run_all(engine, plan, states, progress)
    elapsed = time.time() - start_wall
    verify = _verify(engine, plan, states) if plan.opts.verify else None
    g = _gdskv_object(engine, plan, config, made, invalidations, verify)
    return _job_results(plan, states, g, verify, cpu, groupid, start_wall, elapsed)


def _run_all(engine: Engine, plan: JobPlan, states: list[_ThreadState],
             progress: Progress | None) -> tuple[_CpuTime, list[dict]]:
    """The job's phases in order; the page cache is dropped before each read phase."""
    o = plan.opts
    cpu, invalidations, wrote = _CpuTime(), [], False
    for phase in _phases(o.rw, o.verify):
        if phase.kind in ("read", "mixed"):
            if wrote and AFTER_WRITE_HOOK is not None:
                AFTER_WRITE_HOOK(engine)
            if hasattr(engine, "reset_read_buffers"):
                engine.reset_read_buffers()
            if o.invalidate or o.drop_caches:
                invalidations.append(engine.invalidate(machine_wide=o.drop_caches))
        before, t = _CpuTime.sample(), time.perf_counter()
        _PhaseRun(engine, plan, phase, states, progress).run()
        if phase.timed:
            cpu.add(before, _CpuTime.sample(), time.perf_counter() - t)
        wrote = wrote or phase.kind in ("write", "mixed")
    return cpu, invalidations


def _verify(engine: Engine, plan: JobPlan, states: list[_ThreadState]) -> dict[str, Any]:
    """Compare every page read back with what was written; pages not read count as missing."""
    checked = mismatched = 0
    missing = sum(s.read_failed_pages for s in states)
    ppb = plan.pages_per_batch
    for t, st in enumerate(states):
        pages = [p for b in sorted(st.read_ok) for p in range(b * ppb, (b + 1) * ppb)]
        checked += len(pages)
        if pages:
            mismatched += engine.verify(t, pages)
    return {"ok": mismatched == 0 and missing == 0 and checked > 0,
            "pages_checked": checked, "mismatched": mismatched, "missing": missing}


def _gdskv_object(engine: Engine, plan: JobPlan, config: TierConfig, made: list[str],
                  invalidations: list[dict], verify: dict | None) -> dict[str, Any]:
    """What fio has no name for: engine, backend, O_DIRECT, layout, store, cache drop, verify."""
    o, info, lay = plan.opts, engine.info(), plan.layout
    g: dict[str, Any] = {
        "engine": plan.engine, "backend": info.get("backend"),
        "gpu_direct": bool(info.get("gpu_direct")), "compat_mode": info.get("compat_mode", "n/a"),
        "o_direct": bool(info.get("o_direct")), "o_direct_reason": info.get("o_direct_reason"),
        "backend_detail": info.get("backend_detail", {}),
        "backend_selected_because": info.get("backend_selected_because", ""),
        "page_engine": info.get("page_engine"),
        "page_engine_detail": info.get("page_engine_detail", {}),
        "mem": plan.mem, "device": str(plan.device),
        "directories": made, "fs_types": sorted({fs_type(d) for d in made}),
        "store": {**plan.placement.describe(), "directories": made, "kept": not o.unlink},
        "layout": lay.to_dict(), "model": o.model,
        "page_bytes": lay.page_bytes, "slot_bytes": lay.slot_bytes,
        "bytes_per_token": lay.page_bytes // lay.page_size,
        "pages_per_batch": plan.pages_per_batch, "batch_bytes": plan.batch_bytes,
        "pages_per_thread": plan.pages, "iodepth": o.iodepth, "numjobs": o.numjobs,
        "config": {"backend": config.backend.value, "direct_io": config.direct_io.value,
                   "sync": config.sync.value, "verify_checksums": config.verify,
                   "io_threads": config.io_threads, "io_chunk_size": config.io_chunk_size,
                   "io_poll_us": config.io_poll_us,
                   "staging_size": config.staging_size, "files_per_dir": config.files_per_dir,
                   "capacity": config.capacity},
        "invalidate": _merge_invalidations(invalidations, o.invalidate or o.drop_caches),
        "verify": verify,
    }
    notes = list(plan.notes)
    if info.get("note"):
        notes.append(info["note"])
    if "tier_stats" in info:
        g["tier_stats"] = info["tier_stats"]
    g["note"] = "; ".join(notes)
    return g


def _job_results(plan: JobPlan, states: list[_ThreadState], g: dict[str, Any],
                 verify: dict | None, cpu: _CpuTime, groupid: int, start_wall: float,
                 elapsed: float) -> list[JobResult]:
    """One result per clone, or one for the job (group_reporting or a single clone)."""
    o = plan.opts
    error = 0
    if any(s.stats["write"].failed_pages or s.stats["read"].failed_pages for s in states):
        error = EIO
    if verify is not None and not verify["ok"]:
        error = EILSEQ if verify["mismatched"] else EIO
    cpu_wall = max(cpu.wall, 1e-9)

    def result(name_states: list[_ThreadState], clone: int | None) -> JobResult:
        return JobResult(
            name=o.name, groupid=groupid, jobs=len(name_states),
            read=DirStats.merge([s.stats["read"] for s in name_states]),
            write=DirStats.merge([s.stats["write"] for s in name_states]),
            options=job_options_dict(o), gdskv=dict(g), error=error, elapsed_s=elapsed,
            usr_cpu=100.0 * cpu.usr / cpu_wall, sys_cpu=100.0 * cpu.sys / cpu_wall,
            ctx=cpu.ctx, majf=cpu.majf, minf=cpu.minf, start_time=start_wall,
            description=o.description, clone=clone)

    if o.group_reporting or o.numjobs == 1:
        results = [result(states, None)]
    else:
        results = [result([s], t) for t, s in enumerate(states)]
    if o.prefill_tflops and plan.preset is not None:
        read_bw = DirStats.merge([s.stats["read"] for s in states]).bw_bytes or None
        be = break_even(plan.layout, plan.preset.flops_per_token, o.prefill_tflops,
                        read_bw).to_dict()
        for r in results:
            r.gdskv["break_even"] = be
    return results


def _merge_invalidations(items: list[dict], asked: bool) -> dict[str, Any] | None:
    if not asked:
        return {"done": False, "summary": "not asked (invalidate=0)"}
    if not items:
        return None
    last = dict(items[-1])
    last["done"] = all(i.get("done") for i in items)
    last["times"] = len(items)
    return last
