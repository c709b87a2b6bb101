"""Answers NIXL_METADATA and NIXL_GET: the blocks of a GET WRITten into a client's descriptors
(and NIXL_PUT: :mod:`kvtier.daemon.nixl.puts`).

NIXL_METADATA loads the client's agent and records the regions it registered
(the connection's :class:`NixlPeer`); the reply is the daemon's agent metadata.
A NIXL_GET is a GET (:class:`~kvtier.daemon.server.get_reply.GetReplies`: the same
layout, DEFERRED rule, arenas, and checks of header, key and seq) whose blocks
are then WRITten from where they were read to the client's descriptors, with a
notification; the reply says per item how many bytes were written there. Every
descriptor is checked against the connection's regions, against the others, and
against its block's length before anything is posted: a refused request writes
nothing and the connection serves on. Only the agent this connection loaded is
written to. Nothing is posted for a client that has shut down its side of the connection (it gave
the request up): what was posted is waited for, and the request ends without a reply. A WRITE given
up on while still in flight keeps the request's buffer out of use until NIXL has ended it
(:meth:`~kvtier.daemon.nixl.agent.DaemonAgent.reap_parked`): NIXL may still read it.
"""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable

from kvtier.daemon.nixl.agent import (DaemonAgent, NixlPeerGone, NixlTransferError, NixlTransferNotReleased,
                                      NixlUnavailable, buffer_address)
from kvtier.daemon.nixl.descriptors import ClientRegions, DescriptorError, check_descriptors, check_fits
from kvtier.wire import connection as p
from kvtier.wire import events as m
from kvtier.wire.frames import DEFERRED_LENGTH
from kvtier.daemon.nixl.parts import plan_parts
from kvtier.daemon.nixl.puts import NixlPuts, PutRefused
from kvtier.daemon.nixl.trust import DEFAULT_TRUST, NixlTrust, peer_host

log = logging.getLogger("kvtier.daemon.nixl")

READERS = 4  # NIXL_GETs whose blocks are read from flash at once (each by one thread, while its connection sends)
PARKED_BYTES_PER_PEER_MAX = 64 << 20  # daemon memory one client's transfers left in flight may hold (four arenas)
# before nothing more is posted for it: a client that never lets its transfers end cannot spend the
# request buffers (512 MiB of arenas) of everyone else
PARKED_SETTLE_S = 0.5  # a request over that waits this long for them to end first: its client progresses its agent
# while it waits for the reply, which ends a transfer it left in flight while it was stalled


@dataclass(frozen=True)
class NixlPeer:
    """The client agent one connection loaded and the regions it may be written in."""

    agent_name: str
    regions: ClientRegions


