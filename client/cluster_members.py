"""Who the cluster's members are right now, for whoever routes (``KVCache``, kvperf).

::

    members = open_members("etcd://10.0.0.1:2379/kvtier")     # or "h1:7410,h2:7410", or a list
    view = members.current()              # MemberView: immutable, cheap, never blocks
    view.node_ids, view.addresses         # the same order; view.address_of(node_id)
    owners = view.placement(keys, replicas=2)     # [keys, 2] indexes into view.node_ids / .addresses
    members.wait_changed(view.version, timeout_s=1.0)   # the next view (or the same, on timeout)
    members.statistics(); members.close()

Routing is by node id (:mod:`kvtier.client.routing` over ``view.node_ids``): a daemon that
restarts on another port keeps its keys. A static list names each member by its address,
so a static cluster routes exactly as a plain address list always has.

This module is bookkeeping (:class:`MemberTable`: a snapshot, then put and delete events
in revision order) and the static source; the etcd watch is :mod:`.cluster_etcd`.
When etcd is lost, the view stays as it was, marked ``stale``.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterable, Protocol, Sequence

import numpy as np

from kvtier.common.addresses import AddressError, format_address, parse_daemon_address
from kvtier.common.cluster_url import ClusterUrl, ClusterUrlError, MemberRecord, is_cluster_url, parse_cluster_url

from .routing import MEMBERS_MAX, Rendezvous

log = logging.getLogger("kvtier.client.cluster")

STATIC_SOURCE = "static"


class ClusterUnavailable(Exception):
    """The members cannot be read at start (etcd did not answer); names the URL."""


@dataclass(frozen=True)
class Member:
    node_id: str
    address: str  # the data address, HOST:PORT
    admin: str | None = None  # the admin API's HOST:PORT, when the node runs one
    lease_id: int | None = None  # etcd's lease (None for a static member)


@dataclass(frozen=True)
class MemberView:
    """The live members at one moment, sorted by node id. A new membership is a new view."""

    members: tuple[Member, ...]
    version: int  # grows with every change (the etcd revision; 0 for a static list)
    source: str  # the etcd:// URL, or "static"
    stale: bool = False  # etcd lost: the last view seen, kept until etcd answers again

    def __post_init__(self) -> None:
        ids = [m.node_id for m in self.members]
        assert ids == sorted(set(ids)), f"member view of {self.source}: node ids not sorted and distinct: {ids}"

    def __len__(self) -> int:
        return len(self.members)

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(m.node_id for m in self.members)

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(m.address for m in self.members)

    def address_of(self, node_id: str) -> str:
        for m in self.members:
            if m.node_id == node_id:
                return m.address
        raise KeyError(f"{node_id!r} is not a member of {self.source} (members: {', '.join(self.node_ids)})")

    @cached_property
    def _routing(self) -> Rendezvous:
        return Rendezvous(self.node_ids)

    def rendezvous(self) -> Rendezvous:
        """The routing rule over these members (built once per view). ValueError with no members."""
        if not self.members:
            raise ValueError(f"the cluster {self.source} has no live members")
        return self._routing

    def placement(self, keys: Sequence[bytes], replicas: int) -> np.ndarray:
        """``[len(keys), min(replicas, members)]``: each key's owners, first choice first, as
        indexes into :attr:`node_ids` / :attr:`addresses` (fewer members than replicas: all)."""
        if replicas < 1:
            raise ValueError(f"replicas must be 1 or more, got {replicas}")
        return self.rendezvous().ranked(keys, min(replicas, len(self.members)))


@dataclass(frozen=True)
class MembersStatistics:
    source: str
    members: int
    version: int
    stale: bool
    joins: int  # members that appeared after the first view
    leaves: int  # members that disappeared
    updates: int  # members whose record changed (a restart on another address, a new lease)
    bad_records: int  # member keys whose value did not decode (skipped)
    etcd_errors: int = 0  # watch streams or reads that failed
    resyncs: int = 0  # full reads after a lost watch


class ClusterMembers(Protocol):
    """What a router needs from a membership source (static list or etcd)."""

    def current(self) -> MemberView: ...

    def wait_changed(self, version: int, timeout_s: float) -> MemberView: ...

    def statistics(self) -> MembersStatistics: ...

    def close(self) -> None: ...


@dataclass
class MemberTable:
    """Members of one source by node id, fed a snapshot then events; no I/O, not thread-safe
    (:class:`~.cluster_etcd.EtcdMembers` holds the lock)."""

    url: ClusterUrl
    members: dict[str, Member] = field(default_factory=dict)
    revision: int = 0
    joins: int = 0
    leaves: int = 0
    updates: int = 0
    bad_records: int = 0
    _seeded: bool = False
    _offset: int = 0  # added to the revision in views, so their version grows even when etcd's went back

    @property
    def version(self) -> int:
        """The version of the views: etcd's revision, plus what keeps it growing across a reset
        to an earlier revision (etcd restarted without its data, or rebuilt)."""
        return self.revision + self._offset

    def reset(self, kvs: Iterable[tuple[str, bytes, int]], revision: int) -> bool:
        """A full read: (key, value, lease id) of every member key at ``revision``. True when
        the members changed (joins and leaves against the previous view are counted)."""
        fresh: dict[str, Member] = {}
        for key, value, lease in kvs:
            member = self._decode(key, value, lease)
            if member is not None:
                fresh[member.node_id] = member
        changed = self._count_changes(fresh)
        if revision < self.revision:  # an earlier history: the watch must start from this one's revision
            self._offset = self.version + 1 - revision
        self.members, self.revision, self._seeded = fresh, revision, True
        return changed

    def put(self, key: str, value: bytes, lease: int, revision: int) -> bool:
        """A watch PUT event; True when the view changed."""
        self.revision = max(self.revision, revision)
        member = self._decode(key, value, lease)
        if member is None:
            return False
        old = self.members.get(member.node_id)
        if old == member:
            return False
        self.members[member.node_id] = member
        if old is None:
            self.joins += 1
        else:
            self.updates += 1
        return True

    def delete(self, key: str, revision: int) -> bool:
        """A watch DELETE event (lease revoked or expired); True when a member left."""
        self.revision = max(self.revision, revision)
        try:
            node_id = self.url.node_id_of(key)
        except ClusterUrlError:
            return False
        if self.members.pop(node_id, None) is None:
            return False
        self.leaves += 1
        return True

    def view(self, stale: bool = False) -> MemberView:
        return MemberView(tuple(self.members[n] for n in sorted(self.members)), self.version, self.url.text, stale)

    def _decode(self, key: str, value: bytes, lease: int) -> Member | None:
        try:
            node_id = self.url.node_id_of(key)
            record = MemberRecord.decode(value)
            if record.node_id != node_id:
                raise ClusterUrlError(f"record names node {record.node_id!r}")
        except ClusterUrlError as exc:
            self.bad_records += 1
            log.warning("event=bad_member_record key=%s error=%s (skipped)", key, exc)
            return None
        return Member(node_id, record.data, record.admin, lease or None)

    def _count_changes(self, fresh: dict[str, Member]) -> bool:
        if not self._seeded:
            return True
        joined = fresh.keys() - self.members.keys()
        left = self.members.keys() - fresh.keys()
        updated = [n for n in fresh.keys() & self.members.keys() if fresh[n] != self.members[n]]
        self.joins, self.leaves, self.updates = self.joins + len(joined), self.leaves + len(left), \
            self.updates + len(updated)
        return bool(joined or left or updated)


class StaticMembers:
    """A fixed address list; each member's node id is its address."""

    def __init__(self, addresses: Sequence[str]) -> None:
        members = []
        for text in addresses:
            try:
                host, port = parse_daemon_address(text, what="member address")
            except AddressError as exc:
                raise ValueError(str(exc)) from None
            address = format_address(host, port)
            members.append(Member(address, address))
        if not members or len(members) > MEMBERS_MAX:
            raise ValueError(f"a static cluster needs 1..{MEMBERS_MAX} addresses, got {len(members)}")
        if len({m.node_id for m in members}) != len(members):
            raise ValueError(f"an address is given twice in {list(addresses)!r}")
        self._view = MemberView(tuple(sorted(members, key=lambda m: m.node_id)), 0, STATIC_SOURCE)

    def current(self) -> MemberView:
        return self._view

    def wait_changed(self, version: int, timeout_s: float) -> MemberView:
        """A static list never changes: returns at once when ``version`` is older, else after the timeout."""
        if version < self._view.version:
            return self._view
        threading.Event().wait(timeout_s)
        return self._view

    def statistics(self) -> MembersStatistics:
        return MembersStatistics(STATIC_SOURCE, len(self._view), 0, False, 0, 0, 0, 0)

    def close(self) -> None:
        pass


def open_members(target: str | Sequence[str], **etcd_options) -> ClusterMembers:
    """``etcd://...`` -> the etcd members, read now and watched (ClusterUnavailable names the URL
    when etcd does not answer); ``"h1:7410,h2:7410"`` or a list of addresses -> a static list."""
    if isinstance(target, str) and is_cluster_url(target):
        from .cluster_etcd import EtcdMembers
        try:
            url = parse_cluster_url(target)
        except ClusterUrlError as exc:
            raise ValueError(str(exc)) from None
        return EtcdMembers(url, **etcd_options).start()
    if isinstance(target, str):
        target = [t.strip().removeprefix("tcp://") for t in target.split(",") if t.strip()]
    return StaticMembers(list(target))
