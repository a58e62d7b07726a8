"""Where combined calls spend their time (issue 47): a GPU pool's restores of k pages from one
thread (what a combined batch of k calls costs), and 1-page restores from N threads with the
call combiner on, its batches timed from the inside.

    . bench/device/device_check.sh
    python3 bench/experiments/combine_profile.py --dir /dev/shm/gdskv-cp --out $OUT/cp.json

Thread counts run for each ``--running`` (calls or batches at once) and ``--rounds`` (batches a thread that ends a call runs itself
before handing the next over). Per k: mean and p50 µs of one k-page restore alone (200 calls after 20 untimed). Per N: calls/s,
the batches' mean size, the mean µs inside a batch's data call (``Tier._run_batch``), and the
mean µs from a batch being handed over (``CallCombiner._pass_on`` releasing its first waiter)
to that waiter running it. Everything is wrapped around the library from here; nothing in
gdskv changes for it.

Results it produced: ``h100-2026-11-27/combine/`` (calls 2, 3 and 5: ``call*-profile-*.json``,
``call5-*.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import threading
import time

import torch

from gdskv.config import TierConfig
from gdskv.layout import KVLayout
from gdskv.streams import OnStream
from gdskv.tier import Tier


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--layers", type=int, default=1, help="1: 64 KiB pages (Llama-3-8B tokens)")
    p.add_argument("--threads", type=int, nargs="+", default=[4, 16])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument("--rounds", type=int, nargs="+", default=[0],
                   help="CallCombiner.rounds to run each thread count with")
    p.add_argument("--running", type=int, nargs="+", default=[1],
                   help="CallCombiner.running (calls or batches at once) to run each with")
    p.add_argument("--device", default="cuda", help="cuda (kvikio) or cpu (posix, a check)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    lay = KVLayout(num_layers=args.layers, page_size=16, head_dim=128, kv_heads=8, dtype="bf16")
    pages_per_thread = 64
    nmax = max(args.threads)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    pool = tuple(torch.zeros(lay.num_layers, nmax * pages_per_thread * 16, 8, 128,
                             dtype=torch.bfloat16, device=args.device) for _ in range(2))
    cuda = args.device == "cuda"
    cfg = TierConfig(directories=(args.dir,), capacity="2GiB",
                     backend="kvikio" if cuda else "posix")
    result = {"gpu": torch.cuda.get_device_name() if cuda else None,
              "page_bytes": lay.page_bytes,
              "alone": {}, "threads": {}}
    rows = torch.arange(nmax * pages_per_thread * 16).view(-1, 16)
    on_stream = (lambda: OnStream(torch.cuda.Stream())) if cuda else contextlib.nullcontext
    with Tier(lay, cfg, device=args.device) as tier:
        keys = [f"p{i}" for i in range(nmax * pages_per_thread)]
        for i in range(0, len(keys), 64):
            assert all(tier.put(keys[i:i + 64], pool, rows[i:i + 64].reshape(-1)))
        with on_stream():
            for k in args.ks:
                times = []
                for rep in range(220):
                    first = (rep * k) % (len(keys) - k)
                    t0 = time.perf_counter()
                    tier.get(keys[first:first + k], pool, rows[first:first + k].reshape(-1))
                    if rep >= 20:
                        times.append(time.perf_counter() - t0)
                result["alone"][k] = {"mean_us": round(statistics.mean(times) * 1e6, 1),
                                      "p50_us": round(statistics.median(times) * 1e6, 1)}
                print("alone", k, result["alone"][k], flush=True)

        combiner = tier._combiner
        inside: list[tuple[int, float]] = []
        handed: dict[int, float] = {}
        handover: list[float] = []
        run_batch = tier._run_batch

        def timed_batch(batch):
            t = handed.pop(id(batch[0]), None)
            if t is not None:
                handover.append(time.perf_counter() - t)
            t0 = time.perf_counter()
            run_batch(batch)
            inside.append((len(batch), time.perf_counter() - t0))
        combiner._run_batch = timed_batch
        take = combiner._take

        def timed_take():
            batch = take()
            handed[id(batch[0])] = time.perf_counter()
            return batch
        combiner._take = timed_take

        for running, rounds, n in [(m, r, n) for m in args.running for r in args.rounds
                                   for n in args.threads]:
            combiner.rounds, combiner.running = rounds, running
            label = f"{n}/rounds={rounds}/running={running}"
            inside.clear()
            handover.clear()
            counts = [0] * n
            start = threading.Barrier(n + 1)
            stop = [0.0]

            def worker(t: int) -> None:
                base = t * pages_per_thread
                with on_stream():
                    start.wait()
                    i = 0
                    while time.perf_counter() < stop[0]:
                        page = base + i % pages_per_thread
                        tier.get([keys[page]], pool, rows[page])
                        i += 1
                    counts[t] = i
            ths = [threading.Thread(target=worker, args=(t,)) for t in range(n)]
            for th in ths:
                th.start()
            stop[0] = time.perf_counter() + args.seconds
            start.wait()
            for th in ths:
                th.join()
            sizes = [s for s, _ in inside]
            result["threads"][label] = {
                "calls_per_s": round(sum(counts) / args.seconds),
                "batches": len(inside), "mean_batch": round(statistics.mean(sizes), 2)
                if sizes else 0,
                "mean_batch_us": round(statistics.mean(t for _, t in inside) * 1e6, 1)
                if inside else 0,
                "mean_handover_us": round(statistics.mean(handover) * 1e6, 1)
                if handover else 0}
            print("threads", label, result["threads"][label], flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
