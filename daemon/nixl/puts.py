"""Answers NIXL_PUT: the blocks READ from the client's memory straight into the open region.

::

    client                                     kvtierd
    NIXL_PUT keys + extents --------------->   extents inside the regions this connection declared,
                                               lengths plausible, frame under the payload limit
                                               reserve room in the open region (as a PUT received in place)
                           <=================  NIXL READ of every extent into the reservation
                                               header, key and CRC checked where the bytes landed; commit
                           <---------------    reply: seqs (durable: on flash and synced first)

The open-region image a reservation lies in is registered with the daemon's agent the first time a
NIXL_PUT is READ into it (the two images, and one that replaces an abandoned one, below).
When no reservation can be had (another one in flight too long, a key already stored), the
blocks are READ into the request's buffer and stored the copying way (``Engine.put_many``).
A request refused or failed at any step stores nothing: a reservation is aborted (its room
zeroed and given back) before the error goes out. A NIXL release does not stop a READ in flight,
so a READ given up on (timed out, failed) with a part still in flight may write where it was
pointed later. It is parked (:meth:`DaemonAgent.reap_parked`) with the memory it may write:

* in place, the open region's image: the engine moves the open region to a fresh image and gives
  the room back there (:meth:`Engine.abandon_put`); the old image is held until NIXL has ended
  the READ. At most ``IMAGES_ABANDONED_MAX`` are held: past that, PUTs are received the copying way;
* copied, the request's buffer, taken from the session (:meth:`RequestBuffers.hand_over`).

A READ that NIXL cannot release at all fails the engine closed, and the daemon exits to be
restarted, so neither that room nor that buffer takes another block.
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

IMAGES_ABANDONED_MAX = 2  # old open-region images (a region each) held for READs still in flight: a stalled client's
# cost; past it, NIXL_PUTs are received into request buffers, which the service's per-client limit bounds


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
        self._images_refused = False  # NIXL refused to register an open-region image: PUTs are copied
        self._images_held = 0  # old images held for READs still in flight (IMAGES_ABANDONED_MAX)
        self.in_place = self.copied = 0  # blocks stored each way
        self.images_abandoned = 0  # open images moved away from a READ given up on in flight

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
        reservation = self._engine.reserve_put(msg.keys, lengths) if self._in_place_usable() else None
        if reservation is not None and not self._image_registered(reservation.image):
            self._engine.abort_put(reservation)
            reservation = None
        if reservation is None:
            return self._put_copied(msg, peer_agent, lengths, session)
        cancelled = True
        try:
            self._read(msg, peer_agent, reservation.view, hold=lambda: self._abandon(reservation))
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
        self._read(msg, peer_agent, landed, registered=[buffer], hold=lambda: self._buffers.hand_over(session))
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

    def _read(self, msg: m.NixlPut, peer_agent: str, into: memoryview, hold, registered=()) -> None:
        """READ every item's extents, in order, into ``into`` (back to back), as one part: nothing is
        notified, so nothing is gained by cutting it. ``hold()``: take the memory ``into`` lies in
        out of use, for a READ parked in flight (``(give_back, nbytes)``)."""
        part, at = Part(), buffer_address(into)
        for index, extents in enumerate(msg.extents):
            offset = 0
            for address, length in extents:
                part.add(index, offset, at, address, length)
                at, offset = at + length, offset + length
        try:
            with self._agent.transfer(peer_agent, msg.request_id, op="READ", hold=hold) as transfer:
                transfer.post([part], registered)
                transfer.wait()
        except NixlTransferNotReleased as exc:  # neither the open region nor a pooled buffer may take its bytes
            self._engine.fail(f"{exc}; the daemon stops without reusing that memory (a restart recovers from flash)")
            raise

    def _abandon(self, reservation) -> tuple:
        """The hold of an in-place READ parked in flight: the open region moves to a fresh image, and
        the old one is kept (registered) until NIXL has ended the READ."""
        old = self._engine.abandon_put(reservation)
        with self._lock:
            self._images_held += 1
            self.images_abandoned += 1
        log.warning("event=nixl_put_image_abandoned bytes=%d held=%d", old.nbytes, self._images_held)

        def give_back() -> None:
            self._agent.deregister_fixed(old)
            with self._lock:
                self._images_held -= 1

        return give_back, old.nbytes

    def _in_place_usable(self) -> bool:
        """Whether a NIXL_PUT may be READ into the open region: NIXL took its images so far, and not
        too many abandoned ones are held."""
        with self._lock:
            return not self._images_refused and self._images_held < IMAGES_ABANDONED_MAX

    def _image_registered(self, image: memoryview) -> bool:
        """Register the open image a reservation lies in (once: a no-op after); False, and every
        NIXL_PUT copied from now on, where NIXL refuses it."""
        try:
            self._agent.register_fixed([image])
        except NixlTransferError as exc:
            log.warning("event=nixl_put_images_refused error=%s", exc)
            with self._lock:
                self._images_refused = True
            return False
        return True
