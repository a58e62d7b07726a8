"""CompletionPoller: the waiting thread polls an I/O's completion (io_poll_us) before it sleeps."""

from __future__ import annotations

import threading
import time

import pytest

from gdskv.backends.base import CompletionPoller
from gdskv.config import ConfigError, TierConfig


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
