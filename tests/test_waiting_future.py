"""WaitingFuture: the backend future that the asking thread completes (no waiter thread)."""

from __future__ import annotations

import threading

import pytest

from gdskv.backends.base import WaitingFuture


def test_the_asking_thread_runs_the_wait_once_and_callbacks_follow():
    ran_in, seen = [], []
    fut = WaitingFuture(lambda: ran_in.append(threading.current_thread().name) or 42)
    fut.add_done_callback(lambda f: seen.append(f.result()))
    assert not fut.done() and ran_in == [] and seen == []  # nothing runs until asked
    assert fut.result() == 42
    assert fut.result() == 42 and fut.exception() is None
    assert ran_in == [threading.current_thread().name]  # once, in this thread
    assert seen == [42] and fut.done()


def test_an_exception_of_the_wait_is_the_outcome():
    def boom():
        raise OSError(5, "EIO")

    fut = WaitingFuture(boom)
    assert isinstance(fut.exception(), OSError)
    with pytest.raises(OSError):
        fut.result()


def test_concurrent_askers_share_one_wait():
    release, calls = threading.Event(), []

    def wait():
        calls.append(1)
        release.wait(5)
        return "done"

    fut = WaitingFuture(wait)
    out = []
    threads = [threading.Thread(target=lambda: out.append(fut.result())) for _ in range(4)]
    for t in threads:
        t.start()
    release.set()
    for t in threads:
        t.join(5)
    assert out == ["done"] * 4 and calls == [1]


def test_a_callback_added_once_done_runs_at_once_and_a_failing_one_is_logged(caplog):
    fut = WaitingFuture(lambda: 7)
    assert fut.result() == 7
    seen = []
    fut.add_done_callback(lambda f: seen.append(f.result()))
    assert seen == [7]  # already done: called in place

    def fails(_f):
        raise RuntimeError("callback broke")

    other = WaitingFuture(lambda: 8)
    other.add_done_callback(fails)
    other.add_done_callback(lambda f: f.add_done_callback(lambda g: seen.append(g.result())))
    assert other.result() == 8  # the failing callback does not reach the asker
    assert seen == [7, 8]  # a callback adding a callback (re-entrant) runs it too
    assert "callback broke" in caplog.text


def test_adding_a_callback_does_not_wait_for_an_asker_in_its_io():
    entered, release, seen = threading.Event(), threading.Event(), []

    def io():
        entered.set()
        return release.wait(5) and "done"

    fut = WaitingFuture(io)
    asker = threading.Thread(target=fut.result)
    asker.start()
    assert entered.wait(5)  # the asker holds the future, waiting for its I/O
    added = threading.Thread(target=lambda: fut.add_done_callback(lambda f: seen.append(1)))
    added.start()
    added.join(2)
    assert not added.is_alive()  # returned while the asker still waits for the I/O
    release.set()
    asker.join(5)
    assert fut.result() == "done" and seen == [1]
