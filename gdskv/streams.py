"""Which CUDA stream a data call's GPU work goes on, and making it current cheaply.

A call runs on its caller's stream where it can, else on a stream of its own from the tier's
:class:`StreamPool`: never on a stream another call in flight uses, so calls from several
threads overlap on the GPU and each call's sync waits for its own work only.

``with torch.cuda.stream(s):`` resolves the current device through several Python layers on
every entry (``torch.cuda._utils._get_device_index(None)``, which reads environment variables
to decide what "available" means) and again for each stream it queries; on a 1-page restore
that was a few percent of the call's host time (cProfile on the H100,
``bench/results/h100-2026-11-23/call-overhead-3/``). :class:`OnStream` does what the context
manager does -- make ``stream`` current on its device, restore both devices' previous streams
after -- asking torch for the current device once, by index.
"""

from __future__ import annotations

import queue
import threading

import torch

_known = threading.local()


def current_stream(index: int) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(index)`` for a thread that has initialized CUDA, the stream
    object reused while the thread's current stream stays the same: torch builds a new
    ``Stream`` per query (a few µs each on a busy host, on every synchronous call)."""
    current = torch._C._cuda_getCurrentStream(index)  # (stream id, device, device type)
    known = getattr(_known, "stream", None)  # (that tuple, its Stream): one compare a call
    if known is None or known[0] != current:
        known = _known.stream = (current, torch.cuda.Stream(
            stream_id=current[0], device_index=current[1], device_type=current[2]))
    return known[1]


class OnStream:
    """``with OnStream(stream):`` is ``with torch.cuda.stream(stream):`` (same effect on the
    current streams and device), for one thread; make one per ``with``."""

    __slots__ = ("stream", "caller", "_restore")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream
        #: after ``__enter__``: the stream that was current on ``stream``'s device before
        self.caller: torch.cuda.Stream | None = None
        self._restore: tuple = ()

    def __enter__(self) -> torch.cuda.Stream:
        stream = self.stream
        here = torch.cuda.current_device()
        before = torch.cuda.current_stream(here)
        if stream.device_index != here:  # set_stream also makes the stream's device current
            self.caller = torch.cuda.current_stream(stream.device_index)
            self._restore = (self.caller, before)
        else:
            self.caller = before
            self._restore = (before,)
        torch.cuda.set_stream(stream)
        return stream

    def __exit__(self, *exc) -> None:
        for prev in self._restore:  # the previous device's stream last: its device is current
            torch.cuda.set_stream(prev)


class StreamPool:
    """The tier's streams for calls that cannot run on their caller's stream: one per call in
    flight, made the first time that many calls are (a new stream costs a few µs of host time
    and some driver memory; the pool keeps what concurrency asked for), reused after."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        self._made: list[torch.cuda.Stream] = []
        self._lock = threading.Lock()

    def take(self) -> torch.cuda.Stream:
        """A stream no other call holds."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            stream = torch.cuda.Stream(self.device)
            with self._lock:
                self._made.append(stream)
            return stream

    def give_back(self, stream: torch.cuda.Stream) -> None:
        """Free ``stream`` for the next call (work still queued on it runs first: a later
        call's work on it is in order after it)."""
        self._free.put(stream)

    def __len__(self) -> int:
        """Streams made so far (the most calls that needed one at once)."""
        return len(self._made)

    def __contains__(self, stream) -> bool:
        return any(stream == s for s in self._made)


class CallStream:
    """The stream one data call's GPU work goes on, chosen when the call first needs a stream
    (:meth:`enter`) and given back when the call ends (:meth:`leave`).

    A synchronous call (``record``) whose caller's current stream is on the tier's device (the
    current one) and is not the legacy default stream runs on that stream: its work is then in
    order with what the caller queued before it (the pool writes a restore must not overtake,
    the rows a spill gathers) with no switch, event or cross-stream wait (about 50 µs of a
    1-page spill's host time on an H200's host,
    ``bench/results/h200-2026-11-25/call-overhead-5/call4/timeline_new_2M.txt``). Otherwise the
    call takes a stream of its own from the tier's pool: :meth:`enter` makes it current and has
    it wait for what the caller had queued on its own stream; :meth:`leave` gives it back. The legacy default stream is never used
    for gdskv's work: work on it waits for every blocking stream's work, kvikio's compat-mode
    copies for other calls included.

    A restore enters once its first read is under way: the read itself needs no stream, so the
    choice and the switch (a few torch calls, tens of µs on a busy host) are host work the read
    hides instead of a delay before the read starts.

    Args:
        pool: the tier's streams.
        event: what the call's stream waits for.
        after: events recorded on other callers' streams (a combined call's other callers):
            the call's stream waits for them too.
        record: a synchronous call (the caller's thread is this one, blocked in the call, so
            nothing it queues is missed): run on the caller's stream where it can, else record
            ``event`` (the thread's one, reused) on the caller's stream at :meth:`enter`. False:
            an asynchronous call, in a worker thread: a pool stream, after ``event``, which the
            caller recorded when it submitted.
    """

    __slots__ = ("_pool", "_on", "_event", "_record", "_switched", "_after", "entered",
                 "stream")

    def __init__(self, pool: StreamPool, event: torch.cuda.Event, record: bool,
                 after: tuple = ()) -> None:
        self._pool = pool
        self._after = after
        self._on: OnStream | None = None  # made only to switch streams
        self._event = event
        self._record = record
        self._switched = False
        self.entered = False
        #: after :meth:`enter`: the stream the call's GPU work goes on
        self.stream: torch.cuda.Stream | None = None

    def enter(self) -> None:
        """Take the call's stream and make it current (a second call does nothing)."""
        if self.entered:
            return
        self.entered = True
        if self._record:
            index = self._pool.device.index
            if torch._C._cuda_getDevice() == index:  # (current_device() without its checks)
                caller = current_stream(index)
                if caller.cuda_stream != 0:  # 0: the legacy default stream
                    self.stream = caller
                    self._wait_after()
                    return
        on = self._on = OnStream(self._pool.take())
        on.__enter__()
        self._switched = True
        self.stream = on.stream
        if self._record:
            self._event.record(on.caller)
        on.stream.wait_event(self._event)
        self._wait_after()

    def _wait_after(self) -> None:
        """A combined call (:mod:`.call_combiner`): wait for what its other callers queued."""
        for event in self._after:
            if event is not self._event:
                self.stream.wait_event(event)

    def leave(self) -> None:
        """Restore the caller's current streams and give the pool's stream back, if one was
        taken."""
        if self._switched:
            self._switched = False
            self._on.__exit__()
            self._pool.give_back(self._on.stream)
        self.entered = False
