"""The tier's host turn: one data call at a time runs its Python steps; waits run outside it.

Every torch call, CUDA call and native page-engine call releases the interpreter lock (GIL)
and takes it back. With several threads in data calls at once, each take-back may wait for
another thread's Python steps, up to a switch interval, and hands the lock over through the
operating system: a 1-page restore makes dozens of such calls, and on the development
machine four threads of 1-page host restores completed fewer calls together than one thread
alone (bench/RESULTS.md, "Calls in flight: the host turn"). A data call therefore holds the
tier's turn while it runs Python and lets it go only where it waits -- for I/O, a GPU sync, a
staging part, fdatasync and the journal, another call's write -- so the other threads wait on
one lock, once, instead of on the GIL at every step, and a call's I/O still overlaps the other
calls' steps.

Every wait on something another data call must do (free a staging part, commit a write) is
made outside the turn, so calls never wait for each other in a cycle.
"""

from __future__ import annotations

import threading


class HostTurn:
    """A plain lock, with :meth:`waiting` to let it go around a wait (not reentrant: a data
    call never starts another on the same tier)."""

    __slots__ = ("_lock", "_owner")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner = threading.local()

    def enter(self) -> None:
        self._lock.acquire()
        self._owner.held = True

    def leave(self) -> None:
        self._owner.held = False
        self._lock.release()

    def held(self) -> bool:
        """Whether this thread holds the turn."""
        return getattr(self._owner, "held", False)

    def waiting(self) -> "_Waiting":
        """``with turn.waiting(): <a wait>``: the turn let go for the wait (if this thread
        holds it: a call's helpers also run outside calls, e.g. at warm-up), taken back
        after, also when the wait raises."""
        return _Waiting(self)


class _Waiting:
    __slots__ = ("_turn", "_held")

    def __init__(self, turn: HostTurn) -> None:
        self._turn = turn
        self._held = False

    def __enter__(self) -> None:
        if self._turn.held():
            self._held = True
            self._turn.leave()

    def __exit__(self, *exc) -> None:
        if self._held:
            self._turn.enter()
