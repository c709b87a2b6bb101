"""The client's own defence against a late NIXL WRITE: a NIXL_GET that ends before its reply (the
client timed out, the connection was lost) retires its destination buffer, so a WRITE the daemon
still makes lands nowhere a later request reads. A real kvtierd with its NIXL agent, this process's
real client agent, UCX on loopback; the daemon is held with SIGSTOP so the WRITE comes late."""
from __future__ import annotations

import gc
import os
import threading
import time

import pytest

nixl_api = pytest.importorskip("nixl_cu12._api", reason="NIXL is not installed (pip install 'kvtier[nixl]')")

from test_nixl_transport import LOOPBACK_ENV, NS, put_blocks, start_nixl_daemon  # noqa: E402
from kvtier.client import BlockClient  # noqa: E402
from kvtier.client.nixl_transport import NixlFetchFailed, NixlTransport  # noqa: E402
from kvtier.wire import connection as p  # noqa: E402

os.environ.update(LOOPBACK_ENV)
CLIENT_TIMEOUT_S = 1.0  # the client gives up on a NIXL_GET this soon (the daemon is stopped longer)
WAIT_S_MAX = 10.0  # for the stopped daemon, once resumed, to serve the abandoned NIXL_GET
POLL_S = 0.01
PATTERN = 0x5A  # what the next user of a destination buffer wrote there


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_nixl_daemon(tmp_path_factory.mktemp("kvtierd-nixl-late"))
    yield d
    assert d.stop() == 0, d.log_tail()



def transfers_served(addr: str) -> int:
    """The daemon's NIXL WRITEs that ended (done, failed or timed out), and its NIXL_GETs that ended with
    nothing posted (their client had given them up)."""
    with BlockClient(addr) as client:
        nixl = client.stats()["nixl"]
    return nixl["writes"] + nixl["failures"] + nixl["timeouts"] + nixl.get("gets_peer_gone", 0)


def test_a_late_write_of_an_abandoned_get_never_reaches_the_next_user_of_its_buffer(daemon):
    keys, blocks, locations = put_blocks(daemon.data_addr, 1, (1 << 20) - 64, seed=61)
    lengths, seqs = [loc.length for loc in locations], [loc.seq for loc in locations]
    transport = NixlTransport(daemon.data_addr, timeout_s=CLIENT_TIMEOUT_S)
    try:
        got = transport.get_many(keys, lengths, seqs, NS)  # the endpoint is wired up: WRITEs land without us
        assert bytes(got[0])[64:] == blocks[0][64:]
        del got
        served = transfers_served(daemon.data_addr)
        with daemon.stopped():
            with pytest.raises(p.ConnectionLost, match="no reply"):
                transport.get_many(keys, lengths, seqs, NS)
            gc.collect()  # no view of the abandoned request's buffer is left anywhere
            held = transport.agent.take_buffer(lengths[0])  # what the next NIXL_GET would be written into
            held[:lengths[0]] = bytes([PATTERN]) * lengths[0]
        deadline = time.monotonic() + WAIT_S_MAX
        while transfers_served(daemon.data_addr) == served:  # resumed, it serves the abandoned NIXL_GET
            assert time.monotonic() < deadline, daemon.log_tail()
            threading.Event().wait(POLL_S)
        assert bytes(held[:lengths[0]]) == bytes([PATTERN]) * lengths[0], "a late WRITE landed in a reused buffer"
        assert transport.statistics().buffers_retired == 1
        del held
        got = transport.get_many(keys, lengths, seqs, NS)  # the daemon knows the fresh buffer: NIXL serves on
        assert bytes(got[0])[64:] == blocks[0][64:] and transport.statistics().buffers_retired == 1
    finally:
        transport.close()


def test_a_refusal_before_any_write_keeps_the_buffer(daemon):
    keys, _, locations = put_blocks(daemon.data_addr, 1, 50_000, seed=62)
    transport = NixlTransport(daemon.data_addr)
    try:
        with pytest.raises(NixlFetchFailed, match="refused"):  # a descriptor too small: BAD_REQUEST
            transport.get_many(keys, [locations[0].length // 2], [locations[0].seq], NS)
        stats = transport.statistics()
        assert stats.refused == 1 and stats.buffers_retired == 0
    finally:
        transport.close()


def test_a_retired_buffer_is_never_handed_out_nor_freed(daemon):
    transport = NixlTransport(daemon.data_addr)
    agent = transport.agent
    try:
        view = agent.take_buffer(1 << 20)
        retired, generation = view.obj, agent.generation
        agent.retire(view)
        del view
        assert agent.generation == generation + 1  # the daemons are told at the next NIXL_METADATA
        for _ in range(3):
            assert agent.take_buffer(1 << 20).obj is not retired
        assert any(buf is retired for buf in agent._retired)  # kept: a late WRITE lands in memory nobody else has
    finally:
        transport.close()


def test_a_closed_transport_refuses_new_requests(daemon):
    keys, _, locations = put_blocks(daemon.data_addr, 1, 5000, seed=63)
    transport = NixlTransport(daemon.data_addr)
    transport.close()
    with pytest.raises(p.ClientError, match="closed"):
        transport.get_many(keys, [locations[0].length], [locations[0].seq], NS)
