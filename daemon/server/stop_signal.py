"""The data server's stop request, seen by every thread that polls a socket."""
from __future__ import annotations

import os
import threading


class StopSignal:
    """An event plus a pipe: :attr:`fd` polls readable once :meth:`set` ran, now and later
    (level-triggered), so every poller wakes, however late it starts polling."""

    def __init__(self):
        self._event = threading.Event()
        self.fd, self._write_fd = os.pipe()

    def set(self) -> bool:
        """Ask every poller to stop; False if that was asked before."""
        if self._event.is_set():
            return False
        self._event.set()
        os.write(self._write_fd, b"x")
        return True

    def is_set(self) -> bool:
        return self._event.is_set()
