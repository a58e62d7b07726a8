"""CompletionPoller: the waiting thread polls an I/O's completion (io_poll_us) before it sleeps."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from reliability_helpers import (LAYOUT, page_content, put, read_back, run_in_threads,
                                small_config)

from gdskv.backends.base import CompletionPoller
from gdskv.config import ConfigError, TierConfig
from gdskv.tier import Tier


class Flips:
    """A future that says done after ``after`` asks (or never, with None)."""

    def __init__(self, after: int | None) -> None:
        self.after, self.asks = after, 0

    def done(self) -> bool:
        self.asks += 1
        return self.after is not None and self.asks > self.after


def test_off_asks_nothing():
    fut = Flips(3)
    CompletionPoller(0).poll([fut])
    assert fut.asks == 0


def test_polls_each_future_until_done():
    futs = [Flips(5), Flips(0), Flips(2)]
    CompletionPoller(10_000_000).poll(futs)  # a budget it never reaches
    assert [f.asks for f in futs] == [6, 1, 3]  # each asked until it said done, then left


def test_gives_up_when_the_budget_is_spent():
    fut = Flips(None)
    t0 = time.perf_counter()
    CompletionPoller(2000).poll([fut])
    spent = time.perf_counter() - t0
    assert fut.asks > 1 and spent >= 0.002
    assert spent < 1.0  # returned (to sleep on the I/O) rather than polling on


def test_one_thread_polls_at_a_time():
    poller = CompletionPoller(10_000_000)
    inside, release = threading.Event(), threading.Event()

    class Held:
        def done(self) -> bool:
            inside.set()
            return release.is_set()

    first = threading.Thread(target=poller.poll, args=([Held()],))
    first.start()
    assert inside.wait(10)
    second = Flips(None)  # would poll for the whole budget if it took a turn
    poller.poll([second])
    assert second.asks == 0  # the second waiter went to sleep on its I/O at once
    release.set()
    first.join(10)
    assert not first.is_alive()
    after = Flips(1)
    poller.poll([after])  # the turn is free again
    assert after.asks == 2


def test_config_takes_it_from_the_environment_and_refuses_negatives():
    assert TierConfig().io_poll_us == 0
    assert TierConfig.from_env({"GDSKV_IO_POLL_US": "1500"}).io_poll_us == 1500
    with pytest.raises(ConfigError, match="io_poll_us"):
        TierConfig(io_poll_us=-1)


def test_wrap_hands_out_the_future_itself_when_off_and_polls_it_when_on():
    from concurrent.futures import Future

    fut: Future = Future()
    assert CompletionPoller(0).wrap(fut) is fut
    asks = []

    class Watched(Future):
        def done(self):
            asks.append(1)
            return super().done()

    inner = Watched()
    threading.Timer(0.01, inner.set_result, args=("outcome",)).start()
    outer = CompletionPoller(10_000_000).wrap(inner)
    assert outer is not inner and outer.result() == "outcome"
    assert len(asks) > 1  # polled until the I/O thread completed it, then asked for its result


def _nixl_available() -> bool:
    try:
        from gdskv.backends.nixl import load_nixl_api
        load_nixl_api()
        return True
    except Exception:  # noqa: BLE001 - not installed or not loadable here
        return False


@pytest.mark.parametrize("backend", [
    "posix",
    pytest.param("nixl", marks=pytest.mark.skipif(not _nixl_available(),
                                                  reason="NIXL (nixl-cu13) is not installed"))])
def test_a_polling_cpu_tier_round_trips_from_four_threads(tmp_path, backend):
    """io_poll_us on the backends whose own threads complete their futures (posix, NIXL):
    calls from four threads (one polls at a time, the others sleep) store and read back every
    page byte-exact, and the backend says what it polls."""
    cfg = small_config(tmp_path, backend=backend, io_poll_us=3000, pipeline_depth=4)
    with Tier(LAYOUT, cfg) as tier:
        assert tier.backend.describe()["io_poll_us"] == 3000

        def worker(t: int) -> list:
            problems = []
            for r in range(3):
                keys = [f"t{t}r{r}p{i}" for i in range(3)]
                if put(tier, keys) != [True] * 3:
                    problems.append(f"put {t}/{r}")
                ok, pages = read_back(tier, keys)
                if ok != [True] * 3:
                    problems.append(f"get {t}/{r}")
                problems += [f"bytes of {k}" for k, page in zip(keys, pages)
                             if not torch.equal(page, page_content(k))]
            return problems

        errors = run_in_threads(worker, 4)
        assert not errors, errors
