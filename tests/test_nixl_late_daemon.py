"""The daemon's side of a late NIXL WRITE: it posts nothing for a client that has shut down its side
of the connection, and a WRITE it gave up on keeps its source buffer until NIXL has finished with it.

A real kvtierd with its NIXL agent, this process's real client agent, UCX on loopback. The daemon is
held with SIGSTOP so the client gives up first; a client that stops progressing its agent makes a
WRITE over TCP time out in the daemon (a software-emulated WRITE moves only while the target
progresses).
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

nixl_api = pytest.importorskip("nixl_cu12._api", reason="NIXL is not installed (pip install 'kvtier[nixl]')")

from test_nixl_transport import LOOPBACK_ENV, NS, put_blocks, start_nixl_daemon  # noqa: E402
from kvtier.client import BlockClient  # noqa: E402
from kvtier.client import nixl_transport  # noqa: E402
from kvtier.client.nixl_transport import NixlTransport  # noqa: E402
from kvtier.client.scatter_plan import LandedBlock, Landing  # noqa: E402
from kvtier.common.blockformat import HEADER_SIZE  # noqa: E402
from kvtier.daemon.server.arenas import GET_ARENA_BYTES_MAX  # noqa: E402
from kvtier.wire import connection as p  # noqa: E402

os.environ.update(LOOPBACK_ENV)
CLIENT_TIMEOUT_S = 1.0  # the client gives up on a NIXL_GET this soon (the daemon is stopped longer)
RESUME_AFTER_S = 2.5  # the stopped daemon is resumed this long after the NIXL_GET went out
SCATTER_PAYLOAD_BYTES = (4 << 20) - HEADER_SIZE  # one WRITE part
LARGE_PAYLOAD_BYTES = GET_ARENA_BYTES_MAX - (72 << 10) - HEADER_SIZE  # one arena: far more than the socket buffers
DRAIN_S = 2.0  # our agent progressed this long: what a WRITE left on its way lands
POLL_S = 0.001


@pytest.fixture(scope="module", params=["sm", "tcp"])
def daemon(request, tmp_path_factory):
    tls = () if request.param == "sm" else ("--nixl-tls", "self,tcp")
    d = start_nixl_daemon(tmp_path_factory.mktemp(f"kvtierd-nixl-late-daemon-{request.param}"), *tls)
    d.tls = request.param
    yield d
    assert d.stop() == 0, d.log_tail()


def _nixl_stats(addr: str) -> dict:
    with BlockClient(addr) as client:
        return client.stats()["nixl"]


def _landing(region: bytearray) -> Landing:
    return Landing(HEADER_SIZE, lambda _i, _g: [memoryview(region)], memoryview(region))


@pytest.mark.slow  # waits out a NIXL timeout or bound
def test_a_get_read_after_its_client_shut_down_its_side_writes_nothing(daemon):
    keys, blocks, locations = put_blocks(daemon.data_addr, 1, SCATTER_PAYLOAD_BYTES, seed=81)
    lengths, seqs = [loc.length for loc in locations], [loc.seq for loc in locations]
    region = bytearray(SCATTER_PAYLOAD_BYTES)  # the caller's memory
    transport = NixlTransport(daemon.data_addr, timeout_s=CLIENT_TIMEOUT_S)
    try:
        lent = transport.agent.lend(memoryview(region))
        lent.__enter__()
        got = transport.get_many(keys, lengths, seqs, NS, landing=_landing(region))
        assert isinstance(got[0], LandedBlock) and bytes(region) == blocks[0][HEADER_SIZE:]
        del got
        region[:] = bytes(SCATTER_PAYLOAD_BYTES)
        before = _nixl_stats(daemon.data_addr)
        # the client gives up, shuts down its side and waits for the daemon to end the request
        with daemon.stopped(resume_after_s=RESUME_AFTER_S), pytest.raises(p.ConnectionLost, match="no reply"):
            transport.get_many(keys, lengths, seqs, NS, landing=_landing(region))
        written = len(region) - region.count(0)
        assert written == 0, f"the daemon wrote {written} bytes for a client that had given up"
        after = _nixl_stats(daemon.data_addr)
        assert after["writes"] == before["writes"] and after["timeouts"] == before["timeouts"]
        assert after["gets_peer_gone"] == before.get("gets_peer_gone", 0) + 1
        assert transport.statistics().scatters_settled == 1
        got = transport.get_many(keys, lengths, seqs, NS, landing=_landing(region))  # NIXL serves on
        assert isinstance(got[0], LandedBlock) and bytes(region) == blocks[0][HEADER_SIZE:]
        lent.__exit__(None, None, None)
    finally:
        transport.close()


@pytest.mark.slow  # waits out a NIXL timeout or bound
def test_a_source_buffer_of_a_write_given_up_on_is_not_reused_while_nixl_may_still_read_it(daemon, monkeypatch):
    """Over TCP a WRITE the daemon released after its timeout still moves at the next progress of both
    agents, read from its source then: that source must still hold the first block, not the next
    request's (here a TCP GET, which reads its block into the arena the daemon gives back last)."""
    if daemon.tls != "tcp":
        pytest.skip("over shared memory the daemon's WRITE completes without the client's progress")
    keys, _, locations = put_blocks(daemon.data_addr, 2, LARGE_PAYLOAD_BYTES, seed=82)
    small_keys, _, small_locations = put_blocks(daemon.data_addr, 1, 10_000, seed=83)
    lengths, seqs = [loc.length for loc in locations], [loc.seq for loc in locations]
    transport = NixlTransport(daemon.data_addr)
    try:
        del transport.get_many(keys[:1], lengths[:1], seqs[:1], NS)[0]  # the endpoint is wired up, the buffer
        before = _nixl_stats(daemon.data_addr)  # holds the first block
        with monkeypatch.context() as patch:
            patch.setattr(transport.agent, "progress", lambda: None)
            with pytest.raises(nixl_transport.NixlFetchFailed, match="TIMEOUT"):
                transport.get_many(keys[:1], lengths[:1], seqs[:1], NS)
        target = np.frombuffer(transport.agent._retired[-1], np.uint8)[:lengths[0]]  # where the late WRITE lands
        first = target.copy()
        parked = _nixl_stats(daemon.data_addr)
        with BlockClient(daemon.data_addr) as client:  # the next request, read into a daemon buffer
            assert client.get_many(keys[1:], ns_id=NS)[0] is not None
        got = transport.get_many(small_keys, [small_locations[0].length], [small_locations[0].seq], NS)
        assert got[0] is not None  # a WRITE after it on the same endpoint: both agents progress
        del got
        drained = time.monotonic() + DRAIN_S
        while time.monotonic() < drained:
            transport.agent.progress()
            threading.Event().wait(POLL_S)
        assert np.array_equal(target, first), \
            f"{int(np.count_nonzero(target != first))} bytes of another block landed where the late WRITE went"
        assert parked.get("writes_parked", 0) == before.get("writes_parked", 0) + 1 and parked["parked_now"] == 1
        after = _nixl_stats(daemon.data_addr)  # NIXL has ended it: its buffer is back
        assert after["parked_now"] == 0 and after["parked_bytes"] == 0
        with BlockClient(daemon.data_addr) as client:
            assert client.stats()["buffers"]["lent"] == 0
    finally:
        transport.close()
