"""Write-behind saves: the engine's step copies its blocks out and goes on; encoding and
PUT run on a background worker behind a queue bounded in bytes.

A save that would take the queue past its limit is dropped and counted (the blocks are
a later miss, never a stalled step). :meth:`SaveQueue.close` drains what was accepted.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)

SAVE_QUEUE_BYTES_MAX = 1 << 30  # block bytes accepted but not yet stored: host memory held for them


@dataclass(frozen=True)
class SaveQueueStatistics:
    saves_queued: int  # accepted, not finished
    bytes_queued: int
    saves_done: int
    saves_failed: int  # the PUT raised; its blocks are a later miss
    saves_dropped: int  # refused: the queue was full
    blocks_dropped: int


class SaveQueue:
    """One background worker running accepted saves in order; see the module doc."""

    def __init__(self, bytes_max: int = SAVE_QUEUE_BYTES_MAX, name: str = "kvtier-save") -> None:
        if bytes_max <= 0:
            raise ValueError(f"save queue bytes_max must be positive, got {bytes_max}")
        self.bytes_max = bytes_max
        self._lock = threading.Lock()
        self._bytes = self._queued = self._done = self._failed = self._dropped = self._blocks_dropped = 0
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._closed = False

    def submit(self, nbytes: int, blocks: int, save: Callable[[], int],
               on_drop: Callable[[], None] | None = None) -> Future:
        """Run ``save`` (returns the blocks stored) in the background if ``nbytes`` fit; else
        drop it: ``on_drop`` runs at once (to give its buffers back) and the future holds 0.
        A closed queue raises RuntimeError, after ``on_drop``."""
        with self._lock:
            closed = self._closed
            # one save is always let in when none is queued, or a save larger than the
            # limit could never be stored
            fits = not closed and (self._bytes + nbytes <= self.bytes_max or self._queued == 0)
            if fits:
                self._bytes += nbytes
                self._queued += 1
                # under the lock: close() cannot shut the worker down between the count and the submit
                return self._worker.submit(self._run, nbytes, save)
            if not closed:
                self._dropped += 1
                self._blocks_dropped += blocks
        if on_drop is not None:
            on_drop()
        if closed:
            raise RuntimeError("save queue is closed")
        dropped: Future = Future()
        dropped.set_result(0)
        return dropped

    def then(self, task: Callable[[], object]) -> Future:
        """Run ``task`` on the worker after every save accepted so far (it is not a save: not
        counted). A closed queue raises RuntimeError."""
        with self._lock:
            if self._closed:
                raise RuntimeError("save queue is closed")
            return self._worker.submit(task)

    def _run(self, nbytes: int, save: Callable[[], int]) -> int:
        ok = False
        try:
            stored = save()
            ok = True
            return stored
        except Exception:
            log.exception("event=save_failed bytes=%d", nbytes)
            raise
        finally:
            with self._lock:
                self._bytes -= nbytes
                self._queued -= 1
                if ok:
                    self._done += 1
                else:
                    self._failed += 1

    def statistics(self) -> SaveQueueStatistics:
        with self._lock:
            return SaveQueueStatistics(self._queued, self._bytes, self._done, self._failed, self._dropped,
                                       self._blocks_dropped)

    def close(self) -> None:
        """Refuse new saves and wait for the accepted ones."""
        with self._lock:
            self._closed = True
        self._worker.shutdown(wait=True)
