"""A late NIXL WRITE of a scatter load never reaches the caller's memory after the load returned.

A scatter NIXL_GET (``load(out=...)``, a paged KV cache) has the daemon WRITE straight into memory the
caller owns and reuses once the load has failed. A NIXL_GET that gets no reply in time (the client
timed out, the connection was lost) is settled before the load returns: the client shuts down its
side of the control connection and waits for the daemon's reply or its close, which the daemon
sends only once the request's WRITEs are done or released. A real kvtierd with its NIXL agent, this
process's real client agent, UCX on loopback; the daemon is held with SIGSTOP so the WRITE comes late,
over shared memory and over TCP.
"""
from __future__ import annotations

import os
import threading
import time

import pytest

nixl_api = pytest.importorskip("nixl_cu12._api", reason="NIXL is not installed (pip install 'kvtier[nixl]')")

from test_nixl_late_write import transfers_served  # noqa: E402
from test_nixl_transport import LOOPBACK_ENV, NS, put_blocks, start_nixl_daemon  # noqa: E402
from kvtier.client import nixl_transport  # noqa: E402
from kvtier.client.nixl_transport import NixlTransport  # noqa: E402
from kvtier.client.scatter_plan import LandedBlock, Landing  # noqa: E402
from kvtier.common.blockformat import HEADER_SIZE  # noqa: E402
from kvtier.wire import connection as p  # noqa: E402

os.environ.update(LOOPBACK_ENV)
CLIENT_TIMEOUT_S = 1.0  # the client gives up on a NIXL_GET this soon (the daemon is stopped longer)
RESUME_AFTER_S = 2.5  # the stopped daemon is resumed this long after the NIXL_GET went out
WAIT_S_MAX = 15.0  # for the resumed daemon to serve the abandoned NIXL_GET
DRAIN_S = 1.0  # our agent progressed after that: a WRITE's bytes still on their way over TCP land
POLL_S = 0.01
PAYLOAD_BYTES = (4 << 20) - HEADER_SIZE  # a block of 4 MiB: one WRITE part
PATTERN = 0x5A  # what the caller writes into its memory once the load has failed


@pytest.fixture(scope="module", params=["sm", "tcp"])
def daemon(request, tmp_path_factory):
    tls = () if request.param == "sm" else ("--nixl-tls", "self,tcp")  # UCX picks what both agents allow
    d = start_nixl_daemon(tmp_path_factory.mktemp(f"kvtierd-nixl-late-scatter-{request.param}"), *tls)
    yield d
    assert d.stop() == 0, d.log_tail()


def _landing(region: bytearray) -> Landing:
    """The caller's memory as a load's landing: each block's payload goes to ``region``."""
    return Landing(HEADER_SIZE, lambda _i, _g: [memoryview(region)], memoryview(region))


def _wait_served(daemon, transport: NixlTransport, served: int) -> None:
    """Until the daemon has ended one more WRITE than ``served`` (done, or timed out: over TCP a WRITE
    moves only while we progress), then ``DRAIN_S`` of progress of our agent, as the process's other
    loads would make it: what a WRITE left on its way lands meanwhile."""
    deadline = time.monotonic() + WAIT_S_MAX
    while transfers_served(daemon.data_addr) == served:
        assert time.monotonic() < deadline, daemon.log_tail()
        threading.Event().wait(POLL_S)
    drained = time.monotonic() + DRAIN_S
    while time.monotonic() < drained:
        transport.agent.progress()
        threading.Event().wait(POLL_S / 10)


@pytest.mark.slow  # waits out a NIXL timeout or bound
def test_a_late_write_of_an_abandoned_scatter_get_never_reaches_the_callers_memory(daemon):
    keys, blocks, locations = put_blocks(daemon.data_addr, 1, PAYLOAD_BYTES, seed=71)
    lengths, seqs = [loc.length for loc in locations], [loc.seq for loc in locations]
    region = bytearray(PAYLOAD_BYTES)  # the caller's own memory: an engine's KV pages
    transport = NixlTransport(daemon.data_addr, timeout_s=CLIENT_TIMEOUT_S)
    try:
        lent = transport.agent.lend(memoryview(region))  # lent for good, as a connector lends its KV cache:
        lent.__enter__()  # a load then sends no NIXL_METADATA first, and its NIXL_GET is what goes unanswered
        got = transport.get_many(keys, lengths, seqs, NS, landing=_landing(region))
        assert isinstance(got[0], LandedBlock) and bytes(region) == blocks[0][HEADER_SIZE:]
        del got
        region[:] = bytes(PAYLOAD_BYTES)
        served = transfers_served(daemon.data_addr)
        with daemon.stopped(resume_after_s=RESUME_AFTER_S), pytest.raises(p.ConnectionLost, match="no reply"):
            transport.get_many(keys, lengths, seqs, NS, landing=_landing(region))
        region[:] = bytes([PATTERN]) * PAYLOAD_BYTES  # the load failed: the caller recomputes into its memory
        _wait_served(daemon, transport, served)
        assert region == bytes([PATTERN]) * PAYLOAD_BYTES, "a late WRITE landed in the caller's memory"
        stats = transport.statistics()
        assert stats.scatters_settled == 1 and stats.scatters_unsettled == 0
        got = transport.get_many(keys, lengths, seqs, NS, landing=_landing(region))  # NIXL serves on
        assert isinstance(got[0], LandedBlock) and bytes(region) == blocks[0][HEADER_SIZE:]
        lent.__exit__(None, None, None)
    finally:
        transport.close()


