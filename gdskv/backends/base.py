"""The backend protocol: move bytes between one staging buffer and slab-file extents.

Backends only move bytes; they know nothing of keys, pages or the directory. The tier hands a
backend the store's open slab files once (:meth:`Backend.attach`), then calls :meth:`write` /
:meth:`read` with a 1-D uint8 buffer (host or GPU) and a list of :class:`Extent`. Both return a
``concurrent.futures.Future`` (or a :class:`WaitingFuture`, which has the part of its interface
the tier uses) resolving to an :class:`IOOutcome`; a failed extent is reported in
``IOOutcome.errors`` (so the tier can fail just the pages it covers), never raised.

An extent may carry its own host memory (``Extent.memory``, an I/O vector): its bytes are then
there, not in the call's buffer, which may be None when every extent carries memory. That is how
a CPU tier moves the caller's page regions in place (:mod:`gdskv.host_pages`); backends that
can do it say so with ``in_place_host_memory``.
"""

from __future__ import annotations

import abc
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class SlabFile:
    """One open slab file of the store."""
    index: int
    path: str
    fd: int          # opened O_RDWR (| O_DIRECT when ``direct``)
    direct: bool
    size: int


@dataclass(frozen=True)
class Extent:
    """``length`` bytes at ``buffer_offset`` in the buffer <-> ``file_offset`` in file ``file``.

    ``memory``: when not empty, the host buffers (1-D uint8 numpy arrays) that hold the extent's
    bytes, in file order (an I/O vector of total ``length``); ``buffer_offset`` then only places
    the extent in the call's frame, so failures still name buffer ranges (pages).

    ``moved``: when set, a backend that can (posix) calls it with each piece of this extent it
    moved whole, in the thread that moved it, right after (the tier hashes pages there, with no
    hand-off). A read's hint that has ``slot_bytes`` and ``page_bytes`` is called
    ``moved(piece, sums)`` instead, with the CRC-32C of each slot's first ``page_bytes`` from
    the call that read the piece (cut on slot boundaries). Only a hint: backends that cannot
    ignore it, and its caller must not rely on it."""
    file: int
    file_offset: int
    length: int
    buffer_offset: int
    memory: tuple = field(default=(), compare=False)
    moved: Callable[..., None] | None = field(default=None, compare=False)


class ShortIOError(OSError):
    """An I/O call moved fewer bytes than asked: the file gave no more (end of file, a
    truncated or replaced file; ``errno`` is None), or ``cause``, an error, stopped it part way
    (e.g. ENOSPC once the disk filled; ``errno`` is the cause's). The ``actual`` bytes before
    the stop moved whole either way."""

    def __init__(self, op: str, path: str, offset: int, expected: int, actual: int,
                 cause: OSError | None = None) -> None:
        msg = f"short {op} on {path} at offset {offset}: expected {expected} bytes, got {actual}"
        if cause is not None and cause.errno is not None:
            super().__init__(cause.errno, f"{msg}, then {cause.strerror or cause}")
        else:
            super().__init__(msg)
        self.expected, self.actual = expected, actual


@dataclass
class IOOutcome:
    """Result of one write/read call: bytes moved and the extents that failed (index -> error).

    ``failed`` says, where the backend knows it, which buffer byte ranges ``[start, end)`` of a
    failed extent were not moved (a short read ends part way: what came before it is whole);
    an extent in ``errors`` without ranges failed as a whole."""
    nbytes: int = 0
    errors: dict[int, BaseException] = field(default_factory=dict)
    failed: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors

    def fail(self, idx: int, exc: BaseException, piece: Extent) -> None:
        """Record ``exc`` for extent ``idx``: the bytes of ``piece`` that did not move."""
        self.errors.setdefault(idx, exc)
        moved = exc.actual if isinstance(exc, ShortIOError) else 0
        self.failed.setdefault(idx, []).append((piece.buffer_offset + moved,
                                                piece.buffer_offset + piece.length))


