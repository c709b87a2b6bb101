"""Turns decoded data-protocol requests into engine calls and replies.

No sockets here: :class:`RequestHandler.handle` takes a request message and a
per-connection :class:`Session` and returns ``(reply, close_after)``. Engine
failures become error replies naming the problem; they never escape to the
connection loop as anything but a logged internal error.
"""
from __future__ import annotations

import hmac
import logging
from dataclasses import asdict, dataclass
from typing import Callable

from kvtier.client import protocol as p
from kvtier.client.blockformat import BlockFormatError, decode_header

log = logging.getLogger("kvtier.daemon.server")

GET_FIRST_CHUNK_KEYS = 64  # a GET that might overflow one reply is read this many blocks at a time first


@dataclass
class Session:
    """What the server knows about one connection."""

    peer: str
    authenticated: bool = False
    client_name: str = ""


def geometry_doc(geometry) -> dict:
    return {"device_ids": list(geometry.device_ids), "stripe_size_bytes": geometry.stripe_size_bytes,
            "data_offset_bytes": geometry.data_offset_bytes, "device_data_bytes": geometry.device_data_bytes}


class RequestHandler:
    def __init__(self, engine, stats, token: Callable[[], str | None], region_size_bytes: int,
                 limits: p.Limits, server_statistics: Callable[[], dict]):
        self._engine = engine
        self._stats = stats
        self._token = token
        self._region_size_bytes = region_size_bytes
        self._limits = limits
        self._server_statistics = server_statistics
        from kvtier.daemon.engine import EngineError, NoSpaceError
        self._engine_error, self._no_space = EngineError, NoSpaceError
        self._dispatch = {
            p.Hello: self._hello, p.Lookup: self._lookup, p.Get: self._get, p.Put: self._put,
            p.Delete: self._delete, p.Pin: self._pin, p.Unpin: self._unpin, p.Flush: self._flush,
            p.Stats: self._stats_reply, p.Ping: self._ping,
        }

    def handle(self, msg, session: Session):
        """``(reply, close_after)`` for one request or Rejected event."""
        if isinstance(msg, p.Rejected):
            self._stats.error(msg.code.name)
            return p.ErrorReply(msg.request_id, msg.code, msg.message), False
        token = self._token()
        if token is not None and not session.authenticated and not isinstance(msg, p.Hello):
            self._stats.error(p.ErrorCode.AUTH.name)
            return p.ErrorReply(msg.request_id, p.ErrorCode.AUTH, "authenticate with HELLO and the token first"), True
        try:
            return self._dispatch[type(msg)](msg, session, token)
        except self._no_space as exc:
            self._stats.error(p.ErrorCode.NO_SPACE.name)
            return p.ErrorReply(msg.request_id, p.ErrorCode.NO_SPACE, f"no space: {exc}"), False
        except BlockFormatError as exc:
            self._stats.error(p.ErrorCode.BAD_BLOCK.name)
            return p.ErrorReply(msg.request_id, p.ErrorCode.BAD_BLOCK, str(exc)), False
        except self._engine_error as exc:
            code = p.ErrorCode.TOO_LARGE if "larger" in str(exc) or "region" in str(exc) else p.ErrorCode.BAD_REQUEST
            self._stats.error(code.name)
            return p.ErrorReply(msg.request_id, code, str(exc)), False
        except Exception as exc:  # a bug or a device failure: this request fails, the daemon serves on
            log.exception("event=internal_error peer=%s op=%s", session.peer, type(msg).__name__)
            self._stats.error(p.ErrorCode.INTERNAL.name)
            return p.ErrorReply(msg.request_id, p.ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"), False

    def hello_info(self) -> dict:
        return {
            "server": "kvtierd", "protocol_version": p.PROTOCOL_VERSION,
            "auth_required": self._token() is not None,
            "geometry": geometry_doc(self._engine.geometry),
            "region_size_bytes": self._region_size_bytes,
            "limits": {"batch_count_max": self._limits.batch_count_max, "meta_bytes_max": self._limits.meta_bytes_max,
                       "payload_bytes_max": self._limits.payload_bytes_max,
                       "block_bytes_max": self._limits.block_bytes_max},
        }

    def _hello(self, msg: p.Hello, session: Session, token):
        session.client_name = msg.client_name
        if token is not None:
            if not hmac.compare_digest(msg.token.encode(), token.encode()):
                self._stats.error(p.ErrorCode.AUTH.name)
                log.warning("event=auth_failed peer=%s client=%r", session.peer, msg.client_name)
                reason = "missing token" if not msg.token else "wrong token"
                return p.ErrorReply(msg.request_id, p.ErrorCode.AUTH, f"authentication failed: {reason}"), True
            session.authenticated = True
        return p.HelloReply(msg.request_id, self.hello_info()), False

    def _lookup(self, msg: p.Lookup, session, token):
        if msg.want_locations:
            found = self._engine.locate_many(list(msg.keys))
            leading = 0
            for loc in found:
                if loc is None:
                    break
                leading += 1
            locs = tuple(None if loc is None else p.Location(loc.logical_offset, loc.length, loc.seq, loc.sealed)
                         for loc in found)
            reply = p.LookupReply(msg.request_id, leading, locs)
        else:
            leading = self._engine.lookup(list(msg.keys))
            reply = p.LookupReply(msg.request_id, leading)
        self._stats.lookup(len(msg.keys), leading)
        self._stats.namespace(msg.ns_id, leading, len(msg.keys) - leading)
        return reply, False

    def _get(self, msg: p.Get, session, token):
        """Blocks in order while they fit one reply's payload limit; the rest
        come back DEFERRED for the client to ask again (always at least one).
        A batch that cannot overflow is one engine call; otherwise it is read
        in chunks sized from the blocks seen so far."""
        keys = list(msg.keys)
        budget = self._limits.payload_bytes_max
        if len(keys) * self._limits.block_bytes_max <= budget:
            blocks: list = self._engine.get_many(keys)
        else:
            blocks, total, present = [], 0, 0
            chunk = min(len(keys), GET_FIRST_CHUNK_KEYS)
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
               "geometry": geometry_doc(self._engine.geometry)}
        return p.StatsReply(msg.request_id, doc), False

    def _ping(self, msg: p.Ping, session, token):
        return p.PingReply(msg.request_id, msg.data), False
