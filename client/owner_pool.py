"""The warm tier's connections, one per member address, kept in step with the members.

::

    pool = OwnerPool(members, open_daemon)      # members: ClusterMembers (static list or etcd)
    with pool.batch() as batch:                 # OwnerBatch: the view now and its daemons
        batch.placement(keys, replicas)         # [keys, r] indexes into batch.daemons
        batch.daemons[j]                        # a Daemon, or None where it could not be opened
        batch.call(j, lambda d: d.client.get_many(...))   # counted; a failure backs the node off

Each batch takes ``members.current()``; when its version differs from the last one seen,
connections to members that appeared are opened (lazily, at that batch) and those of members
that left are closed once no batch holds them (a batch in flight finishes with what it
took). A member whose connection could not be opened is ``None`` in the
batch: its keys go to their next owner.

A member whose request failed backs off (:mod:`.node_backoff`): it goes last in every key's
owner order, and a probe thread pings it when its backoff runs out (a failed probe doubles
the backoff, bounded; an answer ends it; the member leaving the view forgets it).
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from kvtier.wire import events as p

from .cluster_members import ClusterMembers, Member, MembersStatistics, MemberView, STATIC_SOURCE, StaticMembers
from .node_backoff import BackoffStatistics, NodeBackoff, owners_backed_off_last

log = logging.getLogger(__name__)

OWNER_ERRORS = (p.ConnectionLost, OSError)  # an owner that cannot answer: ask the next one
PROBE_IDLE_WAIT_S = 5.0  # the probe thread's wait when nothing is backed off (a failure wakes it sooner)


class WriteQuorumError(p.ClientError):
    """A PUT did not reach enough of its keys' owners; names the nodes that failed."""


@dataclass(frozen=True)
class OwnerBatch:
    """One batch's members and their daemons (same order: ``view.addresses[j]`` is ``daemons[j]``)."""

    view: MemberView
    daemons: tuple
    backed_off: np.ndarray | None = None  # one bool per member: skipped now (None: none is)
    backoff: NodeBackoff | None = None

    def placement(self, keys: Sequence[bytes], replicas: int) -> np.ndarray:
        """``[len(keys), min(replicas, members)]`` owner indexes, first choice first; owners in
        backoff last (each row's others in rendezvous order)."""
        place = self.view.placement(keys, replicas)
        return place if self.backed_off is None else owners_backed_off_last(place, self.backed_off)

    def skipped(self, j: int) -> bool:
        """True when member ``j`` is in backoff."""
        return self.backed_off is not None and bool(self.backed_off[j])

    def call(self, j: int, request: Callable):
        """``request(daemon of member j)``, counted; an owner error backs the member off and is
        raised, an answer ends its backoff."""
        node = self.view.node_ids[j]
        daemon = self.daemons[j]
        if self.backoff is not None:
            self.backoff.sending(node)
        try:
            if daemon is None:
                raise p.ConnectionLost(f"no connection to {self.node_of(j)}")
            out = request(daemon)
        except OWNER_ERRORS:
            if self.backoff is not None:
                self.backoff.failed(node)
            raise
        if self.backoff is not None and self.backed_off is not None and self.backed_off[j]:
            self.backoff.succeeded(node)
        return out

    def node_of(self, j: int) -> str:
        return f"{self.view.node_ids[j]} ({self.view.addresses[j]})"


@dataclass(frozen=True)
class ClusterClientStatistics:
    """What one client sees of its cluster: the members (its watch) and their backoffs."""

    members: MembersStatistics
    backoff: BackoffStatistics
    connections_open: int  # member connections this client holds

    def as_dict(self) -> dict:
        return {"members": asdict(self.members), "backoff": asdict(self.backoff),
                "connections_open": self.connections_open}


