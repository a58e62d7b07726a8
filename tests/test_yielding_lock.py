"""gdskv.yielding_lock: a lock whose waiters give up the GIL instead of sleeping in it.

It must be a lock first (mutual exclusion, non-blocking and timed acquires, a Condition on
it), it must not form the convoy a ``threading.Lock`` forms under the GIL (a waiter takes it
while holding the GIL, yielding instead of sleeping in the lock), and a signal handler's
exception must never leave it held. The C type is what the data path uses where the native
extension is built; without it the data path falls back to ``threading.Lock``.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from gdskv import yielding_lock

needs_native = pytest.mark.skipif(
    yielding_lock.IMPLEMENTATION != "native",
    reason="the native extension did not load (tests/test_native.py says why): the data path "
    "uses threading.Lock")
YieldingLock = yielding_lock.YieldingLock


def test_the_data_path_has_a_lock(tmp_path):
    """The install that builds the page engine builds the lock (setup.py): where one loaded,
    so did the other; a tier's stats say which lock its data path takes."""
    from gdskv import native
    from gdskv.config import TierConfig
    from gdskv.layout import BytePageLayout
    from gdskv.tier import Tier
    if native.NATIVE is not None:
        assert yielding_lock.IMPLEMENTATION == "native"
    with Tier(BytePageLayout(page_bytes=4096, kind="t"),
              TierConfig(directories=(str(tmp_path),), capacity="1MiB", backend="posix"),
              device="cpu") as tier:
        assert tier.stats()["data_path_locks"] == yielding_lock.IMPLEMENTATION
        if yielding_lock.IMPLEMENTATION == "native":
            assert isinstance(tier.directory._lock, YieldingLock)
    lock = YieldingLock()
    with lock:
        assert lock.locked()
    assert not lock.locked()
    if yielding_lock.IMPLEMENTATION == "native":
        assert lock.yields == yielding_lock.DEFAULT_YIELDS == 100


@needs_native
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


@needs_native
def test_acquire_without_blocking_and_with_a_timeout():
    lock = YieldingLock()
    assert lock.acquire(blocking=False)
    assert lock.locked() and "locked" in repr(lock)
    got = []
    t = threading.Thread(target=lambda: got.append((lock.acquire(blocking=False),
                                                    lock.acquire(timeout=0.05),
                                                    lock.acquire(timeout=0))))
    t0 = time.monotonic()
    t.start()
    t.join()
    assert got == [(False, False, False)]
    assert time.monotonic() - t0 >= 0.05
    lock.release()
    assert lock.acquire(timeout=0.05)
    lock.release()
    with pytest.raises(RuntimeError):
        lock.release()
    with pytest.raises(ValueError):
        lock.acquire(False, 1)
    with pytest.raises(ValueError):
        lock.acquire(timeout=-2)
    with pytest.raises(ValueError):
        YieldingLock(yields=-1)


@needs_native
def test_a_long_hold_puts_the_waiter_to_sleep():
    """A waiter that yields in vain blocks on the lock (no spinning through a long section)
    and gets it when the holder lets go; another thread may release it, as a Lock."""
    lock = YieldingLock(yields=3)
    lock.acquire()
    entered = threading.Event()

    def wait():
        with lock:
            entered.set()

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.2)  # the waiter has yielded its 3 times and sleeps in the lock
    assert not entered.is_set()
    assert lock.blocking_waits == 1
    threading.Thread(target=lock.release).start()
    assert entered.wait(5)
    t.join()
    assert not lock.locked()


@needs_native
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


def _blocking_waits(lock) -> int:
    """Two threads take ``lock`` 5,000 times each, each giving up the GIL inside the section
    (as a holder the GIL leaves there does): how often a waiter slept in the lock itself."""
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
    return lock.blocking_waits


@needs_native
def test_waiters_yield_instead_of_sleeping_in_the_lock():
    """A waiter yields the GIL until the holder is done and takes the lock while it holds the
    GIL; it seldom sleeps in the lock. Against the same lock without the yields (a plain
    lock's waiting, ``yields=0``): on the development machine (2 cores) about 90 of 10,000
    passes slept with the yields and about 9,000 without, each one a lock handed to a thread
    that must still win the GIL; on the GPU machine's 16 cores the plain lock slept only a few
    times, so there the bound is a handful."""
    plain = _blocking_waits(YieldingLock(yields=0))
    assert _blocking_waits(YieldingLock()) <= max(20, plain // 10), plain


@needs_native
def test_a_signal_never_leaves_it_held():
    """Ctrl-C-like exceptions from a signal handler, raised in the main thread while it takes
    and gives back the lock against a contending thread: whenever one escapes a ``with``
    block, the main thread does not hold the lock (another thread takes it at once). A
    Python ``__enter__`` leaked it: the handler ran right after its acquire."""
    lock, stop, armed = YieldingLock(), threading.Event(), [False]
    escaped = 0

    class Alarm(Exception):
        pass

    def other():
        while not stop.is_set():
            if lock.acquire(timeout=0.5):  # (timed: a leaked lock fails the test, no hang)
                time.sleep(0)
                lock.release()

    def alarm(signum, frame):
        if armed[0]:  # one exception per arming: none while the test checks the lock
            armed[0] = False
            raise Alarm

    previous = signal.signal(signal.SIGALRM, alarm)
    t = threading.Thread(target=other)
    t.start()
    signal.setitimer(signal.ITIMER_REAL, 0.0005, 0.0005)
    try:
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and escaped < 200:
            armed[0] = True
            try:
                while True:
                    with lock:
                        pass
            except Alarm:
                escaped += 1
            taken = []
            probe = threading.Thread(target=lambda: taken.append(lock.acquire(timeout=2)))
            probe.start()
            probe.join(5)
            assert taken == [True], "the main thread left the lock held"
            lock.release()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        stop.set()
        t.join()
    assert escaped >= 10
