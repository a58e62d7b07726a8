"""Making a tier's CUDA stream current for one call, cheaply.

``with torch.cuda.stream(s):`` resolves the current device through several Python layers on
every entry (``torch.cuda._utils._get_device_index(None)``, which reads environment variables
to decide what "available" means) and again for each stream it queries; on a 1-page restore
that was a few percent of the call's host time (cProfile on the H100,
``bench/results/h100-2026-11-23/call-overhead-3/``). :class:`OnStream` does what the context
manager does -- make ``stream`` current on its device, restore both devices' previous streams
after -- asking torch for the current device once, by index.
"""

from __future__ import annotations

import torch


class OnStream:
    """``with OnStream(stream):`` is ``with torch.cuda.stream(stream):`` (same effect on the
    current streams and device), for one thread; make one per ``with``."""

    __slots__ = ("stream", "_restore")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream
        self._restore: tuple = ()

    def __enter__(self) -> torch.cuda.Stream:
        stream = self.stream
        here = torch.cuda.current_device()
        before = torch.cuda.current_stream(here)
        if stream.device_index != here:  # set_stream also makes the stream's device current
            self._restore = (torch.cuda.current_stream(stream.device_index), before)
        else:
            self._restore = (before,)
        torch.cuda.set_stream(stream)
        return stream

    def __exit__(self, *exc) -> None:
        for prev in self._restore:  # the previous device's stream last: its device is current
            torch.cuda.set_stream(prev)
