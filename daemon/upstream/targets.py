"""Which upstream daemon to ask for which keys (``--upstream HOST:PORT|etcd://HOST:PORT/PREFIX``).

- ``HOST:PORT``: one upstream daemon; every key goes to it.
- ``etcd://HOST:PORT/PREFIX``: the region's members, read from etcd the way ``kvtierd
  --cluster`` registers them (:mod:`kvtier.daemon.cluster`), refreshed every
  ``MEMBERS_REFRESH_S`` by a thread of its own (requests never wait on etcd); a key's
  owners are its first ``REPLICAS_DEFAULT`` members by rendezvous score over the node ids,
  the rule every client of that region places blocks and their replicas by
  (:mod:`kvtier.common.rendezvous`).

A target answers owners by rank: one ``{client: positions}`` per rank, the first owners
first, then the next owner of each key, and so on::

    keys          k0  k1  k2            REPLICAS_DEFAULT = 2
    rank 0        B   A   C      <- asked first
    rank 1        C   B   A      <- asked for what rank 0 could not answer, or lacks

A target hands out one pooled :class:`~.client.UpstreamClient` per member it asks.
"""
from __future__ import annotations

import logging
import threading
from typing import Protocol, Sequence

from kvtier.common.cluster_url import (REPLICAS_DEFAULT, ClusterUrl, ClusterUrlError, MemberRecord, is_cluster_url,
                                      parse_cluster_url)
from kvtier.common.rendezvous import Rendezvous, positions_by_owner
from kvtier.daemon.cluster.etcd_session import EtcdSession, EtcdUnavailable

from .client import UpstreamClient

log = logging.getLogger("kvtier.daemon.upstream")

MEMBERS_REFRESH_S = 2.0  # how stale the region's member list may get (a member that left is a timeout meanwhile)
ETCD_TIMEOUT_S_MAX = 2.0  # one etcd request of the refresher: a hung endpoint delays the list, never a request


class UpstreamTarget(Protocol):
    text: str
    timeout_s: float  # what one request at this daemon may spend on the upstream, all members together

    def owners_by_rank(self, keys: Sequence[bytes]) -> list[dict[UpstreamClient, list[int]]]:
        """Per rank, first owners first, ``{client: ascending positions in keys}``: whom to ask
        for which keys (every key has one owner in each rank; none at all: ``[]``)."""

    def close(self) -> None:
        ...


class StaticTarget:
    """One upstream daemon at a fixed address."""

    def __init__(self, address: str, token: str | None, timeout_s: float):
        self.client = UpstreamClient(address, token, timeout_s)
        self.text = self.client.address
        self.timeout_s = timeout_s

    def owners_by_rank(self, keys: Sequence[bytes]) -> list[dict[UpstreamClient, list[int]]]:
        return [{self.client: list(range(len(keys)))}] if len(keys) else []

    def close(self) -> None:
        self.client.close()


class EtcdTarget:
    """The members of a region's etcd cluster; a key's owners are its first ``replicas``
    members by rendezvous score."""

    def __init__(self, url: ClusterUrl, token: str | None, timeout_s: float, session=None,
                 replicas: int = REPLICAS_DEFAULT):
        if replicas < 1:
            raise ValueError(f"replicas must be 1 or more, got {replicas}")
        self.url, self.text = url, url.text
        self._token, self.timeout_s, self.replicas = token, timeout_s, replicas
        self._session = session if session is not None else EtcdSession(url, min(timeout_s, ETCD_TIMEOUT_S_MAX))
        self._rendezvous_class = Rendezvous
        self._lock = threading.Lock()
        self._clients: dict[str, UpstreamClient] = {}  # data address -> client
        self._members: tuple[tuple[str, str], ...] = ()  # (node id, data address), sorted by node id
        self._routing = None
        self._listed = threading.Event()  # set once the first refresh answered (or failed)
        self._stop = threading.Event()
        self._refresher = threading.Thread(target=self._refresh_loop, name="kvtierd-upstream-members", daemon=True)
        self._refresher.start()

    def owners_by_rank(self, keys: Sequence[bytes]) -> list[dict[UpstreamClient, list[int]]]:
        """By the member list the refresher read last (a request never waits on etcd, but on
        the first list at most ``timeout_s``, once); fewer members than replicas: all of them."""
        if not len(keys):
            return []
        self._listed.wait(self.timeout_s)
        with self._lock:
            members, routing = self._members, self._routing
        if not members:
            return []
        place = routing.ranked(list(keys), min(self.replicas, len(members)))
        return [self._by_client(members, place[:, rank]) for rank in range(place.shape[1])]

    def _by_client(self, members: tuple[tuple[str, str], ...], owners) -> dict[UpstreamClient, list[int]]:
        """``{client: ascending positions}`` of one rank; members that share an address share a client."""
        out: dict[UpstreamClient, list[int]] = {}
        for j, idx in positions_by_owner(owners).items():
            out.setdefault(self._client_of(members[j][1]), []).extend(idx)
        return {client: sorted(idx) for client, idx in out.items()}

    def _refresh_loop(self) -> None:
        while not self._stop.is_set():
            self._refresh()
            self._listed.set()
            self._stop.wait(MEMBERS_REFRESH_S)

    def _refresh(self) -> None:
        try:
            listed = self._session.list_prefix(self.url.members_prefix)
            members = tuple(sorted(self._records(listed)))
        except EtcdUnavailable as exc:  # etcd away: keep routing by the last list
            log.warning("event=upstream_members_failed url=%s error=%s", self.text, exc)
            return
        except Exception:  # noqa: BLE001 -- an answer we cannot read: keep the last list, and the refresher
            log.exception("event=upstream_members_failed url=%s", self.text)
            return
        with self._lock:
            if members == self._members:
                return
            log.info("event=upstream_members url=%s members=%s", self.text, ",".join(n for n, _ in members))
            self._members = members
            self._routing = self._rendezvous_class([n for n, _ in members]) if members else None
            addresses = {address for _, address in members}
            gone = [self._clients.pop(a) for a in list(self._clients) if a not in addresses]
        for client in gone:  # members that left (or moved): their pooled connections go with them
            client.close()

    def _records(self, listed) -> list[tuple[str, str]]:
        """(node id, data address) of each valid member record; a bad one is logged and skipped."""
        out = []
        for key, raw in listed:
            try:
                record = MemberRecord.decode(raw)
                if record.node_id != self.url.node_id_of(key):
                    raise ClusterUrlError(f"record names node {record.node_id!r}")
            except ClusterUrlError as exc:
                log.warning("event=upstream_member_record_bad key=%s error=%s", key, exc)
                continue
            out.append((record.node_id, record.data))
        return out

    def _client_of(self, address: str) -> UpstreamClient:
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = self._clients[address] = UpstreamClient(address, self._token, self.timeout_s)
            return client

    def close(self) -> None:
        self._stop.set()
        self._refresher.join(ETCD_TIMEOUT_S_MAX * len(self.url.endpoints) + 1)
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()


def open_target(text: str, token: str | None, timeout_s: float) -> UpstreamTarget:
    """The target ``--upstream`` names (ValueError / ClusterUrlError names a bad one)."""
    if is_cluster_url(text):
        return EtcdTarget(parse_cluster_url(text, what="upstream"), token, timeout_s)
    return StaticTarget(text, token, timeout_s)