class WaitingFuture:
    """A future completed by the thread that first asks for its result, which runs ``wait``.

    For backends whose library already runs the I/O on its own threads and returns futures
    (kvikio): a waiter thread in between only adds two thread hand-offs to every call, which a
    1-page restore on fast media feels (bench/RESULTS.md, "Where the time goes"). It has the
    part of ``concurrent.futures.Future``'s interface the tier uses (``result``, ``exception``,
    ``done``, ``add_done_callback``) without its condition variable: an asker completes it
    itself, and a second asker waits on the lock the first holds. (A ``Future``'s condition
    cost a 1-page spill 17 µs of a cold host's time, made and notified once per call:
    ``bench/results/h200-2026-11-26/call-overhead-7/call2/put_lines2_after.txt``.)
    Done-callbacks run when the result is first asked for, before any asker returns, so a
    caller must ask; ``concurrent.futures.wait`` does not take it."""

    __slots__ = ("_wait", "_claim", "_state", "_finished", "_result", "_exception",
                 "_callbacks")

    def __init__(self, wait: Callable[[], object]) -> None:
        self._wait: Callable[[], object] | None = wait
        # held by the asker that runs ``wait`` and the callbacks (a callback that asks for the
        # result finds ``_finished`` set and does not take it)
        self._claim = threading.Lock()
        self._state = threading.Lock()  # ``_finished`` and ``_callbacks`` change together
        self._finished = False
        self._result: object = None
        self._exception: BaseException | None = None
        self._callbacks: list[Callable[["WaitingFuture"], object]] = []

    def _complete(self) -> None:
        if self._finished:  # (also what a done-callback asking for the result sees)
            return
        with self._claim:  # a second asker waits here for the first one's answer
            if self._finished:
                return
            wait, self._wait = self._wait, None  # drops the buffers it holds once done
            try:
                self._result = wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the asker as the outcome
                self._exception = exc
            with self._state:
                self._finished = True
                callbacks, self._callbacks = self._callbacks, []
            for fn in callbacks:
                _run_callback(fn, self)

    def result(self, timeout: float | None = None):
        """The outcome (waiting for it here); ``timeout`` is not supported and ignored."""
        self._complete()
        if self._exception is not None:
            raise self._exception
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._complete()
        return self._exception

    def done(self) -> bool:
        """Whether an asker has completed it (it is not done before someone asks)."""
        return self._finished

    def add_done_callback(self, fn: Callable[["WaitingFuture"], object]) -> None:
        """Call ``fn(self)`` once completed (now, if it is). Does not wait for an asker that
        is waiting for the I/O."""
        with self._state:
            if not self._finished:
                self._callbacks.append(fn)
                return
        _run_callback(fn, self)


class CompletedIO:
    """The outcome of an I/O a backend moved on the calling thread (:meth:`Backend.move_on_caller`):
    already done, with the part of a future's interface the tier uses. A done-callback runs
    at once."""

    __slots__ = ("_outcome",)

    def __init__(self, outcome: "IOOutcome") -> None:
        self._outcome = outcome

    def result(self, timeout: float | None = None) -> "IOOutcome":
        return self._outcome

    def exception(self, timeout: float | None = None) -> None:
        return None

    def done(self) -> bool:
        return True

    def add_done_callback(self, fn: Callable[["CompletedIO"], object]) -> None:
        _run_callback(fn, self)


