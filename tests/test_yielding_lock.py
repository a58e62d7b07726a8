"""gdskv.yielding_lock: a lock whose waiters give up the GIL instead of blocking.

It must be a lock first (mutual exclusion, non-blocking and timed acquires, a Condition on
it), and it must not form the convoy a ``threading.Lock`` forms under the GIL: two threads
taking it in turn never wait in the kernel for it while the section is only Python.
"""

from __future__ import annotations

import threading
import time

import pytest

from gdskv import yielding_lock
from gdskv.yielding_lock import YieldingLock


def test_it_excludes_threads():
    """8 threads add to a counter through a read-yield-write section: no update is lost."""
    lock, box = YieldingLock(), [0]

    def add():
        for _ in range(2000):
            with lock:
                value = box[0]
                time.sleep(0)  # give the GIL away inside the section: others must wait
                box[0] = value + 1

    threads = [threading.Thread(target=add) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert box[0] == 16000
    assert not lock.locked()


def test_acquire_without_blocking_and_with_a_timeout():
    lock = YieldingLock()
    assert lock.acquire(blocking=False)
    assert lock.locked() and "locked" in repr(lock)
    got = []
    t = threading.Thread(target=lambda: got.append((lock.acquire(blocking=False),
                                                    lock.acquire(timeout=0.05))))
    t0 = time.monotonic()
    t.start()
    t.join()
    assert got == [(False, False)]
    assert time.monotonic() - t0 >= 0.05
    lock.release()
    assert lock.acquire(timeout=0.05)
    lock.release()
    with pytest.raises(RuntimeError):
        lock.release()


def test_a_long_hold_puts_the_waiter_to_sleep(monkeypatch):
    """A waiter that yields ``_YIELDS`` times in vain blocks on the lock (no spinning through
    a long section) and gets it when the holder lets go."""
    yields = []
    monkeypatch.setattr(yielding_lock, "_YIELDS", 3)
    real_sleep = time.sleep
    monkeypatch.setattr(yielding_lock.time, "sleep",
                        lambda s: (yields.append(s), real_sleep(s)))
    lock = YieldingLock()
    lock.acquire()
    entered = threading.Event()

    def wait():
        with lock:
            entered.set()

    t = threading.Thread(target=wait)
    t.start()
    real_sleep(0.2)  # the waiter has yielded its 3 times and sleeps in the lock
    assert not entered.is_set()
    assert len(yields) == 3
    lock.release()
    assert entered.wait(5)
    t.join()


def test_a_condition_on_it_waits_and_notifies():
    cond = threading.Condition(YieldingLock())
    ready, seen = [], []

    def consumer():
        with cond:
            while not ready:
                cond.wait()
            seen.append(ready[0])

    t = threading.Thread(target=consumer)
    t.start()
    time.sleep(0.05)
    with cond:
        ready.append("go")
        cond.notify_all()
    t.join(5)
    assert seen == ["go"]
    with cond:
        assert not cond.wait(timeout=0.01)  # a timed wait returns False with the lock held


def _blocking_acquires(lock: YieldingLock) -> int:
    """Two threads take ``lock`` 5,000 times each, each giving up the GIL inside the section
    (as a holder the GIL leaves there does): how often a waiter slept in the lock itself."""
    blocked = []
    real_try = lock._try

    def counted(blocking=True, timeout=-1):
        if blocking:
            blocked.append(timeout)
        return real_try(blocking, timeout)

    lock._try = counted

    def work():
        for i in range(5000):
            with lock:
                _ = [i] * 4
                time.sleep(0)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(blocked)


def test_waiters_yield_instead_of_sleeping_in_the_lock(monkeypatch):
    """A waiter yields the GIL until the holder is done and takes the lock while it holds the
    GIL; it seldom sleeps in the lock. Against the same lock without the yields (a plain
    lock's waiting): on the development machine (2 cores) about 90 of 10,000 passes slept
    with the yields and about 9,000 without, each one a lock handed to a thread that must
    still win the GIL; on the GPU machine's 16 cores the plain lock slept only a few times,
    so there the bound is a handful."""
    monkeypatch.setattr(yielding_lock, "_YIELDS", 0)
    plain = _blocking_acquires(YieldingLock())
    monkeypatch.setattr(yielding_lock, "_YIELDS", 100)
    assert _blocking_acquires(YieldingLock()) <= max(20, plain // 10), plain
