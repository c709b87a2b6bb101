"""ClusterMember: registers the daemon under its etcd lease and keeps it alive.

::

    start()  grant a lease, put /PREFIX/members/NODE_ID under it  (etcd away: ClusterError naming the URL)
    thread   keepalive every TTL/3; a failure is logged and counted and retried every 0.5 s;
             a lease found gone (etcd was away longer than the TTL) is re-registered
    stop()   revoke the lease, and with it the key it holds (SIGTERM); kill -9 lets the lease expire;
             a successor that re-registered the node id holds the key under its own lease, so it stays

What to do next and what happened is :class:`~.lease_state.LeaseState`'s bookkeeping;
this file only does the calls (:class:`~.etcd_session.EtcdSession`) and the waiting.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from kvtier.common.cluster_url import ClusterUrl, MemberRecord

from .etcd_session import EtcdSession, EtcdUnavailable
from .lease_state import KEEPALIVES_PER_TTL, LeaseState, MemberState, MembershipStatistics, Outcome, Step

log = logging.getLogger("kvtier.daemon.cluster")

LEASE_TTL_S_DEFAULT = 5  # kill -9: clients stop routing to the node within this (plus a watch round trip)
LEASE_TTL_S_MIN = 2  # etcd's own minimum with its default heartbeat (it raises a smaller TTL to this)
LEASE_TTL_S_MAX = 300  # beyond this a dead node keeps its keys for minutes
REQUEST_TIMEOUT_S_MAX = 2.0  # one etcd request; with short TTLs, a keepalive interval at most
REQUESTS_PER_STEP_MAX = 3  # a registration: grant, put, count


class ClusterError(Exception):
    """The daemon cannot join its cluster at start; the message names the etcd URL."""


@dataclass(frozen=True)
class ClusterSettings:
    url: ClusterUrl
    record: MemberRecord  # node id and advertised addresses
    lease_ttl_s: int = LEASE_TTL_S_DEFAULT

    def __post_init__(self) -> None:
        if not LEASE_TTL_S_MIN <= self.lease_ttl_s <= LEASE_TTL_S_MAX:
            raise ValueError(f"lease_ttl: {self.lease_ttl_s} s is outside {LEASE_TTL_S_MIN}..{LEASE_TTL_S_MAX}")

    @property
    def request_timeout_s(self) -> float:
        return min(REQUEST_TIMEOUT_S_MAX, self.lease_ttl_s / KEEPALIVES_PER_TTL)

    @property
    def step_timeout_s(self) -> float:
        """The longest one keeper step can take: every request timing out at every endpoint."""
        return self.request_timeout_s * len(self.url.endpoints) * REQUESTS_PER_STEP_MAX


class ClusterMember:
    """One daemon's membership; :meth:`start` registers, :meth:`stop` deregisters."""

    def __init__(self, settings: ClusterSettings, session: EtcdSession | None = None) -> None:
        self.settings = settings
        self.key = settings.url.member_key(settings.record.node_id)
        self._session = session
        self._state = LeaseState(settings.record.node_id, settings.url.text, settings.record.data,
                                 settings.lease_ttl_s)
        self._lock = threading.Lock()  # guards _state between the keeper thread and statistics()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Register now (ClusterError when etcd does not answer), then keep the lease alive."""
        try:
            if self._session is None:
                self._session = EtcdSession(self.settings.url, self.settings.request_timeout_s)
            self._register()
        except EtcdUnavailable as exc:
            raise ClusterError(f"cannot join the cluster at {self.settings.url.text}: {exc}") from None
        log.info("event=cluster_registered node_id=%s data=%s lease_ttl_s=%d cluster=%s", self._state.node_id,
                 self.settings.record.data, self._state.lease_ttl_s, self.settings.url.text)
        self._thread = threading.Thread(target=self._run, name="kvtier-lease-keeper", daemon=True)
        self._thread.start()

    def statistics(self) -> MembershipStatistics:
        with self._lock:
            return self._state.statistics()

    def stop(self) -> bool:
        """Stop the keepalives and revoke the lease, which deletes the key only while this
        instance holds it. False when etcd did not answer (logged; the lease then expires within its TTL)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.settings.step_timeout_s + 1.0)
            assert not self._thread.is_alive(), "the lease keeper did not stop"
        with self._lock:
            lease_id = self._state.lease_id
            self._state.record(Outcome.STOPPED)
        try:
            if lease_id is not None:
                self._session.revoke(lease_id)
        except EtcdUnavailable as exc:
            log.error("event=cluster_deregister_failed node_id=%s error=%s (the lease expires in %d s)",
                      self._state.node_id, exc, self._state.lease_ttl_s)
            return False
        log.info("event=cluster_deregistered node_id=%s", self._state.node_id)
        return True

    # -- the keeper thread -------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self._delay_s()):
            with self._lock:
                step, lease_id, before = self._state.next_step(), self._state.lease_id, self._state.state
            try:
                if step is Step.REGISTER:
                    self._register()
                elif step is Step.KEEPALIVE:
                    self._keepalive(lease_id)
            except EtcdUnavailable as exc:
                with self._lock:
                    self._state.record(Outcome.ETCD_ERROR, error=str(exc))
                if before is not MemberState.ETCD_LOST:
                    log.error("event=etcd_lost node_id=%s error=%s (serving on; retrying)", self._state.node_id, exc)
                continue
            if before is MemberState.ETCD_LOST:
                log.warning("event=etcd_back node_id=%s state=%s", self._state.node_id, self._state.state.value)

    def _delay_s(self) -> float:
        with self._lock:
            return self._state.delay_s()

    def _register(self) -> None:
        lease_id, ttl_s = self._session.grant(self.settings.lease_ttl_s)
        self._session.put(self.key, self.settings.record.encode(), lease_id)
        members = self._session.count_prefix(self.settings.url.members_prefix)
        with self._lock:
            again = self._state.registrations > 0
            self._state.record(Outcome.REGISTERED, lease_id=lease_id, ttl_s=ttl_s, members=members)
        if again:
            log.warning("event=cluster_re_registered node_id=%s lease_id=%x", self._state.node_id, lease_id)

    def _keepalive(self, lease_id: int) -> None:
        ttl_s = self._session.keepalive(lease_id)
        if ttl_s <= 0:
            with self._lock:
                self._state.record(Outcome.EXPIRED)
            log.warning("event=cluster_lease_expired node_id=%s lease_id=%x (registering again)",
                        self._state.node_id, lease_id)
            return
        members = self._session.count_prefix(self.settings.url.members_prefix)
        with self._lock:
            self._state.record(Outcome.KEPT, ttl_s=ttl_s, members=members)
