"""A client closed while one of its requests is in flight: that request's connection is closed
when it ends, never pooled again, and a later request raises ClientError. The daemon is a real
kvtierd, held with SIGSTOP so the request stays in flight while the client closes."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvtier.client import AsyncBlockClient, BlockClient
from kvtier.client.cluster_members import Member, MemberView
from kvtier.client.node_backoff import NodeBackoff
from kvtier.client.owner_pool import OwnerPool
from kvtier.client.warm_tier import Daemon
from kvtier.wire import connection as p

WAIT_S_MAX = 10.0  # for a thread of the test to get where it is going
POLL_S = 0.005


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S_MAX
    while not condition():
        assert time.monotonic() < deadline, f"not within {WAIT_S_MAX} s: {what}"
        threading.Event().wait(POLL_S)



def test_a_connection_whose_request_ends_after_close_is_closed_not_pooled(kvtierd):
    client = BlockClient(kvtierd.data_addr, pool_size=1)
    client.ping()
    (ch,) = list(client._pool.queue)
    answered: list[float] = []
    with kvtierd.stopped():
        request = threading.Thread(target=lambda: answered.append(client.ping()))
        request.start()
        wait_until(client._pool.empty, "the request takes the pooled connection")
        client.close()
    request.join(WAIT_S_MAX)
    assert answered and answered[0] > 0  # the request in flight finished normally
    assert client._pool.empty() and ch.sock.fileno() == -1  # and its connection was closed, not pooled
    with pytest.raises(p.ClientError, match="closed"):
        client.ping()


def test_an_async_connection_whose_request_ends_after_close_is_closed_not_pooled(kvtierd):
    async def run() -> None:
        client = AsyncBlockClient(kvtierd.data_addr, pool_size=1)
        await client.ping()
        (ch,) = client._pool
        with kvtierd.stopped():
            request = asyncio.create_task(client.ping())
            while client._pool:
                await asyncio.sleep(0)  # the request takes the pooled connection at its first step
            await client.close()
        assert await asyncio.wait_for(request, WAIT_S_MAX) > 0
        assert client._pool == [] and ch.writer.is_closing()
        with pytest.raises(p.ClientError, match="closed"):
            await client.ping()
    asyncio.run(run())


class _Members:
    """A membership whose view the test sets; ``probed`` is set once the probe thread has looked."""

    def __init__(self, address: str) -> None:
        self.view = MemberView((Member("node-a", address),), 1, "etcd://test/kv")
        self.probed = threading.Event()

    def current(self) -> MemberView:
        view = self.view
        if threading.current_thread().name == "kvtier-owner-probe":
            self.probed.set()
        return view

    def statistics(self) -> None:
        return None  # the watch's figures: none without a watch

    def close(self) -> None:
        pass


def test_a_member_that_leaves_while_its_probe_opens_it_is_not_kept_open(kvtierd):
    refused, opened = [True], []

    def open_daemon(address: str) -> Daemon:
        if refused[0]:
            raise p.ConnectionLost(f"cannot connect to {address}")
        client = BlockClient(address, timeout_s=WAIT_S_MAX)
        client.ping()  # opening talks to the daemon, as KVCache's opener does (HELLO, geometry)
        opened.append(client)
        return Daemon(address, client, None)
    members = _Members(kvtierd.data_addr)
    pool = OwnerPool(members, open_daemon, NodeBackoff(time.monotonic, backoff_s_min=0.02, backoff_s_max=0.05))
    try:
        with pool.batch() as batch:
            assert batch.daemons == (None,)  # could not be opened at the sync
            with kvtierd.stopped():
                refused[0] = False
                with pytest.raises(p.ConnectionLost):
                    batch.call(0, lambda d: d.client.ping())  # the member backs off: the probe opens it
                assert members.probed.wait(WAIT_S_MAX)  # the probe saw it a member and is opening it
                members.view = MemberView((), 2, "etcd://test/kv")  # it leaves
                with pool.batch() as later:
                    assert later.daemons == ()
        wait_until(lambda: opened and (opened[0]._closed or pool.statistics().connections_open), "the probe ends")
        assert pool.statistics().connections_open == 0 and opened[0]._closed
    finally:
        pool.close()
