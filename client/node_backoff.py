"""Which members a client skips for now: per-node backoff after a failed request.

Bookkeeping only (no I/O; the clock is passed in, so tests use a fake one)::

    failed(node)        -> the node backs off: BACKOFF_S_MIN, doubling per failure in a row,
                           at most BACKOFF_S_MAX; it goes last in every key's owner order
    due_probes()        -> nodes whose backoff has run out: probe them (one cheap request)
    probe_failed(node)  -> back off again, twice as long
    succeeded(node)     -> a probe or any request answered: no longer skipped
    forget(live)        -> nodes the watch says are gone leave the table (no more probes)

A node in backoff stays skipped while its probe is due or in flight: only a success clears
it. ``backed_off(node_ids)`` is one boolean per member of a view (None while none is), for
:meth:`~.owner_pool.OwnerBatch.placement`, which moves those owners last (stable).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

BACKOFF_S_MIN = 0.25  # a refused connection is retried about this soon: a restart is short
BACKOFF_S_MAX = 4.0  # under the default lease TTL (5 s): a partitioned node is probed before it would expire
BACKOFF_GROWTH = 2.0


@dataclass
class _Node:
    failures: int = 0  # in a row, the first included
    backoff_s: float = 0.0
    until_s: float = 0.0  # probe due at this clock reading
    probing: bool = False


@dataclass(frozen=True)
class BackoffStatistics:
    backed_off: tuple[str, ...]  # node ids skipped now
    failures: int  # requests to an owner that failed (each one starts or grows a backoff)
    probes: int  # probes sent
    probes_failed: int
    recoveries: int  # nodes that left backoff because a probe or a request answered
    forgotten: int  # nodes in backoff that left the view
    sent: dict = field(default_factory=dict)  # node id -> data requests sent
    last_sent_s: dict = field(default_factory=dict)  # node id -> clock reading of its last data request


class NodeBackoff:
    """Thread-safe per-node backoff (see the module doc)."""

    def __init__(self, clock: Callable[[], float], backoff_s_min: float = BACKOFF_S_MIN,
                 backoff_s_max: float = BACKOFF_S_MAX) -> None:
        if not 0 < backoff_s_min <= backoff_s_max:
            raise ValueError(f"backoff bounds {backoff_s_min}..{backoff_s_max} s: need 0 < min <= max")
        self._clock = clock
        self._min_s, self._max_s = backoff_s_min, backoff_s_max
        self._lock = threading.Lock()
        self._nodes: dict[str, _Node] = {}
        self._sent: dict[str, int] = {}
        self._last_sent_s: dict[str, float] = {}
        self._failures = self._probes = self._probes_failed = self._recoveries = self._forgotten = 0
        self.on_failed: Callable[[], None] | None = None  # called after a failure (the prober's wake-up)

    def sending(self, node_id: str) -> None:
        """A data request (not a probe) goes to ``node_id`` now."""
        with self._lock:
            self._sent[node_id] = self._sent.get(node_id, 0) + 1
            self._last_sent_s[node_id] = self._clock()

    def failed(self, node_id: str) -> float:
        """A request to ``node_id`` failed (connection lost, refused, timed out): the backoff now."""
        with self._lock:
            self._failures += 1
            node = self._nodes.setdefault(node_id, _Node())
            # while a probe is in flight, it decides what comes next
            backoff_s = node.backoff_s if node.probing else self._grow(node)
        if self.on_failed is not None:
            self.on_failed()
        return backoff_s

    def _grow(self, node: _Node) -> float:
        node.failures += 1
        node.backoff_s = min(self._max_s, self._min_s * BACKOFF_GROWTH ** (node.failures - 1))
        node.until_s = self._clock() + node.backoff_s
        return node.backoff_s

    def succeeded(self, node_id: str) -> None:
        """``node_id`` answered: it is no longer skipped."""
        with self._lock:
            if self._nodes.pop(node_id, None) is not None:
                self._recoveries += 1

    def due_probes(self) -> list[str]:
        """Nodes whose backoff ran out and that no probe is asking yet; each is marked probing."""
        with self._lock:
            now = self._clock()
            due = sorted(n for n, s in self._nodes.items() if not s.probing and s.until_s <= now)
            for n in due:
                self._nodes[n].probing = True
            self._probes += len(due)
            return due

    def probe_failed(self, node_id: str) -> float:
        """The probe of ``node_id`` failed: back off again, longer (bounded). 0.0 when forgotten."""
        with self._lock:
            node = self._nodes.get(node_id)
            if node is None:
                return 0.0
            self._probes_failed += 1
            node.probing = False
            return self._grow(node)

    def next_due_s(self) -> float | None:
        """Clock reading of the next probe due (None: nothing backed off or every probe in flight)."""
        with self._lock:
            times = [s.until_s for s in self._nodes.values() if not s.probing]
            return min(times) if times else None

    def forget(self, live: Iterable[str]) -> None:
        """Keep only nodes among ``live`` (the view's members): the others are gone, not probed."""
        live = set(live)
        with self._lock:
            for n in [n for n in self._nodes if n not in live]:
                del self._nodes[n]
                self._forgotten += 1

    def backed_off(self, node_ids: Sequence[str]) -> np.ndarray | None:
        """One bool per node id: True where that node is skipped now; None when none is."""
        with self._lock:
            if not self._nodes:
                return None
            skipped = np.array([n in self._nodes for n in node_ids], dtype=bool)
        return skipped if skipped.any() else None

    def statistics(self) -> BackoffStatistics:
        with self._lock:
            return BackoffStatistics(tuple(sorted(self._nodes)), self._failures, self._probes, self._probes_failed,
                                     self._recoveries, self._forgotten, dict(self._sent), dict(self._last_sent_s))


def owners_backed_off_last(place: np.ndarray, backed_off: np.ndarray) -> np.ndarray:
    """``place`` ([keys, r] member indexes) with each row's backed-off members moved last,
    the others keeping their rendezvous order (a stable reorder)."""
    if not backed_off.any() or place.size == 0:
        return place
    order = np.argsort(backed_off[place], axis=1, kind="stable")
    return np.take_along_axis(place, order, axis=1)
