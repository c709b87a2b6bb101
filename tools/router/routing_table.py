"""Which nodes hold which blocks, kept from the nodes' KV events (pure bookkeeping, no I/O).

Per node: its set of keys and the sequence number of the last batch applied. A batch is
applied only when it is the next one (``seq == applied + 1``); an older one is stale (a
replay overlapping what is applied), a later one is a gap: the node must be resynchronized
(replay, or a snapshot: :meth:`RoutingTable.load_snapshot`). Until then the node's keys are
kept, as the best guess there is, and the node is listed as unsynced.

A node that is down (its PUB connection dropped) is left out of answers until a snapshot
brings it back. Keys are namespace-scoped by construction (a chain starts from the
namespace id), so the table needs no namespace column.

The longest stored prefix of a chain ``keys``: walking the chain, the nodes that hold every
key so far; the walk stops where none holds the next key::

    holders(k0) ∩ holders(k1) ∩ ... ∩ holders(k[L-1])  nonempty,  ∩ holders(k[L]) empty
"""
from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from kvtier.daemon.events import kv_event_format as fmt


class ApplyOutcome(enum.Enum):
    APPLIED = "applied"
    STALE = "stale"  # numbered at or below what is applied: already in the table
    GAP = "gap"  # batches are missing (or the node was never synced): resynchronize


@dataclass(frozen=True)
class PrefixAnswer:
    prefix_blocks: int  # leading keys held by every node in ``nodes``
    nodes: tuple[str, ...]  # sorted; empty when no up node holds the first key


@dataclass(frozen=True)
class NodeStatistics:
    keys: int
    seq: int | None
    up: bool
    synced: bool


@dataclass(frozen=True)
class TableStatistics:
    keys: int
    batches_applied: int
    batches_stale: int
    gaps: int
    snapshots_loaded: int
    nodes: dict[str, NodeStatistics] = field(default_factory=dict)

    def as_dict(self) -> dict:
        doc = dict(self.__dict__)
        doc["nodes"] = {n: dict(s.__dict__) for n, s in self.nodes.items()}
        return doc


class _Node:
    __slots__ = ("keys", "seq", "up", "synced")

    def __init__(self) -> None:
        self.keys: set[bytes] = set()
        self.seq: int | None = None
        self.up = False
        self.synced = False


class RoutingTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._holders: dict[bytes, set[str]] = {}
        self._nodes: dict[str, _Node] = {}
        self._applied = self._stale = self._gaps = self._snapshots = 0

    # -- feeding it ------------------------------------------------------------------------
    def load_snapshot(self, node: str, seq: int, keys: Iterable[bytes]) -> None:
        """Replace ``node``'s keys with a snapshot that includes every batch up to ``seq``; the node is up."""
        keys = set(keys)
        with self._lock:
            state = self._nodes.setdefault(node, _Node())
            for key in state.keys - keys:
                self._unhold(key, node)
            for key in keys - state.keys:
                self._holders.setdefault(key, set()).add(node)
            state.keys, state.seq, state.up, state.synced = keys, seq, True, True
            self._snapshots += 1
            self._changed.notify_all()

    def apply(self, node: str, seq: int, batch: fmt.KVEventBatch) -> ApplyOutcome:
        with self._lock:
            state = self._nodes.get(node)
            if state is None or state.seq is None:
                self._gaps += 1
                return ApplyOutcome.GAP
            if seq <= state.seq:
                self._stale += 1
                return ApplyOutcome.STALE
            if seq != state.seq + 1:
                state.synced = False
                self._gaps += 1
                return ApplyOutcome.GAP
            for event in batch.events:
                if isinstance(event, fmt.BlockStored):
                    for key in event.block_hashes:
                        if isinstance(key, bytes) and key not in state.keys:
                            state.keys.add(key)
                            self._holders.setdefault(key, set()).add(node)
                elif isinstance(event, fmt.BlockRemoved):
                    for key in event.block_hashes:
                        if key in state.keys:
                            state.keys.discard(key)
                            self._unhold(key, node)
                elif isinstance(event, fmt.AllBlocksCleared):
                    for key in state.keys:
                        self._unhold(key, node)
                    state.keys = set()
            state.seq = seq
            self._applied += 1
            self._changed.notify_all()
            return ApplyOutcome.APPLIED

    def set_down(self, node: str) -> None:
        """Leave ``node`` out of answers until its next snapshot (its PUB connection dropped)."""
        with self._lock:
            state = self._nodes.setdefault(node, _Node())
            state.up = state.synced = False

    def _unhold(self, key: bytes, node: str) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(node)
            if not holders:
                del self._holders[key]

    # -- asking it -----------------------------------------------------------------------------
    def longest_prefix(self, keys: Sequence[bytes]) -> PrefixAnswer:
        with self._lock:
            up = {n for n, s in self._nodes.items() if s.up}
            candidates: set[str] = set()
            length = 0
            for i, key in enumerate(keys):
                holding = self._holders.get(key, set()) & (up if i == 0 else candidates)
                if not holding:
                    break
                candidates, length = holding, i + 1
            return PrefixAnswer(length, tuple(sorted(candidates)))

    def wait_synced_to(self, node: str, seq: int, timeout_s: float) -> bool:
        """Wait until ``node`` is up and its batches up to ``seq`` are in the table; False on timeout."""
        def caught_up() -> bool:
            state = self._nodes.get(node)
            return state is not None and state.up and state.seq is not None and state.seq >= seq
        with self._changed:
            return self._changed.wait_for(caught_up, timeout_s)

    def node_keys(self, node: str) -> set[bytes]:
        with self._lock:
            state = self._nodes.get(node)
            return set() if state is None else set(state.keys)

    def node_seq(self, node: str) -> int | None:
        with self._lock:
            state = self._nodes.get(node)
            return None if state is None else state.seq

    def statistics(self) -> TableStatistics:
        with self._lock:
            return TableStatistics(
                keys=len(self._holders), batches_applied=self._applied, batches_stale=self._stale, gaps=self._gaps,
                snapshots_loaded=self._snapshots,
                nodes={n: NodeStatistics(len(s.keys), s.seq, s.up, s.synced) for n, s in sorted(self._nodes.items())})
