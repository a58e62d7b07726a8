"""Timeline of 256 MiB read calls: when each chunk's I/O ends vs. when the tier is done with it.
A/B: the checksum's device->host copy pageable (.cpu()) vs pinned + non_blocking + event.

    python bench/experiments/read_timeline.py DIR BS_MIB SIZE_GIB VARIANTS
    (e.g. /dev/shm/p 256 2 default,pinned,noverify; needs CUDA and kvikio)

It wraps private methods of the tier and the kvikio backend (``Tier._finish_read``,
``KvikioBackend._wait``) as they were at commit 6605c04; on later code those names may differ.
Result it produced (bench/RESULTS.md, "Where the time goes"), under bench/results/:
``h100-2026-11-22/batch128/read_timeline.txt``.
"""
import sys, time, tempfile, threading, statistics
import numpy as np, torch
from gdskv.config import TierConfig
from gdskv.bench.engines import EngineSpec, make_engine
from gdskv.bench.presets import get_preset
from gdskv.bench.cache import drop_page_cache
import gdskv.checksum as cks
import gdskv.tier as tier_mod
from gdskv.backends import kvikio as kb

directory, bs_mib, size_gib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
variants = sys.argv[4].split(",")
lay = get_preset("llama3-8b").layout(16)
ppb = bs_mib * 2**20 // lay.page_bytes
batches = size_gib * 2**30 // (ppb * lay.page_bytes)
dev = torch.device("cuda")
log = []
T0 = [0.0]
def mark(what):
    log.append((what, (time.perf_counter() - T0[0]) * 1e3, threading.current_thread().name))

orig_wait = kb.KvikioBackend._wait
def timed_wait(started, outcome, buffer):
    r = orig_wait(started, outcome, buffer); mark("io_done"); return r
kb.KvikioBackend._wait = staticmethod(timed_wait)
orig_fr = tier_mod.Tier._finish_read
def timed_fr(self, *a, **k):
    mark("fr_enter"); r = orig_fr(self, *a, **k); mark("fr_exit"); return r
tier_mod.Tier._finish_read = timed_fr
orig_compute = cks.GpuPageChecksummer.compute
_local = threading.local()
def pinned_compute(self, staging, num_pages):
    from gdskv import kernels
    sums = kernels.page_checksums(staging, num_pages, self.page_bytes, self.slot_bytes)
    host = getattr(_local, "h", None)
    if host is None or host.numel() < sums.numel():
        host = _local.h = torch.empty(4096, dtype=sums.dtype, pin_memory=True)
    h = host[:sums.numel()]
    h.copy_(sums, non_blocking=True)
    ev = torch.cuda.Event(); ev.record(); ev.synchronize()
    return h.numpy().copy().view(np.uint64)

def run(kind, variant):
    cks.GpuPageChecksummer.compute = pinned_compute if variant == "pinned" else orig_compute
    with tempfile.TemporaryDirectory(dir=directory) as d:
        cfg = TierConfig.from_env(directories=(d,), backend="kvikio",
                                  capacity=2 * batches * ppb * lay.slot_bytes,
                                  **({"verify": False} if variant == "noverify" else {}))
        spec = EngineSpec(name="t", layout=lay, config=cfg, device=dev, threads=1,
                          pages=batches * ppb, seed=1, randomize=False, verify=False,
                          batch_pages=ppb)
        e = make_engine(kind, spec); e.open()
        try:
            for b in range(batches):
                e.write(0, list(range(b * ppb, (b + 1) * ppb)))
            drop_page_cache(e.files())
            times, lines = [], []
            for b in range(batches):
                log.clear(); T0[0] = time.perf_counter()
                e.read(0, list(range(b * ppb, (b + 1) * ppb)))
                t = (time.perf_counter() - T0[0]) * 1e3; times.append(t)
                if b in (2, 5):
                    lines.append("   call %d: %.2f ms | " % (b, t) + " ".join(
                        "%s@%.2f" % (w, x) for w, x, _ in log))
            print(f"{kind:5s} {variant:8s} read median {statistics.median(times):.2f} ms "
                  f"({ppb * lay.page_bytes / statistics.median(times) / 1e6:.1f} GB/s) "
                  f"all: {[round(x, 2) for x in times]}")
            for l in lines: print(l)
        finally:
            e.close()

for rep in range(2):
    run("raw", "-")
    for v in variants:
        run("gdskv", v)
