"""The membership state machine of one daemon: bookkeeping only, no I/O, no clock.

The lease keeper (:mod:`.lease_keeper`) asks :meth:`LeaseState.next_step` what to do,
does it against etcd, and reports the outcome with :meth:`LeaseState.record`. The
transitions are one literal table::

    state         outcome      -> state         (re-registration when marked *)
    REGISTERING   REGISTERED   -> REGISTERED     * after the first
    REGISTERING   ETCD_ERROR   -> ETCD_LOST
    REGISTERED    KEPT         -> REGISTERED
    REGISTERED    EXPIRED      -> REGISTERING    (lease gone: etcd was away longer than the TTL)
    REGISTERED    ETCD_ERROR   -> ETCD_LOST
    ETCD_LOST     KEPT         -> REGISTERED     (etcd back, the lease survived)
    ETCD_LOST     EXPIRED      -> REGISTERING
    ETCD_LOST     REGISTERED   -> REGISTERED     *
    ETCD_LOST     ETCD_ERROR   -> ETCD_LOST
    any           STOPPED      -> STOPPED

A daemon keeps serving in every state: losing etcd costs the cluster's view of it,
not its data.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

KEEPALIVES_PER_TTL = 3  # a keepalive every TTL/3: two may fail before the lease ends
RETRY_INTERVAL_S_MAX = 0.5  # etcd lost: try again this often, so etcd back means registered soon after


class MemberState(enum.Enum):
    REGISTERING = "registering"
    REGISTERED = "registered"
    ETCD_LOST = "etcd_lost"
    STOPPED = "stopped"


class Outcome(enum.Enum):
    REGISTERED = "registered"  # a lease granted and the record put under it
    KEPT = "kept"  # a keepalive answered with the lease's TTL
    EXPIRED = "expired"  # a keepalive found the lease gone
    ETCD_ERROR = "etcd_error"  # no etcd endpoint answered
    STOPPED = "stopped"


class Step(enum.Enum):
    REGISTER = "register"
    KEEPALIVE = "keepalive"
    NONE = "none"


S, O = MemberState, Outcome
TRANSITIONS: dict[tuple[MemberState, Outcome], MemberState] = {
    (S.REGISTERING, O.REGISTERED): S.REGISTERED,
    (S.REGISTERING, O.ETCD_ERROR): S.ETCD_LOST,
    (S.REGISTERED, O.KEPT): S.REGISTERED,
    (S.REGISTERED, O.EXPIRED): S.REGISTERING,
    (S.REGISTERED, O.ETCD_ERROR): S.ETCD_LOST,
    (S.ETCD_LOST, O.KEPT): S.REGISTERED,
    (S.ETCD_LOST, O.EXPIRED): S.REGISTERING,
    (S.ETCD_LOST, O.REGISTERED): S.REGISTERED,
    (S.ETCD_LOST, O.ETCD_ERROR): S.ETCD_LOST,
    **{(s, O.STOPPED): S.STOPPED for s in MemberState},
}
del S, O


@dataclass(frozen=True)
class MembershipStatistics:
    """A snapshot of one daemon's membership (``statistics()``)."""

    state: str
    node_id: str
    cluster: str  # the etcd:// URL
    advertised: str  # the data address registered
    lease_ttl_s: int  # as etcd granted it
    lease_id: int | None
    registrations: int  # leases granted and records put, the first included
    re_registrations: int  # registrations after the first (lease expired, or etcd came back without it)
    keepalives: int
    etcd_errors: int  # requests no endpoint answered
    members_seen: int  # members under the prefix at the last count (-1 before one)
    last_error: str | None


class LeaseState:
    """What the lease keeper does next and what it has done (see the module doc)."""

    def __init__(self, node_id: str, cluster: str, advertised: str, lease_ttl_s: int) -> None:
        assert lease_ttl_s >= 1, f"lease TTL {lease_ttl_s} s"
        self.node_id, self.cluster, self.advertised = node_id, cluster, advertised
        self.requested_ttl_s = lease_ttl_s
        self.state = MemberState.REGISTERING
        self.lease_id: int | None = None
        self.lease_ttl_s = lease_ttl_s
        self.registrations = self.keepalives = self.etcd_errors = 0
        self.members_seen = -1
        self.last_error: str | None = None

    def next_step(self) -> Step:
        if self.state is MemberState.REGISTERING:
            return Step.REGISTER
        if self.state is MemberState.REGISTERED:
            return Step.KEEPALIVE
        if self.state is MemberState.ETCD_LOST:
            return Step.KEEPALIVE if self.lease_id is not None else Step.REGISTER
        return Step.NONE

    def delay_s(self) -> float:
        """How long to wait before the next step."""
        keepalive_s = self.lease_ttl_s / KEEPALIVES_PER_TTL
        if self.state is MemberState.REGISTERED:
            return keepalive_s
        if self.state is MemberState.ETCD_LOST:
            return min(RETRY_INTERVAL_S_MAX, keepalive_s)
        return 0.0

    def record(self, outcome: Outcome, *, lease_id: int | None = None, ttl_s: int | None = None,
               members: int | None = None, error: str | None = None) -> MemberState:
        """Apply one outcome; returns the new state. An outcome the table does not allow is a bug."""
        key = (self.state, outcome)
        assert key in TRANSITIONS, f"membership of {self.node_id}: {outcome.name} in state {self.state.name}"
        if outcome is Outcome.REGISTERED:
            assert lease_id is not None and ttl_s is not None, "a registration has a lease and its TTL"
            self.registrations += 1
            self.lease_id, self.lease_ttl_s = lease_id, ttl_s
        elif outcome is Outcome.KEPT:
            self.keepalives += 1
        elif outcome is Outcome.EXPIRED:
            self.lease_id = None
        elif outcome is Outcome.ETCD_ERROR:
            self.etcd_errors += 1
            self.last_error = error
        if members is not None:
            self.members_seen = members
        self.state = TRANSITIONS[key]
        return self.state

    def statistics(self) -> MembershipStatistics:
        return MembershipStatistics(
            state=self.state.value, node_id=self.node_id, cluster=self.cluster, advertised=self.advertised,
            lease_ttl_s=self.lease_ttl_s, lease_id=self.lease_id, registrations=self.registrations,
            re_registrations=max(0, self.registrations - 1), keepalives=self.keepalives,
            etcd_errors=self.etcd_errors, members_seen=self.members_seen, last_error=self.last_error)
