"""A lock for short critical sections that threads share under the interpreter lock (GIL).

A ``threading.Lock`` that one thread waits for hands the lock to the waiter while the waiter
does not hold the GIL: the owner releases it, the kernel wakes the waiter, and the waiter now
owns the lock but must still win the GIL. Meanwhile the thread that released it runs on, comes
to the same lock again and has to block in turn, giving up the GIL -- and from then on every
pass through the lock is a hand-over between the threads (a lock convoy). One such wait is
enough to start it; a tier's data calls take a few locks each (the directory's, the call
gate's), so small calls from several threads all ran at the pace of two thread switches per
lock. Measured on the development machine (2 cores), 1-page 64 KiB restores from /dev/shm:
one thread made 36,000 calls/s, two threads 17,000 together, with the threads' time in
futex waits on these locks.

:class:`YieldingLock` is only ever taken by a thread that holds the GIL: a thread that finds it
held gives up the GIL (``time.sleep(0)``) so that the owner can run to its release, and tries
again, a bounded number of times before it blocks like a plain lock (a long-held lock, e.g. a
large eviction scan, is not spun on). So no thread owns it without running, and the convoy
does not form. For sections of Python steps only; a lock held across I/O stays a
``threading.Lock`` (waiters sleep through the I/O). Works under ``threading.Condition``.
"""

from __future__ import annotations

import threading
import time

#: how many times a waiter gives up the GIL and tries again before it blocks
_YIELDS = 100


class YieldingLock:
    """A non-reentrant lock, ``threading.Lock``'s interface, whose waiters yield the GIL
    instead of blocking (see the module)."""

    __slots__ = ("_lock", "_try", "release", "locked")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._try = self._lock.acquire  # (the bound method, looked up once)
        self.release = self._lock.release
        self.locked = self._lock.locked

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._try(False):
            return True
        if not blocking:
            return False
        return self._wait(timeout)

    def _wait(self, timeout: float = -1) -> bool:
        deadline = None if timeout < 0 else time.monotonic() + timeout
        for _ in range(_YIELDS):
            time.sleep(0)  # the GIL goes to the owner, which may be waiting for it
            if self._try(False):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
        if deadline is None:
            return self._try(True)
        return self._try(True, max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> bool:
        return self._try(False) or self._wait()

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<YieldingLock {'locked' if self.locked() else 'unlocked'}>"
