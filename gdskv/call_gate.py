"""The tier's call gate: data calls run together; a few maintenance steps run alone.

Data calls (put/get) enter shared and overlap each other. Follower catch-up, ``clear`` and
``close`` enter alone: they wait for the calls in flight, and no call starts meanwhile. A
waiting alone-entry holds back new shared ones, so a stream of overlapping calls cannot starve
it.
"""

from __future__ import annotations

import contextlib
import threading

from .yielding_lock import YieldingLock


class CallGate:
    def __init__(self) -> None:
        self._lock = YieldingLock()  # (data calls take it directly: no Condition frame)
        self._cond = threading.Condition(self._lock)
        self._active = 0
        self._alone = False
        self._waiting = 0

    def enter_shared(self) -> None:
        """Enter beside the other data calls (waiting while one is alone or waits to be);
        every call pairs it with :meth:`leave_shared`. (Plain methods, not a context manager:
        a data call of one page feels a generator's host time.)"""
        with self._lock:
            while self._alone or self._waiting:
                self._cond.wait()
            self._active += 1

    def leave_shared(self) -> None:
        with self._lock:
            self._active -= 1
            # only an alone-entry waits for the calls in flight to end (a notify is Python
            # steps on every data call's way out)
            if not self._active and self._waiting:
                self._cond.notify_all()

    @contextlib.contextmanager
    def shared(self):
        self.enter_shared()
        try:
            yield
        finally:
            self.leave_shared()

    def enter_alone(self, blocking: bool = True) -> bool:
        """Enter alone (waiting for the calls in flight); with ``blocking=False`` give up and
        return False instead of waiting."""
        with self._cond:
            if not blocking and (self._active or self._alone):
                return False
            self._waiting += 1
            try:
                while self._active or self._alone:
                    self._cond.wait()
            except BaseException:  # (interrupted) the data calls it held back may enter
                self._waiting -= 1
                self._cond.notify_all()
                raise
            self._waiting -= 1
            self._alone = True
            return True

    def leave_alone(self) -> None:
        with self._cond:
            self._alone = False
            self._cond.notify_all()

    @contextlib.contextmanager
    def alone(self):
        self.enter_alone()
        try:
            yield
        finally:
            self.leave_alone()
