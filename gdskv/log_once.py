"""One log line per kind of failure.

Engine-facing paths turn a failure into a miss or a failed task and go on; the same failure
then recurs on every call, and a line per call would bury the first one. Each kind gets a tag:
its first line is logged, later ones are dropped (or logged at a lower level).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable


class LogOnce:
    """A logger that logs a tag's message the first time the tag is seen.

    Args:
        logger: where the lines go.
        level: the level of a first line (a call may give its own).
        prefix: text put before every message (e.g. ``"gdskv: "``).
        repeat_level: the level of a tag's later lines; None drops them.
    """

    def __init__(self, logger: logging.Logger, level: int = logging.WARNING, *,
                 prefix: str = "", repeat_level: int | None = None) -> None:
        self._logger = logger
        self._level = level
        self._prefix = prefix
        self._repeat_level = repeat_level
        self._seen: set[Hashable] = set()
        self._lock = threading.Lock()

    def __call__(self, tag: Hashable, msg: str, *args, level: int | None = None,
                 exc_info=None) -> bool:
        """Log ``msg % args`` if ``tag`` is new; returns whether it was."""
        with self._lock:
            first = tag not in self._seen
            self._seen.add(tag)
        if first:
            self._logger.log(self._level if level is None else level, self._prefix + msg, *args,
                             exc_info=exc_info)
        elif self._repeat_level is not None:
            self._logger.log(self._repeat_level, self._prefix + msg, *args, exc_info=exc_info)
        return first
