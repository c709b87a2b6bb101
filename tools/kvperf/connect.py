"""Connections to a job's targets: one client per daemon (see
:mod:`.ioengines`), checked with a PING before the clock starts, and an
optional direct reader. A key goes to the daemon that owns it by the rule
engines use (:mod:`kvtier.client.routing`): over the ``HOST:PORT`` names of a
target list, over the node ids of a cluster's members (``etcd://``, read once
when the job connects: a member that joins or leaves mid-run is not followed)."""
from __future__ import annotations

import asyncio
from typing import Sequence

import numpy as np

from kvtier.client.cluster_members import ClusterUnavailable, MemberView, open_members
from kvtier.client.routing import Rendezvous

from .ioengines import make_client
from .result import ConnectError
from .targets import Targets

CONNECT_TIMEOUT_S = 10.0  # a daemon that does not answer a PING in this long is unreachable
REQUEST_TIMEOUT_S = 60.0  # one request (a batch of blocks) over loopback or a LAN
POOL_SIZE_MAX = 16  # connections per daemon per clone; pipelining covers deeper queues


class Connections:
    """Async context manager over a job's targets."""

    def __init__(self, targets: Targets, token: str | None, iodepth: int, ioengine: str = "sync"):
        self.targets = targets
        self.ioengine = ioengine
        self.iodepth = iodepth
        self.token = token
        self.pool_size = max(1, min(iodepth, POOL_SIZE_MAX))
        self.clients: list = []  # clients[i] talks to routing.members[i]
        self.addrs = [t.addr for t in targets.tcp]  # for a cluster, its members' addresses once connected
        self.routing = Rendezvous(self.addrs) if targets.cluster is None else None
        self.direct = None  # a kvtier.client.direct_reader.DirectReader when target=direct:

    async def __aenter__(self) -> "Connections":
        if self.targets.cluster is not None:
            view = await asyncio.to_thread(_read_members, self.targets.cluster.text)
            self.routing, self.addrs = view.rendezvous(), list(view.addresses)
        where = "?"
        try:
            for addr in self.addrs:
                where = addr
                client = make_client(self.ioengine, addr, self.token, self.pool_size, REQUEST_TIMEOUT_S,
                                     self.iodepth)
                self.clients.append(client)
                await asyncio.wait_for(client.ping(), CONNECT_TIMEOUT_S)
        except BaseException as e:
            await self.close()
            if isinstance(e, (asyncio.CancelledError, KeyboardInterrupt)):
                raise
            raise ConnectError(f"cannot use target tcp://{where}: {_describe(e)}") from e
        if self.targets.direct is not None:
            await self._open_direct()
        return self

    async def _open_direct(self) -> None:
        from kvtier.client.direct_reader import DirectReader

        geometry = await self.clients[0].geometry()
        mapping = self.targets.direct.for_devices(tuple(geometry.device_ids))
        try:
            self.direct = DirectReader(geometry, mapping)
        except (OSError, ValueError) as e:
            raise ConnectError(f"direct reads: {e}") from e

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self.direct is not None:
            self.direct.close()
            self.direct = None
        clients, self.clients = self.clients, []
        for c in clients:
            await c.close()

    def owners(self, keys: Sequence[bytes]) -> np.ndarray:
        """The index into ``clients`` of each key's owner."""
        return self.routing.owners(keys)

    def by_owner(self, keys: Sequence[bytes]) -> list[tuple[object, list[int]]]:
        """(client, ascending positions in ``keys`` of the keys its daemon owns) per owner."""
        return [(self.clients[t], idx) for t, idx in self.routing.groups(keys).items()]


def _read_members(url: str) -> MemberView:
    """The cluster's live members now; ConnectError when etcd does not answer or lists none."""
    try:
        members = open_members(url)
    except ClusterUnavailable as e:
        raise ConnectError(f"cannot use target {url}: {e}") from e
    try:
        view = members.current()
    finally:
        members.close()
    if not view.members:
        raise ConnectError(f"cannot use target {url}: the cluster has no live members")
    return view


def _describe(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return f"no answer to PING within {CONNECT_TIMEOUT_S:.0f} s"
    text = str(e) or type(e).__name__
    return f"{type(e).__name__}: {text}" if type(e).__name__ not in text else text
