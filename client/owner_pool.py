"""The warm tier's connections, one per member address, kept in step with the members.

::

    pool = OwnerPool(members, open_daemon)      # members: ClusterMembers (static list or etcd)
    with pool.batch() as batch:                 # OwnerBatch: the view now and its daemons
        batch.placement(keys, replicas)         # [keys, r] indexes into batch.daemons
        batch.daemons[j]                        # a Daemon, or None where it could not be opened

Each batch takes ``members.current()``; when its version differs from the last one seen,
connections to members that appeared are opened (lazily, at that batch) and those of members
that left are closed once no batch holds them (a batch in flight finishes with what it
took). A member whose connection could not be opened is ``None`` in the
batch: its keys go to their next owner. Bookkeeping only; the I/O is the block clients'.
"""
from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from kvtier.wire import events as p

from .cluster_members import ClusterMembers, Member, MemberView, STATIC_SOURCE, StaticMembers

log = logging.getLogger(__name__)

OWNER_ERRORS = (p.ConnectionLost, OSError)  # an owner that cannot answer: ask the next one


class WriteQuorumError(p.ClientError):
    """A PUT did not reach enough of its keys' owners; names the nodes that failed."""


@dataclass(frozen=True)
class OwnerBatch:
    """One batch's members and their daemons (same order: ``view.addresses[j]`` is ``daemons[j]``)."""

    view: MemberView
    daemons: tuple

    def placement(self, keys: Sequence[bytes], replicas: int) -> np.ndarray:
        """``[len(keys), min(replicas, members)]`` owner indexes, first choice first."""
        return self.view.placement(keys, replicas)

    def node_of(self, j: int) -> str:
        return f"{self.view.node_ids[j]} ({self.view.addresses[j]})"


class FixedMembers(StaticMembers):
    """A static list exactly as KVCache has always routed it: each address, as given, is a
    member's node id (no canonical form, so owners stay where they were)."""

    def __init__(self, addresses: Sequence[str]) -> None:  # not super().__init__: it canonicalizes addresses
        members = tuple(Member(a, a) for a in sorted(addresses))
        self._view = MemberView(members, 0, STATIC_SOURCE)


class OwnerPool:
    """Daemons by member address, opened when a member appears, closed when it leaves."""

    def __init__(self, members: ClusterMembers, open_daemon: Callable[[str], object]) -> None:
        self.members = members
        self._open = open_daemon
        self._lock = threading.Lock()
        self._daemons: dict[str, object] = {}  # address -> Daemon
        self._held: dict[int, int] = {}  # id(Daemon) -> batches holding it
        self._retired: dict[int, object] = {}  # id(Daemon) -> a daemon that left, closed when not held
        self._version: int | None = None
        self._view: MemberView | None = None
        self._closed = False

    def open_all(self) -> None:
        """Open every member's connection now; the first failure raises (a static list)."""
        view = self.members.current()
        with self._lock:
            for address in view.addresses:
                if address not in self._daemons:
                    self._daemons[address] = self._open(address)
            self._version, self._view = view.version, view

    @contextmanager
    def batch(self) -> Iterator[OwnerBatch]:
        """The members now and their daemons, held open for the body."""
        view = self.members.current()
        with self._lock:
            if self._closed:
                raise p.ClientError("the cache is closed")
            if view.version != self._version:
                self._sync(view)
            batch = OwnerBatch(view, tuple(self._daemons.get(a) for a in view.addresses))
            held = [d for d in batch.daemons if d is not None]
            for d in held:
                self._held[id(d)] = self._held.get(id(d), 0) + 1
        try:
            yield batch
        finally:
            with self._lock:
                for d in held:
                    self._held[id(d)] -= 1
                    if not self._held[id(d)]:
                        del self._held[id(d)]
                        if self._retired.pop(id(d), None) is not None:
                            _close_daemon(d)

    def _sync(self, view: MemberView) -> None:
        live = set(view.addresses)
        for address in [a for a in self._daemons if a not in live]:
            log.info("event=member_left address=%s", address)
            daemon = self._daemons.pop(address)
            if id(daemon) in self._held:
                self._retired[id(daemon)] = daemon  # the last batch holding it closes it
            else:
                _close_daemon(daemon)
        for address in view.addresses:
            if address not in self._daemons:
                try:
                    self._daemons[address] = self._open(address)
                except OWNER_ERRORS + (ValueError,) as exc:
                    log.warning("event=member_unreachable address=%s error=%s", address, exc)
                    continue  # tried again at the next batch
                log.info("event=member_joined address=%s", address)
        self._view = view
        if all(a in self._daemons for a in view.addresses):
            self._version = view.version  # else the next batch tries the missing ones again

    @property
    def daemons(self) -> list:
        """The open daemons, in the members' order."""
        with self._lock:
            return [self._daemons[a] for a in (self._view.addresses if self._view else ()) if a in self._daemons]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for daemon in [*self._daemons.values(), *self._retired.values()]:
                _close_daemon(daemon)
            self._daemons, self._retired = {}, {}
        self.members.close()


def _close_daemon(daemon) -> None:
    if daemon.reader is not None:
        daemon.reader.close()
    daemon.client.close()
