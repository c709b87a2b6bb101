"""Answers NIXL_METADATA and NIXL_GET: the blocks of a GET WRITten into a client's descriptors.

NIXL_METADATA loads the client's agent and records the regions it registered
(the connection's :class:`NixlPeer`); the reply is the daemon's agent metadata.
A NIXL_GET is a GET (:class:`~kvtier.daemon.server.get_reply.GetReplies`: the same
layout, DEFERRED rule, arenas, and checks of header, key and seq) whose blocks
are then WRITten from where they were read to the client's descriptors, with a
notification; the reply says per item how many bytes were written there. Every
descriptor is checked against the connection's regions, against the others, and
against its block's length before anything is posted: a refused request writes
nothing and the connection serves on. Only the agent this connection loaded is
written to.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import asdict, dataclass
from typing import Callable

from kvtier.daemon.nixl.agent import DaemonAgent, NixlTransferError, NixlUnavailable, buffer_address
from kvtier.daemon.nixl.descriptors import ClientRegions, DescriptorError, check_descriptors, check_fits
from kvtier.wire import connection as p
from kvtier.wire import events as m
from kvtier.wire.frames import DEFERRED_LENGTH
from kvtier.wire.nixl_frames import notification

log = logging.getLogger("kvtier.daemon.nixl")


@dataclass(frozen=True)
class NixlPeer:
    """The client agent one connection loaded and the regions it may be written in."""

    agent_name: str
    regions: ClientRegions


class NixlService:
    """The daemon's side of the ``nixl`` transport, over one :class:`DaemonAgent`."""

    def __init__(self, make_agent: Callable[[], DaemonAgent], agent: DaemonAgent | None = None):
        self._make_agent = make_agent
        self._agent = agent
        self._unavailable: str | None = None
        self._lock = threading.Lock()
        self._gets = None
        self._stats = None

    @property
    def started(self) -> bool:
        """Whether the agent (and its UCX backend) exists: see :func:`kvtier.daemon.nixl.exit_process`."""
        return self._agent is not None

    def agent(self) -> DaemonAgent:
        """The agent, created by the first connection that asks for it (NixlUnavailable: it cannot be)."""
        with self._lock:
            if self._agent is None:
                if self._unavailable is not None:
                    raise NixlUnavailable(self._unavailable)
                try:
                    self._agent = self._make_agent()
                except NixlUnavailable as exc:
                    self._unavailable = str(exc)
                    raise
                log.info("event=nixl_on agent=%s transport=%s ucx_tls=%s", self._agent.name, self._agent.plan.name,
                         self._agent.plan.tls)
            return self._agent

    def statistics(self) -> dict:
        return {} if self._agent is None else asdict(self._agent.statistics())

    def bind(self, gets, stats) -> None:
        """The data server's GET replies and statistics recorder (RequestHandler.attach_nixl)."""
        self._gets, self._stats = gets, stats

    def handle(self, msg, session):
        if isinstance(msg, m.NixlMetadata):
            return self._metadata(msg, session)
        return self._get(msg, session)

    def connection_closed(self, session) -> None:
        if session.nixl is not None:
            peer, session.nixl = session.nixl, None
            self._agent.remove_peer(peer.agent_name)

    def _refuse(self, msg, code: p.ErrorCode, message: str) -> p.ErrorReply:
        self._stats.error(code.name)
        return p.ErrorReply(msg.request_id, code, message)

    def _metadata(self, msg: m.NixlMetadata, session):
        try:
            regions = ClientRegions(msg.regions)
        except DescriptorError as exc:
            return self._refuse(msg, p.ErrorCode.BAD_REQUEST, f"NIXL_METADATA: {exc}")
        try:
            agent = self.agent()
        except NixlUnavailable as exc:
            return self._refuse(msg, p.ErrorCode.INTERNAL, f"NIXL_METADATA: {exc}")
        try:
            name = agent.add_peer(msg.metadata)
        except ValueError as exc:
            return self._refuse(msg, p.ErrorCode.BAD_REQUEST, f"NIXL_METADATA: {exc}")
        self.connection_closed(session)  # a second NIXL_METADATA replaces the first
        session.nixl = NixlPeer(name, regions)
        log.info("event=nixl_peer peer=%s agent=%s regions=%d bytes=%d", session.peer, name, len(regions),
                 regions.total_bytes)
        return m.NixlMetadataReply(msg.request_id, agent.metadata())

    def _get(self, msg: m.NixlGet, session):
        peer: NixlPeer | None = session.nixl
        if peer is None:
            return self._refuse(msg, p.ErrorCode.BAD_REQUEST, "NIXL_GET before NIXL_METADATA on this connection")
        if msg.agent_name != peer.agent_name:
            return self._refuse(msg, p.ErrorCode.BAD_REQUEST, f"NIXL_GET names agent {msg.agent_name!r}; this "
                                f"connection loaded {peer.agent_name!r}")
        try:
            check_descriptors(peer.regions, msg.descriptors)
        except DescriptorError as exc:
            return self._refuse(msg, p.ErrorCode.BAD_REQUEST, f"NIXL_GET refused, nothing written: {exc}")
        reply = self._gets.reply(p.Get(msg.request_id, msg.keys, msg.ns_id, msg.reader_verifies), session)
        lengths = tuple(DEFERRED_LENGTH if b is p.DEFERRED else 0 if b is None else memoryview(b).nbytes
                        for b in reply.blocks)
        try:
            check_fits(msg.descriptors, [0 if n == DEFERRED_LENGTH else n for n in lengths])
        except DescriptorError as exc:
            return self._refuse(msg, p.ErrorCode.BAD_REQUEST, f"NIXL_GET refused, nothing written: {exc}")
        hits = [i for i, n in enumerate(lengths) if n and n != DEFERRED_LENGTH]
        if hits:
            local = [(buffer_address(reply.blocks[i]), lengths[i]) for i in hits]
            remote = [(msg.descriptors[i][0], lengths[i]) for i in hits]
            buffers = [b for b in (session.get_arena, *session.transient_buffers) if b is not None]
            try:
                self._agent.write(peer.agent_name, buffers, local, remote, notification(msg.request_id))
            except NixlTransferError as exc:
                log.warning("event=nixl_write_failed peer=%s agent=%s error=%s", session.peer, peer.agent_name, exc)
                code = p.ErrorCode.TIMEOUT if exc.timed_out else p.ErrorCode.INTERNAL
                return self._refuse(msg, code, str(exc))
        return m.NixlGetReply(msg.request_id, lengths)
