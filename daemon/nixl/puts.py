"""Answers NIXL_PUT: the blocks READ from the client's memory straight into the open region.

::

    client                                     kvtierd
    NIXL_PUT keys + extents --------------->   extents inside the regions this connection declared,
                                               lengths plausible, frame under the payload limit
                                               reserve room in the open region (as a PUT received in place)
                           <=================  NIXL READ of every extent into the reservation
                                               header, key and CRC checked where the bytes landed; commit
                           <---------------    reply: seqs (durable: on flash and synced first)

The two open-region images are registered with the daemon's agent once, on the first NIXL_PUT.
When no reservation can be had (another one in flight too long, a key already stored), the
blocks are READ into the request's buffer and stored the copying way (``Engine.put_many``).
A request refused or failed at any step stores nothing: a reservation is aborted (its room
zeroed and given back) before the error goes out. A READ that failed and that NIXL cannot
release may still write where it was pointed: the engine then fails closed instead, and the
daemon exits to be restarted, so neither that room nor that buffer takes another block.
"""
from __future__ import annotations

import logging
import threading

from kvtier.common.blockformat import HEADER_SIZE, BlockFormatError, verify_block
from kvtier.daemon.nixl.agent import DaemonAgent, NixlTransferNotReleased, NixlTransferError, buffer_address
from kvtier.daemon.nixl.descriptors import ClientRegions, DescriptorError, check_descriptors
from kvtier.daemon.nixl.parts import Part
from kvtier.wire import connection as p
from kvtier.wire import events as m

log = logging.getLogger("kvtier.daemon.nixl")


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
        self._images_registered: bool | None = None
        self.in_place = self.copied = 0  # blocks stored each way

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
        reservation = self._engine.reserve_put(msg.keys, lengths) if self._images_usable() else None
        if reservation is None:
            return self._put_copied(msg, peer_agent, lengths, session)
        cancelled = True
        try:
            self._read(msg, peer_agent, reservation.view)
            seqs = self._engine.commit_put(reservation, durable=msg.durable)
        except NixlTransferNotReleased:
            cancelled = False  # the room stays reserved: the engine failed closed
            raise
        finally:
            if cancelled:
                self._engine.abort_put(reservation)  # a no-op once committed
        with self._lock:
            self.in_place += len(seqs)
        return seqs

    def _put_copied(self, msg: m.NixlPut, peer_agent: str, lengths: list[int], session) -> list[int]:
        buffer = self._buffers.reply_buffer(session, sum(lengths))  # given back once the reply is sent
        landed = buffer[:sum(lengths)]
        self._read(msg, peer_agent, landed, registered=[buffer])
        blocks, at = [], 0
        for index, (key, length) in enumerate(zip(msg.keys, lengths)):
            block = landed[at:at + length]
            at += length
            try:
                verify_block(block, expected_key=bytes(key))
            except BlockFormatError as exc:
                raise BlockFormatError(f"NIXL_PUT item {index} (key {bytes(key).hex()}): {exc}; nothing stored") \
                    from None
            blocks.append(block)
        seqs = self._engine.put_many(blocks, durable=msg.durable)
        with self._lock:
            self.copied += len(seqs)
        return seqs

    def _read(self, msg: m.NixlPut, peer_agent: str, into: memoryview, registered=()) -> None:
        """READ every item's extents, in order, into ``into`` (back to back), as one part: nothing is
        notified, so nothing is gained by cutting it."""
        part, at = Part(), buffer_address(into)
        for index, extents in enumerate(msg.extents):
            offset = 0
            for address, length in extents:
                part.add(index, offset, at, address, length)
                at, offset = at + length, offset + length
        try:
            with self._agent.transfer(peer_agent, msg.request_id, op="READ") as transfer:
                transfer.post([part], registered)
                transfer.wait()
        except NixlTransferNotReleased as exc:  # neither the open region nor a pooled buffer may take its bytes
            self._engine.fail(f"{exc}; the daemon stops without reusing that memory (a restart recovers from flash)")
            raise

    def _images_usable(self) -> bool:
        with self._lock:
            if self._images_registered is None:
                try:
                    self._agent.register_fixed(self._engine.put_images())
                    self._images_registered = True
                except NixlTransferError as exc:
                    log.warning("event=nixl_put_images_refused error=%s", exc)
                    self._images_registered = False
            return self._images_registered
