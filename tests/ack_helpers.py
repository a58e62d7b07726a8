"""Acknowledgement accounting for the multi-process store tests: a writer child that logs every
True answer of a put (and every page it evicts, before evicting it) to a file, fsynced, so the
parent can kill it at any moment and check, after a restart, that every acknowledged page reads
back bit-exact. Children run under ``reliability_helpers.forkserver()``."""

from __future__ import annotations

import os
import random
import time

from reliability_helpers import LAYOUT, put, ready_keys, small_config


def _log(fd: int, lines: list[str]) -> None:
    if lines:
        os.write(fd, "".join(line + "\n" for line in lines).encode())
        os.fsync(fd)


def ack_writer(directory: str, log_path: str, prefix: str, overrides: dict,
               rounds: int | None = None, evict_above: float | None = 0.7,
               done_path: str | None = None) -> None:
    """Open a writer tier and put batches of new keys ``<prefix><n>`` (``rounds`` batches, or
    until killed). Log lines: ``O`` opened (or ``X <error>`` and return), ``P key`` after a put
    answered True, ``E key`` before an explicit eviction (with ``evict_above``, occupancy is kept
    under that fraction so LRU never drops an acknowledged page unseen; None: the store fills
    and LRU evicts the oldest pages), ``S <state>`` when ``stats()["state"]`` changes. Touches
    ``done_path`` after the last round, then waits to be killed."""
    from gdskv.tier import Tier
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        tier = Tier(LAYOUT, small_config(directory, **overrides), device="cpu")
    except Exception as exc:  # reported to the parent, which asserts on it
        _log(fd, [f"X {type(exc).__name__}: {exc}".replace("\n", " ")])
        return
    _log(fd, ["O opened"])
    rng = random.Random(prefix)
    cap, state, n, r = tier.store.num_slots, "ok", 0, 0
    while rounds is None or r < rounds:
        r += 1
        if evict_above is not None and len(tier.directory) > evict_above * cap:
            victims = rng.sample(ready_keys(tier), k=cap // 4)
            _log(fd, [f"E {k}" for k in victims])
            tier.evict(victims)
        keys = [f"{prefix}{n + i}" for i in range(rng.randint(1, 6))]
        n += len(keys)
        ok = put(tier, keys)
        _log(fd, [f"P {k}" for k, good in zip(keys, ok) if good])
        now = tier.stats()["state"]
        if now != state:
            state = now
            _log(fd, [f"S {state}"])
    if done_path is not None:
        open(done_path, "w").close()
    time.sleep(300)


def read_log(log_path: str) -> dict:
    """What an :func:`ack_writer` logged: ``acked`` (keys whose last event is a True answer, in
    the order of those answers), ``states``, ``opened`` and ``error``."""
    last: dict[str, str] = {}
    order: list[str] = []
    out: dict = {"states": [], "opened": False, "error": None}
    if os.path.exists(log_path):
        with open(log_path, encoding="utf-8") as f:
            for line in f:
                if not line.endswith("\n"):
                    break  # a line the kill cut short
                kind, _, rest = line.rstrip("\n").partition(" ")
                if kind in ("P", "E"):
                    last[rest] = kind
                    if kind == "P":
                        order.append(rest)
                elif kind == "S":
                    out["states"].append(rest)
                elif kind == "O":
                    out["opened"] = True
                elif kind == "X":
                    out["error"] = rest
    out["acked"] = [k for k in dict.fromkeys(order) if last[k] == "P"]
    return out


def wait_for_acks(log_path: str, child, count: int, seconds: float = 120) -> None:
    """Wait until the child has acknowledged ``count`` pages (it must stay alive meanwhile)."""
    deadline = time.monotonic() + seconds
    while len(read_log(log_path)["acked"]) < count:
        assert child.is_alive(), f"writer exited early ({child.exitcode}): {read_log(log_path)}"
        assert time.monotonic() < deadline, "the writer acknowledged too few pages in time"
        time.sleep(0.02)