@pytest.mark.slow  # waits out a NIXL timeout or bound
def test_a_daemon_that_stays_stopped_past_the_settle_bound_is_counted_and_the_load_returns(daemon, monkeypatch):
    monkeypatch.setattr(nixl_transport, "SETTLE_TIMEOUT_S", 0.5)
    keys, _, locations = put_blocks(daemon.data_addr, 1, 100_000, seed=72)
    lengths, seqs = [loc.length for loc in locations], [loc.seq for loc in locations]
    region = bytearray(lengths[0] - HEADER_SIZE)
    transport = NixlTransport(daemon.data_addr, timeout_s=CLIENT_TIMEOUT_S)
    try:
        lent = transport.agent.lend(memoryview(region))
        lent.__enter__()
        transport.get_many(keys, lengths, seqs, NS, landing=_landing(region))
        served = transfers_served(daemon.data_addr)
        with daemon.stopped():
            started = time.monotonic()
            with pytest.raises(p.ConnectionLost, match="no reply"):
                transport.get_many(keys, lengths, seqs, NS, landing=_landing(region))
            assert time.monotonic() - started < CLIENT_TIMEOUT_S + 0.5 + WAIT_S_MAX / 3
        stats = transport.statistics()
        assert stats.scatters_unsettled == 1 and stats.scatters_settled == 0
        _wait_served(daemon, transport, served)  # the abandoned request ends before the next test's
        lent.__exit__(None, None, None)
    finally:
        transport.close()


@pytest.mark.slow  # waits out a NIXL timeout or bound
def test_a_write_the_daemon_gave_up_on_is_counted_unsettled(daemon, monkeypatch):
    """The daemon answers TIMEOUT once a WRITE is not done within its TRANSFER_TIMEOUT_S (here: nothing
    progresses our agent) and releases it; NIXL's release does not cancel it (over TCP its bytes land
    at our next progress), so the load is counted unsettled."""
    keys, _, locations = put_blocks(daemon.data_addr, 1, 100_000, seed=74)
    lengths, seqs = [loc.length for loc in locations], [loc.seq for loc in locations]
    region = bytearray(lengths[0] - HEADER_SIZE)
    transport = NixlTransport(daemon.data_addr)
    try:
        lent = transport.agent.lend(memoryview(region))
        lent.__enter__()
        transport.get_many(keys, lengths, seqs, NS, landing=_landing(region))
        with monkeypatch.context() as patch:
            patch.setattr(transport.agent, "progress", lambda: None)
            with pytest.raises(nixl_transport.NixlFetchFailed, match="TIMEOUT"):
                transport.get_many(keys, lengths, seqs, NS, landing=_landing(region))
        stats = transport.statistics()
        assert stats.scatters_unsettled == 1 and stats.scatters_settled == 0 and stats.refused == 1
        lent.__exit__(None, None, None)
    finally:
        transport.close()


def test_a_scatter_get_answered_in_time_is_not_settled(daemon):
    keys, blocks, locations = put_blocks(daemon.data_addr, 1, 100_000, seed=73)
    region = bytearray(locations[0].length - HEADER_SIZE)
    transport = NixlTransport(daemon.data_addr)
    try:
        got = transport.get_many(keys, [locations[0].length], [locations[0].seq], NS, landing=_landing(region))
        assert isinstance(got[0], LandedBlock) and bytes(region) == blocks[0][HEADER_SIZE:]
        stats = transport.statistics()
        assert stats.scatters_settled == stats.scatters_unsettled == 0 and stats.blocks_in_place == 1
    finally:
        transport.close()


@pytest.mark.slow  # waits out a NIXL timeout or bound
def test_a_pooled_output_an_unsettled_scatter_wrote_into_is_never_handed_out_again(daemon, monkeypatch):
    """The daemon stays stopped past the settle bound, so the load returns while its WRITE is still to
    come; the pooled output it scattered into is dropped by the caller. The pool never hands that
    buffer out again (the agent keeps it referenced), so the WRITE that comes once the daemon resumes
    lands where nobody else's data is."""
    from kvtier.client.output_buffers import OutputBuffers

    monkeypatch.setattr(nixl_transport, "SETTLE_TIMEOUT_S", 0.5)
    keys, blocks, locations = put_blocks(daemon.data_addr, 1, PAYLOAD_BYTES, seed=75)
    lengths, seqs = [loc.length for loc in locations], [loc.seq for loc in locations]
    pool = OutputBuffers(64 << 20)
    transport = NixlTransport(daemon.data_addr, timeout_s=CLIENT_TIMEOUT_S)
    try:
        output = pool.take(PAYLOAD_BYTES)
        region = memoryview(output)
        lent = transport.agent.lend(region)
        lent.__enter__()
        transport.get_many(keys, lengths, seqs, NS, landing=_landing(output))  # the endpoint is wired up
        output[:] = 0
        served = transfers_served(daemon.data_addr)
        with daemon.stopped(resume_after_s=RESUME_AFTER_S):
            with pytest.raises(p.ConnectionLost, match="no reply"):
                transport.get_many(keys, lengths, seqs, NS, landing=_landing(output))
            stats = transport.statistics()
            assert stats.scatters_unsettled == 1 and stats.quarantined_bytes >= PAYLOAD_BYTES
            lent.__exit__(None, None, None)
            del output, region, lent  # the caller lets go of its output: a pool would hand it out again
            others = [pool.take(PAYLOAD_BYTES) for _ in range(3)]  # the next loads' outputs
            for other in others:
                other[:] = PATTERN
        _wait_served(daemon, transport, served)
        for other in others:  # the late WRITE landed in none of them
            assert bytes(other[:PAYLOAD_BYTES]) == bytes([PATTERN]) * PAYLOAD_BYTES, "a late WRITE landed in reused memory"
        assert pool.statistics().buffers == 4  # the quarantined one is kept, not reused
    finally:
        transport.close()
