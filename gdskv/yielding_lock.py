"""A lock for short critical sections that threads share under the interpreter lock (GIL).

A ``threading.Lock`` that one thread waits for hands the lock to the waiter while the waiter
does not hold the GIL: the owner releases it, the kernel wakes the waiter, and the waiter now
owns the lock but must still win the GIL. Meanwhile the thread that released it runs on, comes
to the same lock again and has to block in turn, giving up the GIL -- and from then on every
pass through the lock is a hand-over between the threads (a lock convoy). One such wait is
enough to start it; a tier's data calls take a few locks each (the directory's, the call
gate's), so small calls from several threads all ran at the pace of two thread switches per
lock. Measured on the development machine (2 cores), 1-page 64 KiB restores from /dev/shm:
one thread made 30,000 calls/s, two threads 14,000-17,000 together, with the threads' time in
futex waits on these locks (``perf``); on an H200 host 16 threads ran at a third of one
thread's pages/s, p50 1.3 ms (``bench/RESULTS.md``, "Many threads of small calls").

:class:`YieldingLock` is only ever taken by a thread that holds the GIL: a thread that finds it
held gives up the GIL and yields the CPU so that the owner can run to its release, and tries
again, ``yields`` times (100) before it blocks like a plain lock (a long-held lock, e.g. a
large eviction scan, is not spun on; ``blocking_waits`` counts those waits). So no thread owns
it without running, and the convoy does not form. For sections of Python steps only: a lock
held across I/O stays a ``threading.Lock`` (waiters sleep through the I/O). Works under
``threading.Condition``. Not reentrant.

It is C (``gdskv/native/_locks.c``, built with the page engine): ``with lock:`` takes the lock
and returns without running Python code in between, as ``threading.Lock`` does, so a signal
handler's exception (Ctrl-C in the main thread) cannot leave it held; a Python ``__enter__``
would run the handler right after its acquire. Where the extension did not load, the data path
uses plain ``threading.Lock``s (``IMPLEMENTATION``: "native" or "threading.Lock").
"""

from __future__ import annotations

import threading

try:
    from .native._locks import DEFAULT_YIELDS, YieldingLock
    IMPLEMENTATION = "native"
except ImportError:  # a source tree without pip install: a lock still, convoys and all
    DEFAULT_YIELDS = 0
    YieldingLock = threading.Lock
    IMPLEMENTATION = "threading.Lock"

__all__ = ["YieldingLock", "IMPLEMENTATION", "DEFAULT_YIELDS"]
