"""Turns decoded data-protocol requests into engine calls and replies.

No sockets here: :class:`RequestHandler.handle` takes a request message and a
per-connection :class:`Session` and returns ``(reply, close_after)``. Engine
failures become error replies naming the problem; they never escape to the
connection loop as anything but a logged internal error.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from kvtier.wire import connection as p
from kvtier.wire import frames as frames
from kvtier.common.blockformat import BlockFormatError, decode_header
from kvtier.common.tokens import token_matches
from kvtier.common.aligned import ALIGNMENT_BYTES, aligned_buffer
from kvtier.daemon.server_arenas import GET_ARENA_BYTES_MAX, ReplyArenas  # noqa: F401  (re-exported)

log = logging.getLogger("kvtier.daemon.server")


@dataclass
class Session:
    """What the server knows about one connection."""

    peer: str
    greeted: bool = False  # its HELLO succeeded (with the token, when one is configured)
    authenticated: bool = False
    client_name: str = ""
    get_arena: memoryview | None = None  # borrowed from ReplyArenas for one request (its PUT payload or its
    # GET reply's blocks); given back once the reply is sent
    transient_bytes: int = 0  # this request's buffers outside the arenas (within the daemon-wide budget)


class TransientBudgetSpent(Exception):
    """The daemon-wide budget for request buffers outside the arenas is spent: answered BUSY."""


def packed_keys(keys) -> bytes:
    """The keys as one buffer of count x 16 bytes (kept by the parser; joined otherwise)."""
    packed = getattr(keys, "packed", None)
    return packed if packed is not None else b"".join(keys)


def geometry_doc(geometry) -> dict:
    return {"device_ids": list(geometry.device_ids), "stripe_size_bytes": geometry.stripe_size_bytes,
            "data_offset_bytes": geometry.data_offset_bytes, "device_data_bytes": geometry.device_data_bytes}


class RequestHandler:
    def __init__(self, engine, stats, token: Callable[[], str | None], region_size_bytes: int,
                 limits: p.Limits, server_statistics: Callable[[], dict], arenas: ReplyArenas | None = None):
        self._engine = engine
        self._stats = stats
        self._token = token
        self._region_size_bytes = region_size_bytes
        self._limits = limits
        self._server_statistics = server_statistics
        self.arenas = arenas if arenas is not None else ReplyArenas()
        from kvtier.daemon.engine import BlockTooLargeError, DeviceError, EngineError, NoSpaceError
        self._engine_error, self._no_space, self._too_large = EngineError, NoSpaceError, BlockTooLargeError
        # engine exceptions other than NoSpace, each with the code the client gets
        self._engine_codes = ((BlockTooLargeError, p.ErrorCode.TOO_LARGE), (DeviceError, p.ErrorCode.DEVICE_ERROR),
                              (EngineError, p.ErrorCode.BAD_REQUEST))
        self._dispatch = {
            p.Hello: self._hello, p.Lookup: self._lookup, p.Get: self._get, p.Put: self._put,
            p.Delete: self._delete, p.Pin: self._pin, p.Unpin: self._unpin, p.Flush: self._flush,
            p.Stats: self._stats_reply, p.Ping: self._ping,
        }

    def handle(self, msg, session: Session):
        """``(reply, close_after)`` for one request or Rejected event."""
        if not session.greeted and not isinstance(msg, p.Hello):
            # The server's Connection lets nothing but HELLO frames through before this; a HELLO it
            # refused (malformed, over its limits) ends the connection like any other first frame.
            code, why = (msg.code, msg.message) if isinstance(msg, p.Rejected) else \
                (p.ErrorCode.AUTH, f"got {type(msg).__name__}")
            self._stats.error(code.name)
            return p.ErrorReply(msg.request_id, code, f"the first frame must be a valid HELLO ({why}); closing"), True
        if isinstance(msg, p.Rejected):
            self._stats.error(msg.code.name)
            return p.ErrorReply(msg.request_id, msg.code, msg.message), False
        token = self._token()
        if token is not None and not session.authenticated and not isinstance(msg, p.Hello):
            self._stats.error(p.ErrorCode.AUTH.name)
            return p.ErrorReply(msg.request_id, p.ErrorCode.AUTH, "authenticate with HELLO and the token first"), True
        try:
            return self._dispatch[type(msg)](msg, session, token)
        except TransientBudgetSpent as exc:
            self._stats.error(p.ErrorCode.BUSY.name)
            return p.ErrorReply(msg.request_id, p.ErrorCode.BUSY, str(exc)), False
        except self._no_space as exc:
            self._stats.error(p.ErrorCode.NO_SPACE.name)
            return p.ErrorReply(msg.request_id, p.ErrorCode.NO_SPACE, f"no space: {exc}"), False
        except BlockFormatError as exc:
            self._stats.error(p.ErrorCode.BAD_BLOCK.name)
            return p.ErrorReply(msg.request_id, p.ErrorCode.BAD_BLOCK, str(exc)), False
        except self._engine_error as exc:
            code = next(code for kind, code in self._engine_codes if isinstance(exc, kind))
            self._stats.error(code.name)
            return p.ErrorReply(msg.request_id, code, str(exc)), False
        except Exception as exc:  # a bug or a device failure: this request fails, the daemon serves on
            log.exception("event=internal_error peer=%s op=%s", session.peer, type(msg).__name__)
            self._stats.error(p.ErrorCode.INTERNAL.name)
            return p.ErrorReply(msg.request_id, p.ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"), False

    def hello_info(self) -> dict:
        return {
            "server": "kvtierd", "protocol_version": p.PROTOCOL_VERSION,
            "auth_required": self._token() is not None, "features": [p.FEATURE_GET_READER_VERIFIES],
            "geometry": geometry_doc(self._engine.geometry),
            "region_size_bytes": self._region_size_bytes,
            "limits": {"batch_count_max": self._limits.batch_count_max, "meta_bytes_max": self._limits.meta_bytes_max,
                       "payload_bytes_max": self._limits.payload_bytes_max,
                       "block_bytes_max": self._limits.block_bytes_max},
        }

    def _hello(self, msg: p.Hello, session: Session, token):
        session.client_name = msg.client_name
        if token is not None:
            if not token_matches(msg.token, token):
                self._stats.error(p.ErrorCode.AUTH.name)
                log.warning("event=auth_failed peer=%s client=%r", session.peer, msg.client_name)
                reason = "missing token" if not msg.token else "wrong token"
                return p.ErrorReply(msg.request_id, p.ErrorCode.AUTH, f"authentication failed: {reason}"), True
            session.authenticated = True
        session.greeted = True
        return p.HelloReply(msg.request_id, self.hello_info()), False

    def _lookup(self, msg: p.Lookup, session, token):
        """The keys go to the engine as the one buffer they came in, and
        locations come back as columns that are encoded in one pass: nothing
        is done per key in Python."""
        keys = packed_keys(msg.keys)
        if msg.want_locations:
            rows = self._engine.locate_buffer(keys)
            found = rows["found"]
            leading = int(len(found) if found.all() else np.argmin(found))
            locations = frames.location_records(found, rows["logical_offset"], rows["length"], rows["seq"],
                                                rows["sealed"])
            reply = p.LookupReply(msg.request_id, leading, locations)
        else:
            leading = self._engine.lookup_buffer(keys)
            reply = p.LookupReply(msg.request_id, leading)
        self._stats.lookup(len(msg.keys), leading)
        self._stats.namespace(msg.ns_id, leading, len(msg.keys) - leading)
        return reply, False

    def _get(self, msg: p.Get, session: Session, token):
        """Blocks in order while they fit one reply's payload limit; the rest
        come back DEFERRED for the client to ask again (always at least one).

        The blocks are located first, so the reply's size is known before a
        byte is read; then each is read straight into a page-aligned reply
        arena this connection borrows from the daemon-wide pool -- its aligned
        range, one device read, sent from where it landed, no copy -- and the
        server gives the arena back once the reply is sent (:meth:`reply_sent`).
        With the pool spent, the blocks are copied instead. Header, key and
        seq are always checked here; payload CRCs too unless the reader says
        it checks them itself (``reader_verifies``: once, end to end). A
        reader's second try after a mismatch leaves the flag out, so a block
        corrupt on flash is found and dropped here."""
        keys = msg.keys
        if not keys:
            return p.GetReply(msg.request_id, ()), False
        rows = self._engine.locate_buffer(packed_keys(keys))
        lengths = np.where(rows["found"], rows["length"], 0).astype(np.int64)
        send = max(1, int(np.searchsorted(np.cumsum(lengths), self._limits.payload_bytes_max, side="right")))
        hit = np.nonzero(lengths[:send])[0]
        first = rows["logical_offset"][hit].astype(np.int64)
        spans = (-(-(first + lengths[hit]) // ALIGNMENT_BYTES) - first // ALIGNMENT_BYTES) * ALIGNMENT_BYTES
        fit = max(1, int(np.searchsorted(np.cumsum(spans), self.arenas.arena_bytes, side="right")))
        if fit < len(hit):  # a reply fills one arena at most: the rest wait (DEFERRED) for the next request
            send, hit, spans = int(hit[fit]), hit[:fit], spans[:fit]
        starts = (np.cumsum(spans) - spans).tolist()
        arena = self._reply_buffer(session, max(int(spans.sum()), ALIGNMENT_BYTES))
        if arena is None:  # every arena the daemon-wide budget allows is lent out
            return self._get_copying(msg, session, int(lengths[:send].sum()), send)
        targets = [arena[start:start + span] for start, span in zip(starts, spans.tolist())]
        try:
            placed = self._engine.get_many_placed([keys[i] for i in hit.tolist()], targets,
                                                  verify_payload=not msg.reader_verifies)
        except self._engine_error:  # a block grew since it was located (deleted and put again)
            self._release_transient(session)  # a buffer of its own, if it had one: the copying path reserves anew
            return self._get_copying(msg, session, int(lengths[:send].sum()), send)
        blocks: list = [None] * send + [p.DEFERRED] * (len(keys) - send)
        for i, target, where in zip(hit.tolist(), targets, placed):
            if where is not None:
                blocks[i] = target[where[0]:where[0] + where[1]]
        hits = sum(where is not None for where in placed)
        self._engine.record_misses(send - len(hit))  # absent at locate time: never read
        self._stats.namespace(msg.ns_id, hits, send - hits)
        return p.GetReply(msg.request_id, tuple(blocks)), False

    def _reply_buffer(self, session: Session, nbytes: int) -> memoryview | None:
        """A page-aligned buffer of at least ``nbytes`` for one GET reply: the
        session's borrowed arena, a transient one for a block larger than an
        arena, or None when the arena budget is spent."""
        if nbytes > self.arenas.arena_bytes:
            self._reserve_transient(session, nbytes)
            return aligned_buffer(nbytes, huge=True)
        return self._session_arena(session)

    def _reserve_transient(self, session: Session, nbytes: int) -> None:
        if nbytes > self.arenas.transient_budget_bytes:
            raise self._too_large(f"a request buffer of {nbytes} bytes is larger than the daemon's whole budget "
                                  f"for them ({self.arenas.transient_budget_bytes} bytes)")
        if not self.arenas.reserve_transient(nbytes):
            stats = self.arenas.statistics()
            raise TransientBudgetSpent(
                f"the daemon's request buffers stayed spent for {self.arenas.transient_wait_s} s "
                f"({stats.transient_bytes} of {stats.transient_budget_bytes} bytes in use by other requests, "
                f"{nbytes} more asked): retry later")
        session.transient_bytes += nbytes

    def admit_payload(self, session: Session, nbytes: int) -> tuple[p.ErrorCode, str] | None:
        """For a payload that gets no arena (:meth:`payload_buffer` said None): None if a
        transient buffer of ``nbytes`` fits the daemon-wide budget (the connection then
        allocates it), else the error to refuse the frame with (its payload is skipped):
        BUSY while the budget is spent, TOO_LARGE for more than the whole budget."""
        try:
            self._reserve_transient(session, nbytes)
        except TransientBudgetSpent as exc:
            return p.ErrorCode.BUSY, str(exc)
        except self._too_large as exc:
            return p.ErrorCode.TOO_LARGE, str(exc)
        return None

    def payload_buffer(self, session: Session, nbytes: int) -> memoryview | None:
        """The session's arena to receive a request payload of ``nbytes`` into
        (the engine copies PUT blocks out before the reply is sent), or None:
        larger than an arena, or the pool is spent (see :meth:`admit_payload`)."""
        if nbytes > self.arenas.arena_bytes:
            return None
        return self._session_arena(session)

    def _session_arena(self, session: Session) -> memoryview | None:
        """The arena this request borrowed, borrowing one if it has none (None: all lent)."""
        if session.get_arena is None:
            session.get_arena = self.arenas.acquire()
        return session.get_arena

    def reply_sent(self, session: Session) -> None:
        """The last reply went out: give back the arena it was sent from (the
        connection reads its next request only after this)."""
        if session.get_arena is not None:
            arena, session.get_arena = session.get_arena, None
            self.arenas.release(arena)
        self._release_transient(session)

    def _release_transient(self, session: Session) -> None:
        if session.transient_bytes:
            nbytes, session.transient_bytes = session.transient_bytes, 0
            self.arenas.release_transient(nbytes)

    def _get_copying(self, msg: p.Get, session: Session, located_bytes: int, located_keys: int):
        """:meth:`_get` with blocks the engine returns as bytes, read in chunks
        while they fit one arena (the sizes are learned as they come, starting
        with the ``located_keys`` whose located sizes fit; the first block goes
        whatever its size). Transient memory is reserved for what was located."""
        keys = list(msg.keys)
        budget = min(self._limits.payload_bytes_max, self.arenas.arena_bytes)
        self._reserve_transient(session, max(1, min(located_bytes, budget)))
        if len(keys) * self._limits.block_bytes_max <= budget:
            blocks: list = self._engine.get_many(keys)
        else:
            blocks, total, present = [], 0, 0
            chunk = max(1, min(len(keys), located_keys))
            while len(blocks) < len(keys):
                got = self._engine.get_many(keys[len(blocks):len(blocks) + chunk])
                for block in got:
                    size = 0 if block is None else len(block)
                    if total + size > budget and blocks:
                        break
                    blocks.append(block)
                    total += size
                    present += block is not None
                else:
                    mean = total / present if present else 1
                    chunk = max(1, int((budget - total) // max(mean, 1)))
                    continue
                break
            blocks += [p.DEFERRED] * (len(keys) - len(blocks))
        hits = sum(1 for b in blocks if b is not None and b is not p.DEFERRED)
        misses = sum(1 for b in blocks if b is None)
        self._stats.namespace(msg.ns_id, hits, misses)
        return p.GetReply(msg.request_id, tuple(blocks)), False

    def _put(self, msg: p.Put, session, token):
        """Headers and keys are checked here (naming the item); the engine
        verifies every payload CRC before it stores any block of the batch."""
        for index, (key, block) in enumerate(zip(msg.keys, msg.blocks)):
            try:
                header = decode_header(block)
                if header.key != bytes(key):
                    raise BlockFormatError(f"block key {header.key.hex()} is not the item's key")
                if header.block_size != len(block):
                    raise BlockFormatError(f"block is {len(block)} bytes, its header says {header.block_size}")
            except BlockFormatError as exc:
                self._stats.error(p.ErrorCode.BAD_BLOCK.name)
                return p.ErrorReply(msg.request_id, p.ErrorCode.BAD_BLOCK,
                                    f"PUT item {index} (key {bytes(key).hex()}): {exc}; nothing stored"), False
        seqs = self._engine.put_many(list(msg.blocks), durable=msg.durable)
        return p.PutReply(msg.request_id, tuple(seqs)), False

    def _delete(self, msg: p.Delete, session, token):
        return p.DeleteReply(msg.request_id, tuple(self._engine.delete_many(list(msg.keys)))), False

    def _pin(self, msg: p.Pin, session, token):
        return p.PinReply(msg.request_id, tuple(self._engine.pin_many(list(msg.keys)))), False

    def _unpin(self, msg: p.Unpin, session, token):
        return p.UnpinReply(msg.request_id, tuple(self._engine.unpin_many(list(msg.keys)))), False

    def _flush(self, msg: p.Flush, session, token):
        self._engine.flush()
        return p.FlushReply(msg.request_id), False

    def _stats_reply(self, msg: p.Stats, session, token):
        engine_stats = self._engine.statistics()
        doc = {"server": self._server_statistics(), "engine": asdict(engine_stats),
               "buffers": asdict(self.arenas.statistics()), "geometry": geometry_doc(self._engine.geometry)}
        return p.StatsReply(msg.request_id, doc), False

    def _ping(self, msg: p.Ping, session, token):
        return p.PingReply(msg.request_id, msg.data), False