class CompletionPoller:
    """Polls an I/O's completion on the thread that waits for it, for up to ``budget_us``
    (``io_poll_us``), before that thread sleeps on it. Every backend takes it: kvikio polls its
    futures in its wait, posix and NIXL hand out futures :meth:`wrap` made.

    A thread that sleeps through a sub-millisecond I/O wakes on a CPU that went idle meanwhile,
    and the host work of the rest of its call then runs cold: on freshly started VMs of the
    GPU machine a 1-page spill's host work before and after the write took up to twice as long
    as when the thread polled, on a VM that had run for minutes about as long
    (``bench/results/h200-2026-11-26/call-overhead-9/``). Between polls the GIL is
    released (``time.sleep(0)``), so the engine's other threads run. One thread polls at a
    time: a second waiter sleeps at once, so calls in flight on several threads do not take
    turns at the GIL only to poll. The budget caps the CPU a long I/O burns."""

    def __init__(self, budget_us: int) -> None:
        self.budget_us = budget_us
        self._budget = budget_us / 1e6
        self._turn = threading.Lock()

    @property
    def on(self) -> bool:
        return self._budget > 0

    def wrap(self, fut: Future) -> Future:
        """``fut`` itself when polling is off, else a :class:`WaitingFuture` whose asker polls
        ``fut`` before it waits for its result (for backends whose futures another thread of
        theirs completes: posix, NIXL; kvikio polls its own futures in its wait)."""
        if not self.on:
            return fut
        return WaitingFuture(functools.partial(self._polled_result, fut))

    def _polled_result(self, fut: Future):
        self.poll((fut,))
        return fut.result()

    def poll(self, futures) -> None:
        """Return once each of ``futures`` (objects with ``done()``) is done, the budget is
        spent, or at once when another thread is polling or the budget is 0."""
        if not self._budget or not self._turn.acquire(blocking=False):
            return
        try:
            clock, sleep = time.perf_counter, time.sleep
            deadline = clock() + self._budget
            for fut in futures:
                while not fut.done():
                    if clock() > deadline:
                        return
                    sleep(0)  # lets other threads take the GIL
        finally:
            self._turn.release()


def _run_callback(fn, fut) -> None:
    try:
        fn(fut)
    except Exception:  # noqa: BLE001 - as concurrent.futures does: logged, not raised
        logging.getLogger("gdskv.backends").exception("exception calling callback for %r", fut)


