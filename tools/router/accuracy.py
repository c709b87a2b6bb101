"""Routing-table accuracy, measured by probing the nodes.

An answer is *accurate* when the node it chose holds the longest prefix any node holds:
every node is asked with one LOOKUP how many leading keys of the request's chain it has;
the answer is accurate when the chosen node's count equals the largest (and, when it chose
no node, when that largest is 0). A node that cannot be asked counts 0. The probe runs after
the answer, so a block stored or evicted in between counts against it: the figure is a
lower bound on what the table knew.

A sampled fraction of answers is probed, on a thread of its own, through a bounded queue (a
full queue skips the sample and counts it).
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

QUEUE_SAMPLES_MAX = 1024  # answers waiting to be probed


@dataclass(frozen=True)
class AccuracyStatistics:
    probed: int
    accurate: int
    skipped: int  # sampled, but the probe queue was full
    probe_errors: int  # node LOOKUPs that failed (counted as holding nothing)

    @property
    def accuracy(self) -> float | None:
        return None if not self.probed else self.accurate / self.probed

    def as_dict(self) -> dict:
        return dict(self.__dict__, accuracy=self.accuracy)


def is_accurate(chosen: str | None, held: dict[str, int]) -> bool:
    """The rule of the module doc, on each node's LOOKUP count of the chain."""
    best = max(held.values(), default=0)
    return best == 0 if chosen is None else held.get(chosen, 0) == best


class AccuracyProbe:
    """``lookup(node_id, keys) -> int`` asks one node; it raises one of ``errors`` when it cannot."""

    def __init__(self, nodes: Sequence[str], lookup: Callable[[str, list[bytes]], int], fraction: float,
                 errors: tuple[type[BaseException], ...] = (OSError,)):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"probe fraction must be in [0, 1], got {fraction}")
        self._nodes = tuple(nodes)
        self._lookup = lookup
        self._lookup_errors = errors
        self._every = 0 if fraction == 0 else max(1, round(1 / fraction))
        self._seen = 0
        self._queue: queue.Queue = queue.Queue(QUEUE_SAMPLES_MAX)
        self._lock = threading.Lock()
        self._probed = self._accurate = self._skipped = self._errors = 0
        self._thread = threading.Thread(target=self._run, name="kvtier-router-probe", daemon=True)
        self._thread.start()

    def offer(self, keys: list[bytes], chosen: str | None) -> None:
        with self._lock:
            self._seen += 1
            if not self._every or self._seen % self._every:
                return
        try:
            self._queue.put_nowait((keys, chosen))
        except queue.Full:
            with self._lock:
                self._skipped += 1

    def probe(self, keys: list[bytes], chosen: str | None) -> bool:
        held = {}
        for node in self._nodes:
            try:
                held[node] = self._lookup(node, keys)
            except self._lookup_errors:  # a node that is down holds nothing for its clients: counted
                held[node] = 0
                with self._lock:
                    self._errors += 1
        ok = is_accurate(chosen, held)
        with self._lock:
            self._probed += 1
            self._accurate += ok
        return ok

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self.probe(*item)
            finally:
                self._queue.task_done()

    def wait_drained(self) -> None:
        """Wait until every sample queued so far is probed."""
        self._queue.join()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def statistics(self) -> AccuracyStatistics:
        with self._lock:
            return AccuracyStatistics(self._probed, self._accurate, self._skipped, self._errors)
