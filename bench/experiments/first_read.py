"""Per-call times of 128-page restores in four orders: pages freshly written, read again, with
a pause between calls, and one batch over and over; gdskv against raw kvikio, one engine per run.

It answered why a tier's 128-page read calls looked slower than raw's in ``call_profile.py``:
on /dev/shm the *first* read of freshly written pages is slower for both engines (raw too), and
in the "read again" series gdskv and raw take the same time. It also records, per call, when
the last I/O future completed (``last_io_done_ms``): what is left after it is the call's
verify + scatter tail.

    python bench/experiments/first_read.py --directory /dev/shm/fr --engine gdskv --json F

Result it produced: ``h100-2026-11-23/call-overhead-3/first-read/`` (one device call, the code
before the staging-part change; `raw`, `gdskv` with defaults, ``GDSKV_VERIFY=false``,
``GDSKV_LAUNCH_GRAPHS=false``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from gdskv.config import TierConfig

from gdskv.bench.cache import drop_page_cache
from gdskv.bench.engines import EngineSpec, make_engine
from gdskv.bench.presets import get_preset
import gdskv.backends.kvikio as kvikio_backend

_io_done: list[float] = []


def _timed_wait(wait):
    def timed(self, *args, **kwargs):
        try:
            return wait(self, *args, **kwargs)
        finally:
            _io_done.append(time.perf_counter())
    return timed


def run(args) -> dict:
    kvikio_backend.KvikioBackend._wait = _timed_wait(kvikio_backend.KvikioBackend._wait)
    layout = get_preset(args.model).layout(args.page_tokens)
    ppb, batches = args.pages, args.calls
    out: dict = {"engine": args.engine, "pages_per_call": ppb, "calls": batches}
    with tempfile.TemporaryDirectory(dir=args.directory) as d:
        config = TierConfig.from_env(directories=(d,), backend="kvikio",
                                     capacity=2 * batches * ppb * layout.slot_bytes)
        spec = EngineSpec(name="first-read", layout=layout, config=config,
                          device=torch.device("cuda"), threads=1, pages=batches * ppb, seed=1,
                          randomize=False, verify=False, batch_pages=ppb)
        engine = make_engine(args.engine, spec)
        engine.open()
        try:
            for b in range(batches):
                engine.write(0, list(range(b * ppb, (b + 1) * ppb)))
            drop_page_cache(engine.files())
            for name, order, pause in (("first", range(batches), 0.0),
                                       ("again", range(batches), 0.0),
                                       ("sleep50ms", range(batches), 0.05),
                                       ("same-batch", [0] * batches, 0.0)):
                times, io = [], []
                for b in order:
                    _io_done.clear()
                    t0 = time.perf_counter()
                    n = engine.read(0, list(range(b * ppb, (b + 1) * ppb)))
                    t1 = time.perf_counter()
                    if n != ppb:
                        raise RuntimeError(f"{args.engine}: {n} of {ppb} pages read")
                    times.append(round(1e3 * (t1 - t0), 2))
                    io.append(round(1e3 * (max(_io_done) - t0), 2) if _io_done else None)
                    if pause:
                        time.sleep(pause)
                out[name] = {"ms": times, "last_io_done_ms": io}
                print(f"{args.engine} {name:10s} median {statistics.median(times):6.2f} ms  "
                      f"{times}\n{'':22s}io done {io}", flush=True)
        finally:
            engine.close()
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--directory", default=tempfile.gettempdir())
    p.add_argument("--engine", choices=("gdskv", "raw"), default="gdskv")
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--page-tokens", type=int, default=16)
    p.add_argument("--pages", type=int, default=128, help="pages per call")
    p.add_argument("--calls", type=int, default=16)
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args(argv)
    res = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