class Backend(abc.ABC):
    """A way to move bytes between a staging buffer and slab files."""

    #: short name: "posix", "kvikio", "nixl"
    name: str = "?"
    #: why :func:`gdskv.backends.create_backend` picked this backend ("" when built directly)
    selected_because: str = ""
    #: whether extents carrying their own host memory (``Extent.memory``) are supported; a
    #: backend without it is only ever given the call's buffer
    in_place_host_memory: bool = False
    #: the most bytes :meth:`read_checked_on_caller` and :meth:`write_on_caller` take (0: this
    #: backend has neither)
    caller_io_bytes: int = 0
    #: the native page engine's ``QuickReader`` over this backend's slots, or None: a small
    #: restore's pins, read and unpins in one call (:mod:`gdskv.quick_calls`). Looked up at
    #: each quick restore: None then sends it through the Python steps (tests that inject
    #: faults into the engine's Python-level functions set it so)
    native_reader = None

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        """Why this backend cannot do I/O on this host for ``device`` (None: it can). Asked
        before building it, so a backend that would open and then fail every call is refused
        at open, with the reason."""
        return None

    @property
    @abc.abstractmethod
    def gpu_direct(self) -> bool:
        """True only when bytes move between GPU memory and the file without a host copy."""

    @abc.abstractmethod
    def attach(self, files: Sequence[SlabFile]) -> None:
        """Take the store's open slab files (register them, open handles...)."""

    @abc.abstractmethod
    def write(self, buffer: torch.Tensor | None, extents: Sequence[Extent]) -> Future:
        """Write ``buffer`` ranges (or the extents' own memory) to file extents; returns
        Future[IOOutcome]."""

    @abc.abstractmethod
    def read(self, buffer: torch.Tensor | None, extents: Sequence[Extent]) -> Future:
        """Read file extents into ``buffer`` ranges (or the extents' own memory); returns
        Future[IOOutcome]."""

    def move_on_caller(self, op: str, buffer: torch.Tensor | None,
                       extents: Sequence[Extent]) -> CompletedIO | None:
        """Move a small call's bytes now, on the calling thread (``op``: "write" or "read"),
        where this backend's pool would run the whole call on one of its threads anyway; None
        (the default): it does not, and the caller uses :meth:`write` / :meth:`read`.

        A hand-off to a pool thread wakes that thread, and the caller wakes again when the I/O
        ends: on the GPU machine's VMs that cost a 1-page (2 MiB) kvikio write 80-135 µs and
        a read 105-115 µs at p50 (``bench/experiments/calling_thread_io.py``). The tier asks
        only for a call of one chunk, which has nothing else to overlap its I/O with.
        Failures are reported in the outcome, as :meth:`write` / :meth:`read` report them."""
        return None

    def read_checked_on_caller(self, places: Sequence[tuple[int, int]], memory: Sequence,
                               slot_bytes: int, page_bytes: int, want: np.ndarray
                               ) -> np.ndarray:
        """Read whole slots into host memory on the calling thread, comparing each page's
        CRC-32C with its stored one in the same pass (:mod:`gdskv.quick_calls`), at most
        :attr:`caller_io_bytes`. ``places``: (file index, byte offset) of each slot;
        ``memory``: two buffers a slot, where its first ``page_bytes`` (the payload) go, then
        the rest of it (a sequence of buffers, or the page engine's int64 ``(address, length)``
        rows of them: :mod:`gdskv.native`); ``want``: each payload's CRC-32C (uint64). Returns each page's status
        (uint8): 0 read whole and equal, 1 its checksum differs, 2 not read whole (an I/O
        error, the file's end). Only backends with ``caller_io_bytes`` implement it."""
        raise NotImplementedError(f"backend {self.name} moves no slots on the caller")

    def make_native_reader(self, directory, stripe_slots: int, slot_bytes: int,
                           page_bytes: int, algorithm: int, release_evicting) -> None:
        """Make :attr:`native_reader` where this backend has one (the default: it has none,
        and the quick restore's steps run in Python, :meth:`read_checked_on_caller` for the
        read)."""

    def run_split(self, fn: Callable[[int, int], object], count: int, nbytes: int) -> list:
        """``fn(start, end)`` over ``[0, count)`` (``nbytes`` in all), cut into parts for the
        threads of this backend's pool that are idle now and the calling thread, which runs
        the first part; waits for every part. Each part's result, or the exception it raised,
        in order. The default: one part, on the calling thread."""
        try:
            return [fn(0, count)]
        except Exception as exc:  # noqa: BLE001 - reported as the part's result
            return [exc]

    def write_on_caller(self, places: Sequence[tuple[int, int]], memory: Sequence,
                        slot_bytes: int, page_bytes: int) -> bool:
        """Write whole slots from host memory on the calling thread (:mod:`gdskv.quick_calls`),
        at most :attr:`caller_io_bytes`; ``places`` and ``memory`` as
        :meth:`read_checked_on_caller` takes them. Whether every byte was written (nothing
        is made durable here). Only backends with ``caller_io_bytes`` implement it."""
        raise NotImplementedError(f"backend {self.name} moves no slots on the caller")

    def start(self, op: str, buffer: torch.Tensor | None, extents: Sequence[Extent],
              on_caller: bool = False):
        """Start ``op`` ("write" or "read"); its future. ``on_caller``: moved on this thread
        where :meth:`move_on_caller` can (the future is then done on return), else through
        :meth:`write` / :meth:`read`."""
        if on_caller:
            done = self.move_on_caller(op, buffer, extents)
            if done is not None:
                return done
        return self.write(buffer, extents) if op == "write" else self.read(buffer, extents)

    def describe(self) -> dict:
        """What runs and why, for stats and logs: name, gpu_direct, ``selected`` (why it was
        picked); implementations add their own (fallbacks, settings...)."""
        return {"name": self.name, "gpu_direct": self.gpu_direct,
                "selected": self.selected_because}

    def direct_io(self) -> tuple[bool, str] | None:
        """Whether this backend's file I/O bypasses the page cache (O_DIRECT), and why. None
        (the default): it does its I/O on the store's file descriptors, so the store's answer
        (``SlabStore.direct``) is what happens."""
        return None

    def close(self) -> None:
        """Release handles and registrations. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def split_extents(extents: Sequence[Extent], max_bytes: int) -> list[tuple[int, Extent]]:
    """Cut extents into pieces of at most ``max_bytes`` (kept 4 KiB aligned), tagged with the
    index of the extent they came from, so one large extent can run on several threads."""
    pieces = []
    for i, e in enumerate(extents):
        if e.length <= max_bytes:
            pieces.append((i, e))
            continue
        memory = _MemoryCursor(e.memory) if e.memory else None
        done = 0
        while done < e.length:
            n = min(max_bytes, e.length - done)
            pieces.append((i, Extent(e.file, e.file_offset + done, n, e.buffer_offset + done,
                                     memory.take(n) if memory else (), e.moved)))
            done += n
    return pieces


class _MemoryCursor:
    """Consecutive byte ranges of one I/O vector, taken in order: one pass over its buffers
    however many pieces an extent is cut into (slicing from the start each time is quadratic
    in the buffers of an extent of many small pages)."""

    def __init__(self, memory: Sequence) -> None:
        self._memory, self._k, self._at = memory, 0, 0

    def take(self, n: int) -> tuple:
        out = []
        while n:
            m = self._memory[self._k]
            take = min(len(m) - self._at, n)
            out.append(m if take == len(m) else m[self._at:self._at + take])
            n -= take
            self._at += take
            if self._at == len(m):
                self._k, self._at = self._k + 1, 0
        return tuple(out)


def slice_memory(memory: Sequence, start: int, n: int) -> tuple:
    """Bytes ``[start, start + n)`` of an I/O vector, as an I/O vector (views, no copy)."""
    out: list = []
    if n <= 0:
        return ()
    for m in memory:
        if start >= len(m):
            start -= len(m)
            continue
        take = min(len(m) - start, n)
        out.append(m[start:start + take])
        n -= take
        start = 0
        if not n:
            break
    return tuple(out)


#: smallest piece :func:`io_pieces` cuts an extent into by default (below this, per-call
#: costs dominate); backends whose pieces are host copies pass a larger one
MIN_PIECE_BYTES = 1 << 20


def io_pieces(extents: Sequence[Extent], threads: int, max_bytes: int,
              min_bytes: int = MIN_PIECE_BYTES) -> list[tuple[int, Extent]]:
    """Cut one call's extents into pieces that keep all ``threads`` busy.

    Pieces are at most ``max_bytes`` (``io_chunk_size``), and smaller when the call is small:
    a 64 MiB call in 16 MiB pieces would leave 12 of 16 threads idle. Measured on an H100
    VM, 64 MiB calls through kvikio on /dev/shm: 11 GB/s read with 16 MiB pieces, 23 GB/s
    with 4 MiB. Pieces never go below ``min_bytes`` (a short call then uses fewer threads:
    each piece is a thread hand-off) and stay 4 KiB aligned.
    """
    total = sum(e.length for e in extents)
    share = -(-total // max(1, threads))
    piece = min(max_bytes, max(min_bytes, -(-share // 4096) * 4096))
    return split_extents(extents, piece)


def combine(futures: Sequence[tuple[int, Extent, Future]], *,
            after: Callable[[], None] | None = None) -> Future:
    """One Future[IOOutcome] over per-piece futures that each resolve to a byte count.

    ``futures``: (index of the extent, the piece, its future); an exception in a piece is
    recorded against that extent, with the piece's bytes that did not move. ``after`` runs once
    when all pieces are done (before the outcome future is resolved), e.g. to copy a bounce
    buffer back to the GPU; it runs after failed pieces too, so the pieces that completed reach
    the buffer.
    """
    result: Future = Future()
    outcome = IOOutcome()
    lock = threading.Lock()
    remaining = [len(futures)]
    # The closures below hold the pieces, never their futures: a piece future keeps its
    # done-callback, so a reference back to it would make a cycle per call that only the
    # garbage collector frees (its pauses showed in small calls' tail latency).
    pieces = [(idx, piece) for idx, piece, _ in futures]

    def finish() -> None:
        if after is not None:
            try:
                after()
            except BaseException as exc:  # noqa: BLE001 - reported as a failure of every extent
                for idx, piece in pieces:
                    outcome.fail(idx, exc, piece)
        result.set_result(outcome)

    def done(idx: int, piece: Extent, fut: Future) -> None:
        exc = fut.exception()
        with lock:
            if exc is not None:
                outcome.fail(idx, exc, piece)
            else:
                outcome.nbytes += fut.result()
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            finish()

    if not futures:
        finish()
    for idx, piece, fut in futures:
        fut.add_done_callback(lambda f, idx=idx, piece=piece: done(idx, piece, f))
    return result
