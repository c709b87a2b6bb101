"""The daemon's side of a late NIXL READ (a NIXL_PUT's): a READ given up on while a part is still in
flight keeps the memory it was pointed at out of use until NIXL has ended it, so its late bytes never
land in a block stored since; and a client that leaves transfers in flight gets nothing more posted.

A real kvtierd with its NIXL agent over UCX TCP on loopback, where a READ is emulated in software and
moves only while the client progresses its agent: this process stops progressing it, so the daemon's
READ times out (TRANSFER_TIMEOUT_S) with a part in flight; progressing again lets the late bytes move.
"""
from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager

import pytest

pytest.importorskip("nixl_cu12._api", reason="NIXL is not installed (pip install 'kvtier[nixl]')")

from nixl_daemon import start_misbehaving_peer  # noqa: E402
from test_nixl_transport import LOOPBACK_ENV, NS, put_blocks, start_nixl_daemon  # noqa: E402
from kvtier.client import BlockClient  # noqa: E402
from kvtier.client.nixl_transport import NixlFetchFailed, NixlTransport  # noqa: E402
from kvtier.common.blockformat import encode_block  # noqa: E402

os.environ.update(LOOPBACK_ENV)
PAYLOAD_BYTES = (8 << 20) - 64  # one block: far more than the socket buffers hold
STOPPED_CLIENTS = 2
DRAIN_S = 3.0  # both agents progressed this long: what the READ left on its way lands
POLL_S = 0.01
STALL_WAIT_S = 20.0  # the daemon's TRANSFER_TIMEOUT_S (5 s), with room on a loaded machine


@pytest.fixture
def daemon(tmp_path):
    d = start_nixl_daemon(tmp_path / "kvtierd", "--nixl-tls", "self,tcp")
    yield d
    assert d.stop() == 0, d.log_tail()


def _nixl_stats(addr: str) -> dict:
    with BlockClient(addr) as client:
        return client.stats()["nixl"]


@contextmanager
def _stalled_put(transport: NixlTransport, monkeypatch, seed: int, payload_bytes: int = PAYLOAD_BYTES):
    """A NIXL_PUT whose READ the daemon gives up on: this agent does not progress while it waits for the
    reply, and its block stays lent (a client that stalls serves the READ from memory still lent to
    NIXL once it progresses again, before it reads the reply)."""
    key = bytes([seed]) * 16
    block = bytearray(encode_block(key, NS, 0, os.urandom(payload_bytes)))
    with transport.agent.lend(memoryview(block)):
        with monkeypatch.context() as patch:
            patch.setattr(transport.agent, "progress", lambda: None)
            with pytest.raises(NixlFetchFailed, match="TIMEOUT"):
                transport.put_many([(key, block)], ns_id=NS)
        yield


def _drain(transport: NixlTransport, keys, lengths, seqs) -> None:
    """Progress our agent, and have the daemon progress its own (it does while it waits on a WRITE)."""
    end = time.monotonic() + DRAIN_S
    while time.monotonic() < end:
        transport.agent.progress()
        try:
            del transport.get_many(keys, lengths, seqs, NS)[0]
        except NixlFetchFailed:
            pass  # refused while a transfer of ours is still parked there: our progress ends it
        threading.Event().wait(POLL_S)


@pytest.mark.slow  # waits out a NIXL timeout or bound
def test_the_late_bytes_of_a_put_read_given_up_on_never_land_in_a_block_stored_since(daemon, monkeypatch):
    small_keys, _, small = put_blocks(daemon.data_addr, 1, 10_000, seed=91)
    lengths, seqs = [small[0].length], [small[0].seq]
    transport = NixlTransport(daemon.data_addr, timeout_s=60.0)
    try:
        del transport.get_many(small_keys, lengths, seqs, NS)[0]  # the agents' endpoint is wired up
        # two PUTs of a 32 MiB block: two transient request buffers, PARKED_BYTES_PER_PEER_MAX (64 MiB) together
        with _stalled_put(transport, monkeypatch, seed=0x92, payload_bytes=(32 << 20) - 64), \
                _stalled_put(transport, monkeypatch, seed=0x93, payload_bytes=(32 << 20) - 64):
            stalled = _nixl_stats(daemon.data_addr)
            assert stalled["timeouts"] == 2 and stalled["reads_parked"] == 2 and stalled["parked_now"] == 2
            assert stalled["parked_bytes"] >= 64 << 20  # the request buffer the READ may still land in
            with monkeypatch.context() as patch:  # a client holding that much gets nothing more posted
                patch.setattr(transport.agent, "progress", lambda: None)
                with pytest.raises(NixlFetchFailed, match="PARKED_BYTES_PER_PEER_MAX"):
                    transport.get_many(small_keys, lengths, seqs, NS)
            assert _nixl_stats(daemon.data_addr)["refused_parked"] == 1
            # the room that PUT had in the open region: a durable PUT of another block is stored there
            key = bytes([0x9a]) * 16
            block = encode_block(key, NS, 0, os.urandom(PAYLOAD_BYTES))
            with BlockClient(daemon.data_addr) as client:
                client.put_many([(key, block)], durable=True)
            _drain(transport, small_keys, lengths, seqs)
        with BlockClient(daemon.data_addr) as client:
            got = client.get(key)
            assert got is not None, "the block stored after the abandoned READ was corrupted (a miss)"
            assert bytes(got)[64:] == block[64:]
        drained = _nixl_stats(daemon.data_addr)
        assert drained["parked_now"] == 0 and drained["parked_bytes"] == 0  # NIXL ended it: its memory is free
        assert transport.get_many(small_keys, lengths, seqs, NS)[0] is not None  # and this client is served again
    finally:
        transport.close()
    daemon.kill()  # what is on flash is what a restart serves
    daemon.restart()
    with BlockClient(daemon.data_addr) as client:
        got = client.get(key)
        assert got is not None and bytes(got)[64:] == block[64:]
        assert client.get(bytes([0x92]) * 16) is None and client.get(bytes([0x93]) * 16) is None  # the PUT that failed


