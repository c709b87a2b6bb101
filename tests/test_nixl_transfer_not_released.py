"""A NIXL transfer that failed and that NIXL cannot release may still run: a READ may write into
the daemon's memory, a WRITE may send what that memory holds next. The transfer says so
(NixlTransferNotReleased), and a NIXL_PUT then fails the engine closed with the request buffer it
READ into still lent, so no later request is ever given memory late bytes may land in."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("nixl_cu12._api", reason="NIXL is not installed (pip install 'kvtier[nixl]')")

from nixl_daemon import LOOPBACK_ENV  # noqa: E402
from kvtier.common.blockformat import decode_header  # noqa: E402
from kvtier.daemon.nixl.agent import DaemonAgent, NixlTransferNotReleased, Transfer  # noqa: E402
from kvtier.daemon.nixl.puts import NixlPuts  # noqa: E402
from kvtier.daemon.server.arenas import ReplyArenas  # noqa: E402
from kvtier.daemon.server.request_buffers import RequestBuffers  # noqa: E402
from kvtier.daemon.server.session import Session  # noqa: E402
from kvtier.wire import connection as p  # noqa: E402
from kvtier.wire import events as m  # noqa: E402

from test_engine import block, mem_engine  # noqa: E402

os.environ.update(LOOPBACK_ENV)


class _StillInFlight:
    """A transfer handle NIXL refuses to release (it cannot cancel what is in flight)."""

    def release(self):
        raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")


@pytest.fixture(scope="module")
def agent():
    return DaemonAgent(loopback_only=True)


@pytest.mark.parametrize("op, still", [("READ", "write into"), ("WRITE", "read")])
def test_a_transfer_nixl_cannot_release_says_it_may_still_run(agent, op, still):
    transfer = Transfer(agent, "peer", 7, op=op)
    transfer._handles.append(_StillInFlight())
    with pytest.raises(NixlTransferNotReleased, match=f"may still {still} the memory"):
        transfer.__exit__(None, None, None)


class _AgentWhoseReadCannotBeReleased:
    """The daemon agent as seen by NixlPuts, with its READ ending the way the test above shows."""

    def transfer(self, peer: str, request_id: int, op: str = "WRITE", hold=None):
        inner = Transfer(self._real, peer, request_id, op, hold)
        inner._handles.append(_StillInFlight())
        return inner

    def __init__(self, real: DaemonAgent):
        self._real = real


def test_a_put_whose_read_cannot_be_released_fails_the_engine_closed_and_keeps_its_buffer(agent):
    engine, _, _ = mem_engine()
    buffers = RequestBuffers(ReplyArenas())
    puts = NixlPuts(_AgentWhoseReadCannotBeReleased(agent), engine, buffers, limits=p.Limits())
    blk = block(1, 4000)
    msg = m.NixlPut(3, (decode_header(blk).key,), "peer", ((((1 << 30), len(blk)),),), durable=True)
    session = Session("127.0.0.1:1")
    with pytest.raises(NixlTransferNotReleased):
        puts.put(msg, "peer", [len(blk)], session)
    assert engine.failure is not None and "could not be released" in engine.failure
    buffers.reply_sent(session)  # what the connection does after the error reply
    assert buffers.statistics().lent == 1, "the buffer a late READ may still write went back to the pool"
