"""GetReplies.reply_in_chunks: a GET's blocks read a chunk at a time, each handed over before the
next is read (the NIXL GET sends one while it reads the next); the layout first, before any read."""
from __future__ import annotations

import os

import pytest

from kvtier.common.blockformat import HEADER_SIZE, encode_block
from kvtier.daemon.engine import EngineError
from kvtier.daemon.server.arenas import ReplyArenas
from kvtier.daemon.server.get_reply import GetReplies
from kvtier.daemon.server.request_buffers import RequestBuffers
from kvtier.daemon.server.session import Session
from kvtier.daemon.server.stats import ServerStatsRecorder
from kvtier.wire import connection as p

from test_engine import mem_engine, seal

NS = b"\x05" * 16


class CountingEngine:
    """The engine, with its reads recorded (and one call refused, where asked)."""

    def __init__(self, inner, refuse_call: int | None = None):
        self._inner, self.reads, self._refuse = inner, [], refuse_call

    def get_many_placed(self, keys, bufs, verify_payload=True, located=None):
        self.reads.append(len(keys))
        if len(self.reads) == self._refuse:
            raise EngineError("buffer of 4096 bytes is too small for the 8192-byte block")
        return self._inner.get_many_placed(keys, bufs, verify_payload, located)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.fixture
def stored():
    engine, _, _ = mem_engine(regions=8)
    keys = [bytes([9]) + i.to_bytes(15, "little") for i in range(6)]
    blocks = [encode_block(k, NS, 0, os.urandom(200_000 + 17 * i)) for i, k in enumerate(keys)]
    engine.put_many(blocks[:4])
    seal(engine)
    engine.put_many(blocks[4:])  # two still in the open region's image
    yield engine, keys, blocks
    engine.close()


def _replies(engine):
    return GetReplies(engine, RequestBuffers(ReplyArenas()), p.Limits(), ServerStatsRecorder())


def test_chunks_are_handed_over_in_order_and_the_reply_holds_every_block(stored):
    engine, keys, blocks = stored
    counting = CountingEngine(engine)
    events = []
    msg = p.Get(1, tuple(keys[:3]) + (b"\x01" * 16,) + tuple(keys[3:]), NS, True)
    reply = _replies(counting).reply_in_chunks(
        msg, Session("t", greeted=True), lambda layout: events.append(("layout", layout.hits, list(counting.reads))),
        lambda chunk: events.append(("chunk", {i: bytes(b)[HEADER_SIZE:] for i, b in chunk.items()})),
        chunk_bytes=450_000)  # two 200 KB blocks (page-aligned slots) a chunk
    assert events[0] == ("layout", [0, 1, 2, 4, 5, 6], [])  # before any read
    chunks = [e[1] for e in events[1:]]
    assert [sorted(c) for c in chunks] == [[0, 1], [2, 4], [5, 6]] and counting.reads == [2, 2, 2]
    expected = {i: b[HEADER_SIZE:] for i, b in zip([0, 1, 2, 4, 5, 6], blocks)}
    assert {i: d for c in chunks for i, d in c.items()} == expected
    assert reply.blocks[3] is None and all(bytes(reply.blocks[i])[HEADER_SIZE:] == d for i, d in expected.items())


def test_a_layout_the_caller_refuses_reads_nothing(stored):
    engine, keys, _ = stored
    counting = CountingEngine(engine)

    def refuse(layout):
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        _replies(counting).reply_in_chunks(p.Get(1, tuple(keys), NS, True), Session("t", greeted=True), refuse,
                                           lambda chunk: pytest.fail("a chunk after a refusal"))
    assert counting.reads == []


def test_a_chunk_whose_block_outgrew_its_slot_comes_back_deferred(stored):
    engine, keys, blocks = stored
    counting = CountingEngine(engine, refuse_call=2)
    chunks = []
    reply = _replies(counting).reply_in_chunks(p.Get(1, tuple(keys), NS, True), Session("t", greeted=True),
                                               lambda layout: None, lambda chunk: chunks.append(sorted(chunk)),
                                               chunk_bytes=450_000)
    assert chunks == [[0, 1], [4, 5]]  # the refused second chunk was never handed over
    assert reply.blocks[2] is p.DEFERRED and reply.blocks[3] is p.DEFERRED
    assert [bytes(reply.blocks[i])[HEADER_SIZE:] for i in (0, 1, 4, 5)] == [blocks[i][HEADER_SIZE:] for i in (0, 1, 4, 5)]