@pytest.mark.slow  # waits out a NIXL timeout or bound
def test_a_put_read_given_up_on_keeps_its_request_buffer_until_nixl_ends_it(daemon, monkeypatch):
    """The request buffer (an arena) a READ given up on may still land in stays lent until NIXL ends it."""
    small_keys, _, small = put_blocks(daemon.data_addr, 1, 10_000, seed=94)
    lengths, seqs = [small[0].length], [small[0].seq]
    key = bytes([0x95]) * 16
    with BlockClient(daemon.data_addr) as client:
        client.put_many([(key, encode_block(key, NS, 0, os.urandom(PAYLOAD_BYTES)))])
    transport = NixlTransport(daemon.data_addr, timeout_s=60.0)
    try:
        del transport.get_many(small_keys, lengths, seqs, NS)[0]
        with _stalled_put(transport, monkeypatch, seed=0x95):
            stalled = _nixl_stats(daemon.data_addr)
            assert stalled["reads_parked"] == 1 and stalled["parked_now"] == 1
            assert stalled["parked_bytes"] >= PAYLOAD_BYTES
            with BlockClient(daemon.data_addr) as client:
                assert client.stats()["buffers"]["lent"] == 1  # the arena the READ may still land in
            _drain(transport, small_keys, lengths, seqs)
        drained = _nixl_stats(daemon.data_addr)
        assert drained["parked_now"] == 0 and drained["parked_bytes"] == 0 and drained["refused_parked"] == 0
        with BlockClient(daemon.data_addr) as client:
            assert client.stats()["buffers"]["lent"] == 0
    finally:
        transport.close()


def _wait_for(addr: str, field: str, value: int) -> dict:
    deadline = time.monotonic() + STALL_WAIT_S
    while (stats := _nixl_stats(addr)).get(field) != value:  # a STATS read also reaps what has ended
        assert time.monotonic() < deadline, f"{field} stayed {stats.get(field)}, not {value}: {stats}"
        threading.Event().wait(0.1)
    return stats


@pytest.mark.slow  # waits out a NIXL timeout or bound
def test_buffers_held_for_stopped_clients_are_given_back_when_those_clients_die(daemon):
    """Each client stopped mid NIXL_PUT holds its request buffer; others are served meanwhile; a client
    that dies ends its READ, and the buffer goes back to the pool."""
    children = []
    try:
        for i in range(STOPPED_CLIENTS):
            children.append(start_misbehaving_peer(daemon.data_addr, "put-stop", NS, [bytes([0xa0, i]) * 8],
                                                   [PAYLOAD_BYTES + 64]))
            _wait_for(daemon.data_addr, "reads_parked", i + 1)
        assert _nixl_stats(daemon.data_addr)["parked_now"] == STOPPED_CLIENTS
        transport = NixlTransport(daemon.data_addr, timeout_s=60.0)
        try:
            before = _nixl_stats(daemon.data_addr)
            key = bytes([0xa8]) * 16
            block = encode_block(key, NS, 0, os.urandom(1 << 20))
            transport.put_many([(key, block)], ns_id=NS)
            assert _nixl_stats(daemon.data_addr)["put_blocks"] == before["put_blocks"] + 1
            for child in children:  # its READ fails with its endpoint: the buffer it held is given back
                child.kill()
                child.wait()
            _wait_for(daemon.data_addr, "parked_now", 0)
            with BlockClient(daemon.data_addr) as client:
                assert client.stats()["buffers"]["lent"] == 0
            key = bytes([0xa9]) * 16
            transport.put_many([(key, encode_block(key, NS, 0, os.urandom(1 << 20)))], ns_id=NS)
            assert _nixl_stats(daemon.data_addr)["put_blocks"] == before["put_blocks"] + 2
        finally:
            transport.close()
        with BlockClient(daemon.data_addr) as client:
            assert bytes(client.get(bytes([0xa8]) * 16))[64:] == block[64:]
            assert all(client.get(bytes([0xa0, i]) * 8) is None for i in range(STOPPED_CLIENTS))
    finally:
        for child in children:
            child.kill()
            child.wait()