class FixedMembers(StaticMembers):
    """A static list exactly as KVCache has always routed it: each address, as given, is a
    member's node id (no canonical form, so owners stay where they were)."""

    def __init__(self, addresses: Sequence[str]) -> None:  # not super().__init__: it canonicalizes addresses
        members = tuple(Member(a, a) for a in sorted(addresses))
        self._view = MemberView(members, 0, STATIC_SOURCE)


class OwnerPool:
    """Daemons by member address, opened when a member appears, closed when it leaves."""

    def __init__(self, members: ClusterMembers, open_daemon: Callable[[str], object],
                 backoff: NodeBackoff | None = None) -> None:
        self.members = members
        self._open = open_daemon
        self.backoff = backoff if backoff is not None else NodeBackoff(time.monotonic)
        self._wake = threading.Event()  # a failure or close: the probe thread looks again
        self.backoff.on_failed = self._wake.set
        self._lock = threading.Lock()
        self._daemons: dict[str, object] = {}  # address -> Daemon
        self._held: dict[int, int] = {}  # id(Daemon) -> batches holding it
        self._retired: dict[int, object] = {}  # id(Daemon) -> a daemon that left, closed when not held
        self._version: int | None = None
        self._view: MemberView | None = None
        self._closed = False
        self._prober = threading.Thread(target=self._probe_loop, name="kvtier-owner-probe", daemon=True)
        self._prober.start()

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
            batch = OwnerBatch(view, tuple(self._daemons.get(a) for a in view.addresses),
                               self.backoff.backed_off(view.node_ids), self.backoff)
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
        self.backoff.forget(view.node_ids)
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

    def statistics(self) -> ClusterClientStatistics:
        with self._lock:
            connections = len(self._daemons)
        return ClusterClientStatistics(self.members.statistics(), self.backoff.statistics(), connections)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for daemon in [*self._daemons.values(), *self._retired.values()]:
                _close_daemon(daemon)
            self._daemons, self._retired = {}, {}
        self._wake.set()
        if self._prober.is_alive() and self._prober is not threading.current_thread():
            self._prober.join()
        self.members.close()

    # -- the probe thread ------------------------------------------------------------
    def wake_prober(self) -> None:
        self._wake.set()

    def _probe_loop(self) -> None:
        while True:
            due_s = self.backoff.next_due_s()
            wait_s = PROBE_IDLE_WAIT_S if due_s is None else max(0.0, due_s - time.monotonic())
            self._wake.wait(wait_s)
            self._wake.clear()
            if self._closed:
                return
            for node in self.backoff.due_probes():
                self._probe(node)

    def _probe(self, node_id: str) -> None:
        """One cheap request (PING) to a member in backoff: an answer ends its backoff."""
        view = self.members.current()
        if node_id not in view.node_ids:
            self.backoff.forget(view.node_ids)
            return
        address = view.address_of(node_id)
        with self._lock:
            daemon = self._daemons.get(address)
        try:
            if daemon is None:  # never opened: opening it is the probe
                daemon = self._open(address)
                with self._lock:
                    member = self._view is not None and address in self._view.addresses  # it may have left since
                    if self._closed or address in self._daemons or not member:
                        _close_daemon(daemon)
                        daemon = self._daemons.get(address)
                    else:
                        self._daemons[address] = daemon
                if daemon is None:
                    return  # the member left, or the pool closed, while it was opened: nothing to probe
            daemon.client.ping()
        except OWNER_ERRORS + (p.ClientError, ValueError) as exc:
            backoff_s = self.backoff.probe_failed(node_id)
            log.info("event=owner_probe_failed node=%s address=%s backoff_s=%.2f error=%s", node_id, address,
                     backoff_s, exc)
            return
        self.backoff.succeeded(node_id)
        log.info("event=owner_back node=%s address=%s", node_id, address)


def _close_daemon(daemon) -> None:
    if daemon.reader is not None:
        daemon.reader.close()
    if getattr(daemon, "nixl", None) is not None:
        daemon.nixl.close()
    daemon.client.close()
