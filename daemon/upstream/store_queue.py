"""Write-behind of blocks fetched from the upstream into this daemon's engine.

The request that fetched a block serves it at once and hands it here; one worker thread
stores the queue in batches (``Engine.put_many``, not durable: a cache fill). The queue is
bounded in bytes; a block that does not fit is dropped and counted (a later miss fetches
it again). Until a block is stored it stays readable from the queue (:meth:`pending`), so
the next request for it is served here, not from the upstream again::

    fetch ──offer()──> [ queue: key -> block, bounded ] ──worker: put_many──> engine
                 \\____ pending(keys) serves what is queued ____/
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

log = logging.getLogger("kvtier.daemon.upstream")

STORE_QUEUE_BYTES_MAX = 256 << 20  # fetched blocks waiting to be stored: bounds the memory a cold burst takes
STORE_BATCH_BYTES_MAX = 16 << 20  # one put_many of the worker: the engine lock is held per batch
STORE_DRAIN_S = 5.0  # at shutdown, how long the queue may take to reach the engine before the rest is dropped


@dataclass(frozen=True)
class StoreQueueStatistics:
    queued_blocks: int  # accepted into the queue since start
    stored_blocks: int  # put into the engine (a key already present counts: it is stored)
    dropped_blocks: int  # refused: the queue was full (or closing)
    failed_blocks: int  # the engine refused them (no space, a device error): logged
    queue_blocks: int  # waiting now
    queue_bytes: int
    queue_bytes_max: int


class StoreQueue:
    """Thread-safe; ``put_many(blocks)`` is the engine's (blocks are whole, verified blocks)."""

    def __init__(self, put_many, bytes_max: int = STORE_QUEUE_BYTES_MAX, batch_bytes_max: int = STORE_BATCH_BYTES_MAX):
        self._put_many = put_many
        self._bytes_max, self._batch_bytes_max = bytes_max, batch_bytes_max
        self._queue: OrderedDict[bytes, memoryview] = OrderedDict()
        self._bytes = 0
        self._storing: dict[bytes, memoryview] = {}  # taken by the worker, not yet in the engine
        self._cond = threading.Condition()
        self._closing = False
        self._queued = self._stored = self._dropped = self._failed = 0
        self._worker = threading.Thread(target=self._run, name="kvtierd-upstream-store", daemon=True)
        self._worker.start()

    def offer(self, items: Sequence[tuple[bytes, memoryview]]) -> int:
        """Queue ``(key, block)`` pairs in order while they fit; returns how many were dropped."""
        dropped = 0
        with self._cond:
            for key, block in items:
                if key in self._queue or key in self._storing:
                    continue
                if self._closing or self._bytes + block.nbytes > self._bytes_max:
                    dropped += 1
                    continue
                self._queue[key] = block
                self._bytes += block.nbytes
                self._queued += 1
            self._dropped += dropped
            self._cond.notify()
        return dropped

    def pending(self, keys: Sequence[bytes]) -> list:
        """Per key, its block if it waits here to be stored, else None."""
        with self._cond:
            return [self._queue.get(k) if k in self._queue else self._storing.get(k) for k in keys]

    def statistics(self) -> StoreQueueStatistics:
        with self._cond:
            return StoreQueueStatistics(self._queued, self._stored, self._dropped, self._failed,
                                        len(self._queue) + len(self._storing), self._bytes, self._bytes_max)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every queued block reached the engine (or failed); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._storing, timeout_s)

    def close(self, drain_s: float = STORE_DRAIN_S) -> None:
        """Store what is queued (for up to ``drain_s``), drop the rest, stop the worker."""
        self.wait_idle(drain_s)
        with self._cond:
            self._closing = True
            self._dropped += len(self._queue)
            self._queue.clear()
            self._bytes = 0
            self._cond.notify_all()
        self._worker.join(drain_s)

    def _take_batch(self) -> list[tuple[bytes, memoryview]] | None:
        with self._cond:
            self._cond.wait_for(lambda: self._queue or self._closing)
            if self._closing and not self._queue:
                return None
            batch, size = [], 0
            while self._queue and (not batch or size + next(iter(self._queue.values())).nbytes
                                   <= self._batch_bytes_max):
                key, block = self._queue.popitem(last=False)
                self._bytes -= block.nbytes
                size += block.nbytes
                batch.append((key, block))
                self._storing[key] = block
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            try:
                self._put_many([block for _, block in batch])
                stored, failed = len(batch), 0
            except Exception as exc:  # no space, a device error: a cache fill gives up, the daemon serves on
                log.warning("event=upstream_store_failed blocks=%d error=%s: %s", len(batch), type(exc).__name__, exc)
                stored, failed = 0, len(batch)
            with self._cond:
                for key, _ in batch:
                    self._storing.pop(key, None)
                self._stored += stored
                self._failed += failed
                self._cond.notify_all()
