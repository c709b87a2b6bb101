"""Waiting on what cannot be waited on: a NIXL transfer's state and its notifications have no
file descriptor, so they are polled. :class:`Backoff` spaces the polls: the first after
``first_s``, each next one twice as late, up to ``max_s``; :meth:`Backoff.reset` after progress
starts again from ``first_s``. A wait costs a few polls instead of a core."""
from __future__ import annotations

import time


class Backoff:
    """Pauses that double from ``first_s`` to ``max_s``."""

    def __init__(self, first_s: float, max_s: float):
        if not 0 < first_s <= max_s:
            raise ValueError(f"Backoff needs 0 < first_s <= max_s, got first_s={first_s} max_s={max_s}")
        self.first_s = first_s
        self.max_s = max_s
        self._next_s = first_s

    def next_s(self) -> float:
        """The next pause (doubling the one after it)."""
        pause = self._next_s
        self._next_s = min(pause * 2, self.max_s)
        return pause

    def reset(self) -> None:
        self._next_s = self.first_s

    def sleep(self, deadline: float | None = None) -> None:
        """Sleep the next pause, or until ``deadline`` (time.monotonic()) if that comes first."""
        pause = self.next_s()
        if deadline is not None:
            pause = min(pause, deadline - time.monotonic())
        if pause > 0:
            time.sleep(pause)
