"""Answers NIXL_PUT: the blocks READ from the client's memory into the request's buffer, then stored.

::

    client                                     kvtierd
    NIXL_PUT keys + extents --------------->   extents inside the regions this connection declared,
                                               lengths plausible, frame under the payload limit
                                               a request buffer (arena or transient), registered
                                               with the agent for this READ only
                           <=================  NIXL READ of every extent into it
                                               Engine.put_many: header, key and CRC checked once
                           <---------------    reply: seqs (durable: on flash and synced first)

The daemon's agent only ever holds registered the memory of the transfers in flight: a READ
lands in a buffer of the request that asked for it, never in the open region's image (which
holds every tenant's blocks). A request refused or failed at any step stores nothing. A NIXL
release does not stop a READ in flight, so a READ given up on (timed out, failed) with a part
still in flight may write where it was pointed later: it is parked
(:meth:`DaemonAgent.reap_parked`) with the request's buffer, taken from the session
(:meth:`RequestBuffers.hand_over`), until NIXL has ended it. A READ that NIXL cannot release at
all fails the engine closed, and the daemon exits to be restarted, so that buffer never takes
another request.
"""
from __future__ import annotations

import itertools
import threading

from kvtier.common.blockformat import HEADER_SIZE
from kvtier.daemon.nixl.agent import DaemonAgent, NixlTransferNotReleased, buffer_address
from kvtier.daemon.nixl.descriptors import ClientRegions, DescriptorError, check_descriptors
from kvtier.daemon.nixl.parts import Part
from kvtier.wire import connection as p
from kvtier.wire import events as m


class PutRefused(ValueError):
    """A NIXL_PUT refused before anything is read: ``code`` is the error it is answered with."""

    def __init__(self, message: str, code: p.ErrorCode):
        super().__init__(message)
        self.code = code


class NixlPuts:
    """The daemon's side of NIXL_PUT, over one agent, the engine and the request buffers."""

    def __init__(self, agent: DaemonAgent, engine, buffers, limits: p.Limits):
        self._agent = agent
        self._engine = engine
        self._buffers = buffers
        self._limits = limits
        self._lock = threading.Lock()
        self.blocks = 0  # blocks stored

    def check(self, msg: m.NixlPut, regions: ClientRegions) -> list[int]:
        """Each item's block length (PutRefused names what is refused)."""
        try:
            check_descriptors(regions, [e for extents in msg.extents for e in extents], "extent", overlap_ok=True)
        except DescriptorError as exc:
            raise PutRefused(str(exc), p.ErrorCode.BAD_REQUEST) from None
        lengths = [sum(n for _, n in extents) for extents in msg.extents]
        for index, (key, length) in enumerate(zip(msg.keys, lengths)):
            if length < HEADER_SIZE:
                raise PutRefused(f"item {index} (key {bytes(key).hex()}): a block of {length} bytes is shorter than "
                                 f"its header ({HEADER_SIZE} bytes)", p.ErrorCode.BAD_BLOCK)
            if length > self._limits.block_bytes_max:
                raise PutRefused(f"item {index} (key {bytes(key).hex()}): a block of {length} bytes is over the "
                                 f"limit {self._limits.block_bytes_max}", p.ErrorCode.TOO_LARGE)
        if sum(lengths) > self._limits.payload_bytes_max:
            raise PutRefused(f"{sum(lengths)} bytes is over the payload limit {self._limits.payload_bytes_max}",
                             p.ErrorCode.LIMIT)
        return lengths

    def put(self, msg: m.NixlPut, peer_agent: str, lengths: list[int], session) -> list[int]:
        """READ the blocks and store them; their seqs. NixlTransferError: the READ failed or timed
        out; BlockFormatError: a block failed its check (nothing stored either way)."""
        buffer = self._buffers.reply_buffer(session, sum(lengths))  # given back once the reply is sent
        landed = buffer[:sum(lengths)]
        self._read(msg, peer_agent, landed, hold=lambda: self._buffers.hand_over(session))
        starts = list(itertools.accumulate(lengths, initial=0))
        blocks = [landed[a:b] for a, b in zip(starts, starts[1:])]
        seqs = self._engine.put_many(blocks, durable=msg.durable, keys=msg.keys)  # each checked there, once
        with self._lock:
            self.blocks += len(seqs)
        return seqs

    def _read(self, msg: m.NixlPut, peer_agent: str, into: memoryview, hold) -> None:
        """READ every item's extents, in order, into ``into`` (back to back, registered for this READ
        alone), as one part: nothing is notified, so nothing is gained by cutting it. ``hold()``: take
        the memory ``into`` lies in
        out of use, for a READ parked in flight (``(give_back, nbytes)``)."""
        part, at = Part(), buffer_address(into)
        for index, extents in enumerate(msg.extents):
            offset = 0
            for address, length in extents:
                part.add(index, offset, at, address, length)
                at, offset = at + length, offset + length
        try:
            with self._agent.transfer(peer_agent, msg.request_id, op="READ", hold=hold) as transfer:
                transfer.post([part], [into])
                transfer.wait()
        except NixlTransferNotReleased as exc:  # the pooled buffer may not take another request's bytes
            hold()  # out of the pool for good
            self._engine.fail(f"{exc}; the daemon stops without reusing that memory (a restart recovers from flash)")
            raise
