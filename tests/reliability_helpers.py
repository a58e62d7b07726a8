"""Shared pieces of the reliability tests: a tiny layout, key-derived page contents, and the
child-process functions that run under a forkserver with torch and gdskv already imported
(importing torch takes seconds on small CI machines; forking a preloaded server takes ms)."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import resource
import signal
import threading
import time

import torch

from gdskv.config import TierConfig
from gdskv.layout import KVLayout
from gdskv.memory import alloc_host

#: 4 layers x 4 tokens x 48-wide rows: 3072 B pages in 4096 B slots, so every slot has padding
LAYOUT = KVLayout(num_layers=4, page_size=4, head_dim=48)
PAGE = LAYOUT.page_bytes
SLOT = LAYOUT.slot_bytes


def small_config(directory, **overrides) -> TierConfig:
    """A store of 64 slots in 2 files, 4-slot stripes, 4-page staging halves (chunked I/O)."""
    base = dict(directories=(str(directory),), capacity=64 * SLOT, io_chunk_size=4 * SLOT,
                staging_size=8 * SLOT, files_per_dir=2, io_threads=2)
    base.update(overrides)
    return TierConfig(**base)


def wait_for(predicate, seconds: float, what: str) -> None:
    """Poll ``predicate`` until it holds; AssertionError naming ``what`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def hold_first_io(tier) -> tuple[threading.Event, threading.Event]:
    """The tier's next data call's I/O waits for ``go`` (set it); ``started`` is set when it
    does. Calls that arrive meanwhile find that call running (e.g. to be combined with it)."""
    started, go = threading.Event(), threading.Event()
    start = tier.backend.start

    def held(*args):
        if not started.is_set():
            started.set()
            go.wait(30)
        return start(*args)

    tier.backend.start = held
    return started, go


def key_seed(key) -> int:
    raw = key.encode("utf-8", "surrogatepass") if isinstance(key, str) else bytes(key)
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def page_content(key) -> torch.Tensor:
    """The page payload stored under ``key``: deterministic, so any process can recompute it."""
    gen = torch.Generator().manual_seed(key_seed(key) & ((1 << 63) - 1))
    return torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=gen)


def host_page(aligned: bool) -> torch.Tensor:
    """A zeroed PAGE-byte host buffer: 4 KiB aligned (a CPU tier moves it in place), or one
    byte past a 4 KiB boundary (under O_DIRECT it goes through staging). Every page of a call
    gets the same kind, so the call takes one path whatever the allocator returns."""
    raw = alloc_host(PAGE + 4096, pin=False)
    raw.zero_()
    return raw[:PAGE] if aligned else raw[1:1 + PAGE]


def put(tier, keys, *, aligned: bool = False) -> list[bool]:
    pages = []
    for k in keys:
        pages.append([host_page(aligned)])
        pages[-1][0].copy_(page_content(k))
    return tier.put_pages(list(keys), pages)


def read_back(tier, keys, *, aligned: bool = False) -> tuple[list[bool], list[torch.Tensor]]:
    out = [host_page(aligned) for _ in keys]
    hits = tier.get_pages(list(keys), [[o] for o in out])
    return hits, out


def check_pages(tier, keys) -> dict:
    """Read ``keys`` back: counts of hits, misses, and hits with wrong bytes (must stay 0)."""
    keys = list(keys)
    hits, out = read_back(tier, keys) if keys else ([], [])
    wrong = [k for k, h, o in zip(keys, hits, out) if h and not torch.equal(o, page_content(k))]
    return {"hits": sum(hits), "misses": len(keys) - sum(hits), "wrong": wrong,
            "missed": [k for k, h in zip(keys, hits) if not h]}


def ready_keys(tier) -> list:
    return [k for k, _, _ in tier.directory.ready_items()]


def slot_location(tier, key) -> tuple[str, int]:
    """(slab file path, byte offset) of a READY key's slot."""
    slot = tier.directory._index[key]
    f, off = tier.store.location(slot)
    return tier.store.files[f].path, off


def flip_byte(tier, key, offset: int) -> None:
    """Damage a stored page on disk: invert one byte of its payload."""
    path, off = slot_location(tier, key)
    with open(path, "r+b") as fh:
        fh.seek(off + offset)
        byte = fh.read(1)[0]
        fh.seek(off + offset)
        fh.write(bytes([byte ^ 0xFF]))


def forkserver():
    """A multiprocessing context whose server has torch, gdskv and these helpers imported."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "gdskv.tier", "reliability_helpers"])
    return ctx


# -- child processes -------------------------------------------------------------------------------
def _log(fd: int, lines: list[str]) -> None:
    if lines:
        os.write(fd, ("".join(line + "\n" for line in lines)).encode("utf-8", "surrogatepass"))
        os.fsync(fd)


def spill_loop(directory: str, log_path: str, seed: int, key_space: int, overrides: dict,
               lru: bool = False) -> None:
    """Crash-test child: put random batches forever; log ``P key`` (fsynced) after each put that
    returned True, and ``E key`` *before* evicting it; keeps occupancy under 70% with explicit
    evictions so LRU never drops a logged page behind the parent's back. With ``lru`` it
    never evicts itself: the store stays full and every put reuses slots LRU frees."""
    from gdskv.tier import Tier
    rng = random.Random(seed)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    tier = Tier(LAYOUT, small_config(directory, **overrides), device="cpu")
    cap = tier.store.num_slots
    while True:
        if not lru and len(tier.directory) > 0.7 * cap:
            victims = rng.sample(ready_keys(tier), k=cap // 4)
            _log(fd, [f"E {k}" for k in victims])
            tier.evict(victims)
        keys = [f"k{n}" for n in rng.sample(range(key_space), rng.randint(1, 10))]
        ok = put(tier, keys)
        _log(fd, [f"P {k}" for k, good in zip(keys, ok) if good])
        if rng.random() < 0.2:
            probe = rng.sample(keys, 1)
            res = check_pages(tier, probe)
            _log(fd, [f"W {k}" for k in res["wrong"]])


def hold_store(directory: str, ready_path: str, overrides: dict) -> None:
    """Open a tier on ``directory``, say so in ``ready_path``, then wait to be killed."""
    from gdskv.tier import Tier
    tier = Tier(LAYOUT, small_config(directory, **overrides), device="cpu")
    put(tier, ["held"])
    with open(ready_path, "w") as f:
        f.write("open")
    time.sleep(120)
    tier.close()


def try_open(directory: str, result_path: str, overrides: dict) -> None:
    """Try to open the store; write the outcome (class name of the error, or "opened")."""
    from gdskv.tier import Tier
    try:
        Tier(LAYOUT, small_config(directory, **overrides), device="cpu").close()
        out = "opened"
    except Exception as exc:  # reported to the parent, which asserts on it
        out = f"{type(exc).__name__}: {exc}"
    with open(result_path, "w") as f:
        f.write(out)


def file_size_limit_child(directory: str, result_path: str, limit: int) -> None:
    """Under RLIMIT_FSIZE (SIGXFSZ ignored, so writes fail with EFBIG instead of killing us):
    a preallocated store larger than the limit must fail to create with a StoreError; a lazy
    store must fail only the pages past the limit, keep the others, and stay usable."""
    from gdskv.store import StoreError
    from gdskv.tier import Tier
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    out: dict = {}
    try:
        Tier(LAYOUT, small_config(os.path.join(directory, "prealloc")), device="cpu")
        out["prealloc"] = "opened"
    except StoreError as exc:
        out["prealloc"] = f"StoreError errno={exc.errno}: {exc}"
    tier = Tier(LAYOUT, small_config(os.path.join(directory, "lazy"), preallocate=False),
                device="cpu")
    keys = [f"f{i}" for i in range(tier.store.num_slots)]
    ok = []
    for i in range(0, len(keys), 8):
        ok += put(tier, keys[i:i + 8])
    stored = [k for k, good in zip(keys, ok) if good]
    out["stored"], out["failed"] = len(stored), len(keys) - len(stored)
    res = check_pages(tier, stored)
    out["stored_hits"], out["stored_wrong"] = res["hits"], len(res["wrong"])
    out["sizes_ok"] = all(os.path.getsize(f.path) <= limit for f in tier.store.files)
    # still usable: evict half of what fits, put new pages, they land in the freed slots
    tier.evict(stored[: len(stored) // 2])
    again = put(tier, [f"g{i}" for i in range(len(stored) // 2)])
    out["after_evict_stored"] = sum(again)
    res = check_pages(tier, stored[len(stored) // 2:] + [f"g{i}" for i in range(len(stored) // 2)])
    out["final_hits"], out["final_wrong"] = res["hits"], len(res["wrong"])
    out["write_failed"] = tier.stats().get("write_failed", 0)
    tier.close()
    with open(result_path, "w") as f:
        json.dump(out, f)


def run_in_threads(worker, count: int, timeout: float = 120) -> list:
    """Run ``worker(t)`` for each ``t`` in ``range(count)``, one daemon thread each, and join
    them; a thread still running after ``timeout`` fails the test (a call that never finished).
    Returns what the workers returned (lists of problems) and any exception one raised."""
    errors: list = []

    def run(t: int) -> None:
        try:
            errors.extend(worker(t) or ())
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors.append(repr(exc))

    threads = [threading.Thread(target=run, args=(t,), daemon=True) for t in range(count)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)
    assert not any(th.is_alive() for th in threads), "a call never finished (deadlock)"
    return errors
