"""The TTFT bench's restore alone, without the model (issue 49): where a ``restore_static`` of N
tokens spends its time against raw kvikio reading the same slab extents, and what the tier's
settings change.

A Llama-3-8B-shaped ``StaticCache`` (32 layers, 8 KV heads of 128, bf16; no weights) is filled
with random KV, spilled through ``examples/transformers_prefix_cache.py``'s ``PrefixCache``,
then, in one process and on the same store:

  raw_first      raw kvikio reads the extents once, right after the spill (the first read of
                 freshly written pages: on /dev/shm slower for raw kvikio too, RESULTS.md
                 "Whole-page staging parts");
  each variant   the store reopened with ``GDSKV_*`` settings (``--variant
                 LABEL:NAME=VALUE[,NAME=VALUE]``; ``default`` always runs first), ``--repeat``
                 restores of every whole page but the last token's into the cache:
                 ``restore_ms`` (the example's call: its prefix match, the tier's get and the
                 cache's length), ``io_ms`` (the tier's ``get`` alone, device synced around it);
                 the KV checked bit-identical to what was spilled after the last one;
  raw            raw kvikio again, ``--repeat`` reads, one before each restore of ``default``
                 (alternating: the same machine state as those restores);
  default_again  the first variant again (drift over the call).

The page cache is dropped before each read (fadvise; /dev/shm cannot drop it: RAM is the
storage). Medians; every sample is in the JSON.

    python bench/experiments/static_restore.py --dir /dev/shm/gdskv --tokens 2k,32k \\
        --variant noverify:GDSKV_VERIFY=0 --variant big:GDSKV_STAGING_SIZE=1GiB \\
        --json restore.json

``--profile K`` adds a cProfile of one more restore, ``--timeline`` its steps stamped (each
chunk's submit, wait and scatter launch; the call's end). Needs CUDA and kvikio (``--device
cpu`` tries the script on the posix backend, no raw).
Results it produced: ``h100-2026-11-27/ttft-restore/``, ``h100-2026-11-27/ttft-final/`` (their READMEs map the calls), bench/RESULTS.md
"Time to first token".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time

import torch

from gdskv.backends.memory_files import wait_registered

import ttft  # its tier config, raw read, timing, token parsing and the example


@contextlib.contextmanager
def environment(settings: dict[str, str]):
    """These ``GDSKV_*`` variables set inside the block, the others as they were."""
    before = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    label, sep, rest = text.partition(":")
    settings = dict(part.partition("=")[::2] for part in rest.split(",") if part)
    if not sep or not label or not settings or any(
            not k.startswith("GDSKV_") or not v for k, v in settings.items()):
        raise argparse.ArgumentTypeError(
            f"--variant {text!r}: expected LABEL:GDSKV_NAME=VALUE[,GDSKV_NAME=VALUE]")
    return label, settings


def restore_samples(pc, keys, cache, repeat: int, device, args, before=None) -> dict:
    """``repeat`` restores; ``before()`` (raw kvikio's read) runs before each, so both see the
    machine in the same state (this VM's reads drift by several % within a call)."""
    samples = []
    for _ in range(repeat):
        if before is not None:
            before()
        for layer in cache.layers:  # untimed: the restore alone puts the prefix back
            layer.keys.zero_()
            layer.values.zero_()
        ttft.drop(ttft.slab_files(args.store), args)
        with ttft.timing_gets(pc.tier, device) as io:
            (tokens, s) = ttft.timed(device, lambda: pc.restore_static(keys, cache))
        samples.append({"restore_ms": s * 1e3, "io_ms": sum(io) * 1e3, "tokens": tokens})
    return {"restore_ms": statistics.median(s["restore_ms"] for s in samples),
            "io_ms": statistics.median(s["io_ms"] for s in samples), "samples": samples}


def profile_restore(pc, keys, cache, device, args) -> str:
    """cProfile of one more restore on this thread (wall time here: waits on I/O and the
    device show as such): the top functions by their own time."""
    import cProfile
    import io
    import pstats
    ttft.drop(ttft.slab_files(args.store), args)
    prof = cProfile.Profile()
    ttft.sync(device)
    prof.enable()
    pc.restore_static(keys, cache)
    ttft.sync(device)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.profile)
    return text.getvalue()


def timeline_restore(pc, keys, cache, device, args) -> dict:
    """One more restore with its steps stamped (ms from the call's start, on this thread):
    the prefix matched, the keys checked, the pages pinned and the call's prologue done
    (``RestoreCall._prepare``); each chunk's read submitted (``backend.start``), its wait begun and ended and its
    verify + scatter queued (``RestoreCall._finish_read``); the slots unpinned, the call's
    stream synced (``gpu done``), the GPU's verdicts settled, the tier's ``get`` returned, and
    the call's end after a device sync. Reads on kvikio's threads end somewhere before their wait ends."""
    from gdskv import restore_call
    stamps: list[tuple[str, float]] = []
    t0 = [0.0]

    def stamp(what: str) -> None:
        stamps.append((what, (time.perf_counter() - t0[0]) * 1e3))

    backend = pc.tier.backend
    start, finish = backend.start, restore_call.RestoreCall._finish_read

    def timed_start(*a, **k):
        fut = start(*a, **k)
        stamp("submit")
        return fut

    def timed_finish(self, r):
        stamp("wait")
        r.fut.result()
        stamp("read")
        finish(self, r)
        stamp("queued")
    from gdskv import directory, tier
    # (class, method, stamp when it has returned): the call's start and end, in order
    steps = [(tier.Tier, "match_prefix", "matched"), (tier.Tier, "_check_keys", "keys checked"),
             (directory.PageDirectory, "pin_for_read", "pinned"),
             (restore_call.RestoreCall, "_prepare", "prepared"),
             (restore_call.RestoreCall, "_unpin", "unpinned"),
             (restore_call.RestoreCall, "_settle", "settled"), (tier.Tier, "get", "got")]
    originals = {(cls, name): cls.__dict__[name] for cls, name, _ in steps}
    copies_done = restore_call.copies_done

    def stamped(cls, name, what):
        fn = originals[cls, name]
        static = isinstance(fn, staticmethod)
        fn = fn.__func__ if static else fn

        def run(*a, **k):
            out = fn(*a, **k)
            stamp(what)
            return out
        return staticmethod(run) if static else run

    def timed_copies_done(*a, **k):
        out = copies_done(*a, **k)
        stamp("gpu done")
        return out
    backend.start = timed_start
    restore_call.RestoreCall._finish_read = timed_finish
    restore_call.copies_done = timed_copies_done
    for cls, name, what in steps:
        setattr(cls, name, stamped(cls, name, what))
    try:
        ttft.drop(ttft.slab_files(args.store), args)
        ttft.sync(device)
        t0[0] = time.perf_counter()
        pc.restore_static(keys, cache)
        ttft.sync(device)
        stamp("end")
    finally:
        del backend.start
        restore_call.RestoreCall._finish_read = finish
        restore_call.copies_done = copies_done
        for (cls, name), fn in originals.items():
            setattr(cls, name, fn)
    return {"stamps": stamps}


def one_n(ex, config, n: int, args, device) -> dict:
    import transformers
    cache = transformers.StaticCache(config=config, max_cache_len=n)
    _, heads, head_dim = ex.kv_geometry(config)
    cache.early_initialization(1, heads, head_dim, torch.bfloat16, device)
    g = torch.Generator(device=device).manual_seed(n)
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            t.copy_(torch.randn(t.shape, generator=g, device=device, dtype=torch.float32))
    source = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    ids = torch.randint(0, config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
    keys = ex.page_keys(ids, args.page_size)[:(n - 1) // args.page_size]
    tokens = len(keys) * args.page_size
    layout = ex.cache_layout(config, args.page_size, torch.bfloat16)
    out: dict = {"tokens": n, "pages": len(keys), "bytes": len(keys) * layout.slot_bytes,
                 "variants": {}}

    def prefix_cache(settings: dict[str, str]):
        with environment(settings):
            cfg = ttft.tier_config(args, args.store, layout.slot_bytes, len(keys))
        return ex.PrefixCache(config, cfg, page_size=args.page_size, dtype=torch.bfloat16,
                              device=device, model_name="static-restore")

    with prefix_cache({}) as pc:
        stored, s = ttft.timed(device, lambda: pc.spill(keys, cache))
        out["spill_ms"] = s * 1e3
        if stored != len(keys):
            raise RuntimeError(f"spilled {stored} of {len(keys)} pages")
        out["raw_first"] = ttft.raw_kvikio(pc.tier, keys, args)
        out["backend"] = {k: pc.tier.stats()[k] for k in ("backend", "gpu_direct")}
    for label, settings in [("default", {})] + args.variant + [("default_again", {})]:
        with prefix_cache(settings) as pc:
            memory_files = wait_registered(pc.tier)  # (a store in /dev/shm: mapped)
            pc.restore_static(keys, cache)  # warm: the first whole restore (kernels, graphs)
            raws = []
            r = restore_samples(pc, keys, cache, args.repeat, device, args,
                                before=(lambda: raws.append(ttft.raw_kvikio(pc.tier, keys, args)))
                                if label == "default" else None)
            r["settings"] = settings
            r["memory_files"] = memory_files
            r["bit_exact_kv"] = all(
                torch.equal(layer.keys[..., :tokens, :], k[..., :tokens, :]) and
                torch.equal(layer.values[..., :tokens, :], v[..., :tokens, :])
                for layer, (k, v) in zip(cache.layers, source))
            out["variants"][label] = r
            if label == "default" and args.profile:
                out["profile"] = profile_restore(pc, keys, cache, device, args)
            if label == "default" and args.timeline:
                out["timeline"] = timeline_restore(pc, keys, cache, device, args)
            if label == "default":  # raw's reads, one before each of these restores
                out["raw"] = {"ms": statistics.median(r.get("ms", 0.0) for r in raws),
                              "samples_ms": [r.get("ms", 0.0) for r in raws],
                              "skipped": raws[0].get("skipped")}
    for r in out["variants"].values():
        r["gbps"] = out["bytes"] / r["io_ms"] / 1e6
        r["io_vs_raw"] = out["raw"]["ms"] / r["io_ms"] if out["raw"]["ms"] else None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="where the store goes (a new folder in it)")
    ap.add_argument("--tokens", type=ttft.parse_tokens, default=[2048, 32768])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--variant", type=parse_variant, action="append", default=[])
    ap.add_argument("--device", help="cuda (default where there is one) or cpu (posix "
                                     "backend, no raw kvikio: to try the script)")
    ap.add_argument("--profile", type=int, default=0, metavar="K",
                    help="also cProfile one restore of the default variant: its top K "
                         "functions by own time (printed, and in the JSON)")
    ap.add_argument("--timeline", action="store_true",
                    help="also stamp one restore's steps (each chunk's submit, wait, read "
                         "ended, scatter queued; printed in short, whole in the JSON)")
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.backend = "kvikio" if device.type == "cuda" else "posix"  # CPU: a smoke run, no raw
    args.tiny, args.drop_caches = False, "files"
    import transformers
    config = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    ex = ttft.example()  # the code a user copies is the code measured
    os.makedirs(args.dir, exist_ok=True)
    result = {"experiment": "static_restore", "date": time.strftime("%Y-%m-%d"),
              "device": ttft.device_info(device), "dir": args.dir,
              "medium": ttft.medium(args.dir), "runs": []}
    failed = False
    for n in args.tokens:
        with tempfile.TemporaryDirectory(prefix="gdskv-restore-", dir=args.dir) as store:
            args.store = store
            run = one_n(ex, config, n, args, device)
        result["runs"].append(run)
        raw = run["raw"]["ms"]
        print(f"N={n}: {run['pages']} pages, {run['bytes'] / 2**20:.0f} MiB; raw first "
              f"{run['raw_first'].get('ms', 0.0):.2f} ms, raw {raw:.2f} ms "
              f"({' '.join(f'{x:.2f}' for x in run['raw']['samples_ms'])})")
        for label, r in run["variants"].items():
            failed |= not r["bit_exact_kv"]
            print(f"  {label:14s} restore {r['restore_ms']:7.2f} ms  io {r['io_ms']:7.2f} ms "
                  f"({r['gbps']:5.1f} GB/s, {r['io_vs_raw'] or 0:.2f}x raw)  "
                  f"{'exact' if r['bit_exact_kv'] else 'NOT EXACT'}  "
                  f"[files in memory: {r['memory_files']['state']}]  "
                  + " ".join(f"{s['io_ms']:.2f}" for s in r["samples"]))
        if "timeline" in run:
            st = run["timeline"]["stamps"]
            subs = [t for w, t in st if w == "submit"]
            waits = [(t, u) for (w, t), (v, u) in zip(st, st[1:]) if w == "wait" and v == "read"]
            print(f"  timeline: {len(subs)} chunks; first submit {subs[0]:.2f} ms, last "
                  f"{subs[-1]:.2f}; waited {sum(u - t for t, u in waits):.2f} ms in "
                  f"{len(waits)} waits; last read seen {waits[-1][1]:.2f}; end {st[-1][1]:.2f}")
            print("  " + " ".join(f"{w[0]}{t:.1f}" for w, t in st if w in
                                  ("submit", "wait", "read", "queued")))
            print("  steps: " + ", ".join(f"{w} {t:.2f}" for w, t in st
                                         if w not in ("submit", "wait", "read", "queued")))
        if "profile" in run:
            print("\n".join(line for line in run["profile"].splitlines()[:12 + args.profile]
                            if line.strip()))
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
