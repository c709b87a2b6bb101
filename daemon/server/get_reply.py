"""GET: the blocks located, laid out in one page-aligned reply buffer, read into it, sent from it.

The blocks are located first, so the reply's size is known before a byte is
read: blocks in order while they fit one reply's payload limit and one arena;
the rest come back DEFERRED for the client to ask again (always at least one
block is answered). Each found block gets a slot of the reply buffer that
holds its page-aligned range, and is read straight into it
(``Engine.get_many_placed``: one device read, no copy) and sent from where it
landed. The buffer is the arena the request borrowed or, when every arena is
lent or one block is larger than an arena, a transient buffer of its own
(:mod:`.request_buffers`); the server gives it back once the reply is sent.

Header, key and seq are always checked; the payload CRC too unless the reader
says it checks it itself (``reader_verifies``: once, end to end). A reader's
second try after a mismatch leaves the flag out, so a block corrupt on flash
is found and dropped here.

::

    keys     k0              k1 (absent)   k2              k3 ...  (past a limit: DEFERRED)
    buffer   [ slot of k0   ][ slot of k2                 ]
    slot     [pad| block |pad]   the block's page-aligned range: the block lies at its offset within its first page
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvtier.common.aligned import ALIGNMENT_BYTES
from kvtier.daemon.engine import EngineError
from kvtier.daemon.server.request_buffers import RequestBuffers
from kvtier.daemon.server.session import Session
from kvtier.wire import connection as p

READ_CHUNK_BYTES = 16 << 20  # reply_in_chunks: the blocks read before the caller may send them
GET_READ_TRIES = 3  # a block can grow between locating and reading (deleted and put again): locate anew,
# this many times in all, before the engine's refusal becomes the reply


def packed_keys(keys) -> bytes:
    """The keys as one buffer of count x 16 bytes (kept by the parser; joined otherwise)."""
    packed = getattr(keys, "packed", None)
    return packed if packed is not None else b"".join(keys)


@dataclass(frozen=True)
class ReplyLayout:
    """Which keys one GET reply answers and where their blocks go in its buffer."""

    answered: int  # keys [0, answered) are answered (a block or a miss); the rest are DEFERRED
    hits: list[int]  # the answered keys found when located, in order
    slot_starts: list[int]  # per hit: where its slot begins in the reply buffer
    slot_bytes: list[int]  # per hit: its slot's size (the block's page-aligned range)
    buffer_bytes: int  # the reply buffer's size: every slot, at least one page
    lengths: list[int]  # per hit: the block's length when located


def lay_out_reply(locations: np.ndarray, payload_bytes_max: int, arena_bytes: int) -> ReplyLayout:
    """The layout of one reply over ``locations`` (``Engine.locate_buffer`` rows, one per key)."""
    lengths = np.where(locations["found"], locations["length"], 0).astype(np.int64)
    answered = max(1, int(np.searchsorted(np.cumsum(lengths), payload_bytes_max, side="right")))
    hits = np.nonzero(lengths[:answered])[0]
    first = locations["logical_offset"][hits].astype(np.int64)
    spans = (-(-(first + lengths[hits]) // ALIGNMENT_BYTES) - first // ALIGNMENT_BYTES) * ALIGNMENT_BYTES
    fit = max(1, int(np.searchsorted(np.cumsum(spans), arena_bytes, side="right")))
    if fit < len(hits):  # a reply fills one arena at most: the rest wait (DEFERRED) for the next request
        answered, hits, spans = int(hits[fit]), hits[:fit], spans[:fit]
    starts = np.cumsum(spans) - spans
    return ReplyLayout(answered, hits.tolist(), starts.tolist(), spans.tolist(),
                       max(int(spans.sum()), ALIGNMENT_BYTES), lengths[hits].tolist())


class GetReplies:
    """Answers GET requests from one engine, in buffers lent by ``buffers``."""

    def __init__(self, engine, buffers: RequestBuffers, limits: p.Limits, stats):
        self._engine = engine
        self._buffers = buffers
        self._limits = limits
        self._stats = stats

    def reply(self, msg: p.Get, session: Session) -> p.GetReply:
        if not msg.keys:
            return p.GetReply(msg.request_id, ())
        for attempt in range(GET_READ_TRIES):
            layout, slots, located = self._lay_out(msg, session)
            try:
                placed = self._engine.get_many_placed([msg.keys[i] for i in layout.hits], slots,
                                                      verify_payload=not msg.reader_verifies, located=located)
                break
            except EngineError:  # a block outgrew its slot since it was located: locate it again
                if attempt + 1 == GET_READ_TRIES:
                    raise
                self._buffers.release_transient(session)  # a buffer of its own, if it had one: reserved anew
        return self._reply(msg, layout, slots, placed)

    def reply_in_chunks(self, msg: p.Get, session: Session, on_layout: Callable[[ReplyLayout], None],
                        on_chunk: Callable[[dict[int, memoryview]], None],
                        chunk_bytes: int = READ_CHUNK_BYTES) -> p.GetReply:
        """As :meth:`reply`, read a chunk of about ``chunk_bytes`` of blocks at a time, so that a
        caller can send one chunk while the next is read: ``on_layout(layout)`` before anything is
        read (it may raise, and nothing is read), then ``on_chunk({key index: block})`` after each
        chunk. A chunk whose block grew past its slot since it was located comes back DEFERRED
        (the reader asks again); its blocks were never handed to ``on_chunk``."""
        if not msg.keys:
            return p.GetReply(msg.request_id, ())
        layout, slots, located = self._lay_out(msg, session)
        on_layout(layout)
        keys = [msg.keys[i] for i in layout.hits]
        placed: list = [None] * len(layout.hits)
        deferred: list[int] = []
        start = 0
        while start < len(keys):
            end, size = start + 1, layout.slot_bytes[start]
            while end < len(keys) and size + layout.slot_bytes[end] <= chunk_bytes:
                size += layout.slot_bytes[end]
                end += 1
            try:
                placed[start:end] = self._engine.get_many_placed(keys[start:end], slots[start:end],
                                                                 verify_payload=not msg.reader_verifies,
                                                                 located=located[start:end])
            except EngineError:
                deferred += layout.hits[start:end]
            else:
                on_chunk({layout.hits[j]: slots[j][where[0]:where[0] + where[1]]
                          for j, where in zip(range(start, end), placed[start:end]) if where is not None})
            start = end
        reply = self._reply(msg, layout, slots, placed)
        if not deferred:
            return reply
        blocks = list(reply.blocks)
        for i in deferred:
            blocks[i] = p.DEFERRED
        return p.GetReply(msg.request_id, tuple(blocks))

    def _lay_out(self, msg: p.Get, session: Session) -> tuple[ReplyLayout, list[memoryview], np.ndarray]:
        """The reply's layout over the keys' current locations, its slots in a buffer lent for it, and
        the answered hits' locations (read there: the keys are resolved once)."""
        locations = self._engine.locate_buffer(packed_keys(msg.keys), for_read=True)
        layout = lay_out_reply(locations, self._limits.payload_bytes_max, self._buffers.arenas.arena_bytes)
        buffer = self._buffers.reply_buffer(session, layout.buffer_bytes)
        return layout, [buffer[start:start + size] for start, size in zip(layout.slot_starts, layout.slot_bytes)], \
            locations[layout.hits]

    def _reply(self, msg: p.Get, layout: ReplyLayout, slots: list, placed: list) -> p.GetReply:
        blocks: list = [None] * layout.answered + [p.DEFERRED] * (len(msg.keys) - layout.answered)
        for i, slot, where in zip(layout.hits, slots, placed):
            if where is not None:
                blocks[i] = slot[where[0]:where[0] + where[1]]
        hits = sum(where is not None for where in placed)
        self._engine.record_misses(layout.answered - len(layout.hits))  # absent when located: never read
        self._stats.namespace(msg.ns_id, hits, layout.answered - hits)
        return p.GetReply(msg.request_id, tuple(blocks))
