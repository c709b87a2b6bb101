"""Turns decoded data-protocol requests into engine calls and replies.

No sockets here: :class:`RequestHandler.handle` takes a request message and a
per-connection :class:`.session.Session` and returns ``(reply, close_after)``.
Engine failures become error replies naming the problem. A bug inside the engine fails it
closed (the engine does that itself: EngineFailedError, the daemon exits for its supervisor
to restart it, recovering from flash); any other unexpected exception (NIXL, upstream, this
handler) is a logged INTERNAL reply that closes its connection, and the daemon serves on. GET is answered
by :mod:`.get_reply`; the buffers requests borrow are lent by
:mod:`.request_buffers`.
"""
from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Callable

import numpy as np

from kvtier.common.cluster_url import PREPLACE_CLIENT_NAME
from kvtier.common.blockformat import BlockFormatError
from kvtier.common.tokens import token_matches
from kvtier.daemon.engine import (BlockTooLargeError, DeviceError, EngineBugError, EngineError, EngineFailedError,
                                  NoSpaceError, WaitTimeoutError)
from kvtier.daemon.server.arenas import ReplyArenas
from kvtier.daemon.server.get_reply import GetReplies, packed_keys
from kvtier.daemon.server.request_buffers import RequestBuffers, TransientBudgetSpent
from kvtier.daemon.server.session import Session
from kvtier.daemon.upstream.client import CLIENT_NAME as UPSTREAM_CLIENT_NAME
from kvtier.wire import connection as p
from kvtier.wire.writers import location_records
from kvtier.wire.events import FEATURE_NIXL, FEATURE_NIXL_PUT, NixlGet, NixlMetadata, NixlPut
from kvtier.wire.frames import FLAG_SKIP_DELETED

log = logging.getLogger("kvtier.daemon.server")