class NixlService:
    """The daemon's side of the ``nixl`` transport, over one :class:`DaemonAgent`."""

    def __init__(self, make_agent: Callable[[], DaemonAgent], agent: DaemonAgent | None = None,
                 trust: NixlTrust = DEFAULT_TRUST):
        self._make_agent = make_agent
        self.trust = trust
        self._agent = agent
        self._unavailable: str | None = None
        self._lock = threading.Lock()
        self._gets = None
        self._stats = None
        self._engine = None
        self._put_parts = None
        self._puts: NixlPuts | None = None  # made on the first NIXL_PUT
        self._buffers = None  # the request buffers a parked WRITE's sources go back to
        self._gets_peer_gone = 0  # NIXL_GETs whose client gave them up before everything was posted
        self._refused_parked = 0  # requests refused BUSY: their client had PARKED_BYTES_PER_PEER_MAX parked
        self._refused_untrusted = 0  # requests from clients nixl_trusted does not name
        self._readers = ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="kvtier-nixl-read")

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
        if self._agent is None:
            return {}
        with self._lock:
            puts = {} if self._puts is None else {"put_blocks": self._puts.blocks}
            return {**asdict(self._agent.statistics()), "gets_peer_gone": self._gets_peer_gone,
                    "refused_parked": self._refused_parked, "refused_untrusted": self._refused_untrusted,
                    "served_to": self.trust.describe(), **puts}

    def bind(self, gets, stats, engine=None, buffers=None, limits: p.Limits | None = None) -> None:
        """The data server's GET replies, statistics recorder, engine, request buffers and limits
        (RequestHandler.attach_nixl); NIXL_PUT is answered once all are given."""
        self._gets, self._stats, self._engine, self._buffers = gets, stats, engine, buffers
        self._put_parts = None if engine is None or buffers is None or limits is None else (engine, buffers, limits)

    def trusts(self, session) -> bool:
        """Whether this connection's client is served NIXL (``nixl_trusted``)."""
        return self.trust.trusts(peer_host(session.peer))

    def handle(self, msg, session):
        """The reply to a NIXL request; None for a NIXL_GET its client gave up (it ends without one)."""
        if not self.trusts(session):
            with self._lock:
                self._refused_untrusted += 1
            return self._refuse(msg, p.ErrorCode.AUTH, f"NIXL is not served to {peer_host(session.peer)}: this "
                                f"daemon serves it to {self.trust.describe()} (nixl_trusted); use TCP")
        if isinstance(msg, m.NixlMetadata):
            return self._metadata(msg, session)
        if isinstance(msg, m.NixlPut):
            return self._put(msg, session)
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

    def _peer_refusal(self, msg, session, op: str):
        """The refusal of a request this connection's peer cannot make (None: it may)."""
        peer: NixlPeer | None = session.nixl
        if peer is None:
            return self._refuse(msg, p.ErrorCode.BAD_REQUEST, f"{op} before NIXL_METADATA on this connection")
        if msg.agent_name != peer.agent_name:
            return self._refuse(msg, p.ErrorCode.BAD_REQUEST, f"{op} names agent {msg.agent_name!r}; this "
                                f"connection loaded {peer.agent_name!r}")
        held = self._agent.parked_bytes_of(peer.agent_name, PARKED_BYTES_PER_PEER_MAX, PARKED_SETTLE_S)
        if held >= PARKED_BYTES_PER_PEER_MAX:
            with self._lock:
                self._refused_parked += 1
            return self._refuse(msg, p.ErrorCode.BUSY, f"{op} refused, nothing posted: agent {peer.agent_name!r} "
                                f"still holds {held} bytes of this daemon's memory in transfers it has not let end "
                                f"(PARKED_BYTES_PER_PEER_MAX {PARKED_BYTES_PER_PEER_MAX}); it is served again once "
                                f"NIXL has ended them (its agent progressing)")
        return None

    def _put(self, msg: m.NixlPut, session):
        if self._put_parts is None:
            return self._refuse(msg, p.ErrorCode.UNKNOWN_OP, "this daemon does not answer NIXL_PUT")
        if (refusal := self._peer_refusal(msg, session, "NIXL_PUT")) is not None:
            return refusal
        with self._lock:
            if self._puts is None:
                self._puts = NixlPuts(self._agent, *self._put_parts)
        try:
            lengths = self._puts.check(msg, session.nixl.regions)
        except PutRefused as exc:
            return self._refuse(msg, exc.code, f"NIXL_PUT refused, nothing read or stored: {exc}")
        try:
            seqs = self._puts.put(msg, session.nixl.agent_name, lengths, session)
        except NixlTransferError as exc:
            log.warning("event=nixl_read_failed peer=%s agent=%s error=%s", session.peer, msg.agent_name, exc)
            code = p.ErrorCode.TIMEOUT if exc.timed_out else p.ErrorCode.INTERNAL
            return self._refuse(msg, code, f"{exc}; nothing stored")
        return m.NixlPutReply(msg.request_id, tuple(seqs))

    def _get(self, msg: m.NixlGet, session):
        if (refusal := self._peer_refusal(msg, session, "NIXL_GET")) is not None:
            return refusal
        peer: NixlPeer = session.nixl
        try:
            if msg.extents is None:
                check_descriptors(peer.regions, msg.descriptors)
            else:  # every extent of every item: inside the regions, none overlapping another
                check_descriptors(peer.regions, [e for extents in msg.extents for e in extents], "extent")
        except DescriptorError as exc:
            return self._refuse(msg, p.ErrorCode.BAD_REQUEST, f"NIXL_GET refused, nothing written: {exc}")
        lengths = [0] * len(msg.keys)
        hold = None if self._buffers is None else lambda: self._buffers.hand_over(session)
        gone = None
        try:
            with self._agent.transfer(peer.agent_name, msg.request_id, hold=hold,
                                      peer_gone=session.peer_gone) as transfer:
                try:
                    try:
                        self._write(msg, session, transfer, lengths)
                    except NixlPeerGone as exc:  # what was posted still moves: waited for, then no reply
                        gone = exc
                    transfer.wait()
                except DescriptorError as exc:
                    refusal = self._refuse(msg, p.ErrorCode.BAD_REQUEST, f"NIXL_GET refused, nothing written: {exc}")
                except NixlTransferError as exc:
                    log.warning("event=nixl_write_failed peer=%s agent=%s error=%s", session.peer, peer.agent_name,
                                exc)
                    code = p.ErrorCode.TIMEOUT if exc.timed_out else p.ErrorCode.INTERNAL
                    refusal = self._refuse(msg, code, str(exc))
                else:
                    refusal = None
        except NixlTransferNotReleased as exc:  # the request's buffer is refilled next: it must not be sent on
            if hold is not None:
                hold()  # out of the pool for good
            if self._engine is not None:
                self._engine.fail(f"{exc}; the daemon stops rather than reuse that memory")
            return self._refuse(msg, p.ErrorCode.INTERNAL, str(exc))
        if refusal is not None:
            return refusal
        if gone is not None:
            with self._lock:
                self._gets_peer_gone += 1
            log.info("event=nixl_get_abandoned peer=%s agent=%s request=%d: %s", session.peer, peer.agent_name,
                     msg.request_id, gone)
            return None
        return m.NixlGetReply(msg.request_id, tuple(lengths))

    def _write(self, msg: m.NixlGet, session, transfer, lengths: list[int]) -> None:
        """Post the WRITEs of a NIXL_GET chunk by chunk as its blocks are read into the request's
        buffer; ``lengths`` gets each item's written length. DescriptorError (before anything is
        posted or read): a block does not fit its descriptor."""
        def fits(i: int, n: int) -> bool:  # a block read may have changed size since it was located
            return n <= msg.descriptors[i][1]

        def check(layout) -> None:  # the located lengths, before anything is read or written
            for i in range(len(lengths)):
                lengths[i] = 0 if i < layout.answered else DEFERRED_LENGTH
            for i, n in zip(layout.hits, layout.lengths):
                lengths[i] = n
            check_fits(msg.descriptors, [0 if n == DEFERRED_LENGTH else n for n in lengths])

        def send(blocks: dict) -> None:
            items = [(i, [(buffer_address(block), memoryview(block).nbytes)], _destination(msg, i))
                     for i, block in blocks.items() if fits(i, memoryview(block).nbytes)]
            if items:
                owners = [b for b in (session.get_arena, *session.transient_buffers) if b is not None]
                transfer.post(plan_parts(items), covering(owners, [span for _, spans, _ in items for span in spans]))

        chunks: queue.Queue = queue.Queue()

        def read() -> p.GetReply:  # on a reader thread: chunk k+1 is read while this thread sends chunk k
            try:
                return self._gets.reply_in_chunks(p.Get(msg.request_id, msg.keys, msg.ns_id, msg.reader_verifies),
                                                  session, check, chunks.put)
            finally:
                chunks.put(None)

        reading = self._readers.submit(read)
        try:
            while (blocks := chunks.get()) is not None:
                send(blocks)
        finally:
            reply = reading.result()  # the reader's error (a refusal from check) once it has stopped
        for i, block in enumerate(reply.blocks):
            n = DEFERRED_LENGTH if block is p.DEFERRED else 0 if block is None else memoryview(block).nbytes
            lengths[i] = n if n == DEFERRED_LENGTH or fits(i, n) else 0


def covering(owners, spans) -> list[memoryview]:
    """Per buffer of ``owners`` that holds some of ``spans`` (``(address, length)``), the slice of it
    that covers them: what a transfer registers, so that nothing else of a pooled buffer (bytes an
    earlier request left there) is reachable while it runs."""
    slices = []
    for owner in owners:
        view = memoryview(owner).cast("B")
        base = buffer_address(view)
        inside = [(a, n) for a, n in spans if base <= a < base + view.nbytes]
        if inside:
            low, high = min(a for a, _ in inside), max(a + n for a, n in inside)
            slices.append(view[low - base:high - base])
    return slices


def _destination(msg: m.NixlGet, item: int) -> tuple[tuple[int, int], ...]:
    """Where item ``item``'s block goes in the client's memory: its scatter extents, or its descriptor."""
    return msg.extents[item] if msg.extents is not None else (msg.descriptors[item],)