# engine exceptions other than NoSpace, each with the code the client gets
ENGINE_ERROR_CODES = ((BlockTooLargeError, p.ErrorCode.TOO_LARGE), (DeviceError, p.ErrorCode.DEVICE_ERROR),
                      (EngineBugError, p.ErrorCode.INTERNAL), (WaitTimeoutError, p.ErrorCode.BUSY),
                      (EngineFailedError, p.ErrorCode.SHUTTING_DOWN), (EngineError, p.ErrorCode.BAD_REQUEST))


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
        self.extra_features: list[str] = []  # HELLO features the daemon adds (DataServer.add_feature)
        self.upstream = None  # a kvtier.daemon.upstream.PullThrough with --upstream (DataServer.set_upstream)
        self.nixl = None  # a kvtier.daemon.nixl.service.NixlService with --nixl (attach_nixl)
        self.observe_chain = None  # (ns_id, packed keys) of each LOOKUP/GET: pre-placement's popularity counts
        self.buffers = RequestBuffers(arenas if arenas is not None else ReplyArenas())
        self._gets = GetReplies(engine, self.buffers, limits, stats)
        self._dispatch = {
            p.Hello: self._hello, p.Lookup: self._lookup, p.Get: self._get, p.Put: self._put,
            p.Delete: self._delete, p.Pin: self._pin, p.Unpin: self._unpin, p.Flush: self._flush,
            p.Stats: self._stats_reply, p.Ping: self._ping,
            NixlMetadata: self._nixl, NixlGet: self._nixl, NixlPut: self._nixl,
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
        except NoSpaceError as exc:
            self._stats.error(p.ErrorCode.NO_SPACE.name)
            return p.ErrorReply(msg.request_id, p.ErrorCode.NO_SPACE, f"no space: {exc}"), False
        except BlockFormatError as exc:
            self._stats.error(p.ErrorCode.BAD_BLOCK.name)
            return p.ErrorReply(msg.request_id, p.ErrorCode.BAD_BLOCK, str(exc)), False
        except EngineError as exc:
            code = next(code for kind, code in ENGINE_ERROR_CODES if isinstance(exc, kind))
            self._stats.error(code.name)
            return p.ErrorReply(msg.request_id, code, str(exc)), False
        except Exception as exc:  # a bug outside the engine (the engine fails itself closed on its own):
            # this request fails and its connection closes; every other client is served on
            log.exception("event=internal_error peer=%s op=%s", session.peer, type(msg).__name__)
            self._stats.error(p.ErrorCode.INTERNAL.name)
            return p.ErrorReply(msg.request_id, p.ErrorCode.INTERNAL,
                                f"internal error: {type(exc).__name__}: {exc}; this connection is closed, "
                                f"the daemon serves on"), True

    def hello_info(self, session: Session | None = None) -> dict:
        """HELLO's reply; NIXL's features only for a client the NIXL service trusts."""
        features = [p.FEATURE_GET_READER_VERIFIES, p.FEATURE_PIN_TTL, p.FEATURE_PUT_SKIP_DELETED, *self.extra_features]
        if self.nixl is not None and (session is None or not self.nixl.trusts(session)):
            features = [f for f in features if f not in (FEATURE_NIXL, FEATURE_NIXL_PUT)]
        return {
            "server": "kvtierd", "protocol_version": p.PROTOCOL_VERSION,
            "auth_required": self._token() is not None,
            "features": features,
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
        return p.HelloReply(msg.request_id, self.hello_info(session)), False

    def _lookup(self, msg: p.Lookup, session, token):
        """The keys go to the engine as the one buffer they came in, and
        locations come back as columns that are encoded in one pass: nothing
        is done per key in Python."""
        keys = packed_keys(msg.keys)
        if self.observe_chain is not None:
            self.observe_chain(msg.ns_id, keys)
        locations = None
        if msg.want_locations:
            rows = self._engine.locate_buffer(keys)
            found = rows["found"]
            leading = int(len(found) if found.all() else np.argmin(found))
            locations = location_records(found, rows["logical_offset"], rows["length"], rows["seq"],
                                                rows["sealed"])
        else:
            leading = self._engine.lookup_buffer(keys)
        self._stats.lookup(len(msg.keys), leading)
        self._stats.namespace(msg.ns_id, leading, len(msg.keys) - leading)
        if self._pulls_for(session):  # the rest of the chain may be upstream (and the tiers are counted)
            anywhere, origins = self.upstream.lookup(msg.keys, msg.ns_id, leading)
        else:
            anywhere, origins = leading, bytes(leading) if msg.want_origin else None
        return p.LookupReply(msg.request_id, anywhere, locations, origins=origins if msg.want_origin else None), False

    def _get(self, msg: p.Get, session: Session, token):
        if self.observe_chain is not None:
            self.observe_chain(msg.ns_id, packed_keys(msg.keys))
        reply = self._gets.reply(msg, session)
        if self._pulls_for(session):
            return self.upstream.fill(msg, reply, self._limits.payload_bytes_max), False
        if msg.want_origin:
            return p.GetReply(reply.request_id, reply.blocks, origins=bytes(len(reply.blocks))), False
        return reply, False

    def _pulls_for(self, session: Session) -> bool:
        """Whether this session's misses go to the upstream: not for another daemon's upstream
        client (one hop only), so two daemons that name each other never forward in a loop, nor
        for a region pushing prefixes (what it asks is not a client's request)."""
        return self.upstream is not None and session.client_name not in (UPSTREAM_CLIENT_NAME, PREPLACE_CLIENT_NAME)

    def payload_in_place(self, session: Session, head, meta) -> memoryview | None:
        """For a PUT frame whose header and meta were read: room in the engine's open region
        to receive its payload straight into (the blocks are checked and stored where they
        land, no copy), or None (an arena or a buffer of its own, then ``Engine.put_many``).
        A frame an arena holds goes there when the open region has no room left for it
        (``put_many`` then fills the region's end); a larger one starts the next region."""
        if head.base_op != p.Op.PUT or not session.authenticated and self._token() is not None or \
                head.flags & FLAG_SKIP_DELETED:  # a copy: stored key by key under the lock (Engine.put_many)
            return None
        _, items = meta
        try:
            reservation = self._engine.reserve_put([k for k, _ in items], [n for _, n in items],
                                                   new_region=head.payload_len > self.buffers.arenas.arena_bytes)
        except EngineError:  # a failed engine or device: the copying path answers it with its error frame
            return None
        if reservation is None:
            return None
        session.put_reservation = reservation
        return reservation.view

    def abort_in_place(self, session: Session) -> None:
        """The request whose payload went to a reservation ended without a commit (its frame was
        refused, the connection dropped mid-payload, ...): nothing of it is stored."""
        if session.put_reservation is not None:
            reservation, session.put_reservation = session.put_reservation, None
            self._engine.abort_put(reservation)

    def _put(self, msg: p.Put, session, token):
        """Every block is checked once, against its item's key, before any is stored: where it landed
        by the commit for a payload received into the open region, else by put_many. Either way a
        bad block is BAD_BLOCK naming its item, and nothing of the frame is stored."""
        reservation, session.put_reservation = session.put_reservation, None
        try:
            if reservation is not None:
                seqs = self._engine.commit_put(reservation, durable=msg.durable)
            else:
                seqs = self._engine.put_many(list(msg.blocks), durable=msg.durable, skip_deleted=msg.skip_deleted,
                                             keys=msg.keys)
            return p.PutReply(msg.request_id, tuple(seqs)), False
        finally:
            if reservation is not None:
                self._engine.abort_put(reservation)  # a no-op once committed

    def _delete(self, msg: p.Delete, session, token):
        return p.DeleteReply(msg.request_id, tuple(self._engine.delete_many(list(msg.keys)))), False

    def _pin(self, msg: p.Pin, session, token):
        ttl_s = None if msg.ttl_ms is None else msg.ttl_ms / 1000  # a soft pin (FLAG_PIN_TTL)
        return p.PinReply(msg.request_id, tuple(self._engine.pin_many(list(msg.keys), ttl_s=ttl_s))), False

    def _unpin(self, msg: p.Unpin, session, token):
        return p.UnpinReply(msg.request_id, tuple(self._engine.unpin_many(list(msg.keys)))), False

    def _flush(self, msg: p.Flush, session, token):
        self._engine.flush()
        return p.FlushReply(msg.request_id), False

    def _stats_reply(self, msg: p.Stats, session, token):
        engine_stats = self._engine.statistics()
        doc = {"server": self._server_statistics(), "engine": asdict(engine_stats),
               "buffers": asdict(self.buffers.statistics()), "geometry": geometry_doc(self._engine.geometry)}
        if self.nixl is not None:
            doc["nixl"] = self.nixl.statistics()  # the NIXL agent's transfers ({} until a client used it)
        return p.StatsReply(msg.request_id, doc), False

    def _ping(self, msg: p.Ping, session, token):
        return p.PingReply(msg.request_id, msg.data), False

    def attach_nixl(self, service) -> None:
        """Answer NIXL_METADATA / NIXL_GET / NIXL_PUT with ``service`` (GETs read as :meth:`_get` reads
        them, PUTs stored as :meth:`_put` stores them)."""
        service.bind(self._gets, self._stats, self._engine, self.buffers, self._limits)
        self.nixl = service

    def _nixl(self, msg, session: Session, token):
        if self.nixl is None:
            self._stats.error(p.ErrorCode.UNKNOWN_OP.name)
            return p.ErrorReply(msg.request_id, p.ErrorCode.UNKNOWN_OP,
                                "this daemon runs no NIXL agent (kvtierd --nixl, HELLO feature 'nixl')"), False
        return self.nixl.handle(msg, session), False

    def connection_closed(self, session: Session) -> None:
        """The connection ended: what it held beyond its requests (its NIXL peer) is given back."""
        if self.nixl is not None:
            self.nixl.connection_closed(session)
