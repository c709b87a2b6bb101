"""Every PUT, one way: reserve room in the open region's image, fill it without the lock, commit.

::

    reserve ──lock──> room for blocks at data_end, held as *pending* ──> a writable view
       │      (a batch the open region cannot take: sealed, or a clean region waited for)
       v
    fill   ──no lock──> a TCP PUT's connection recv_into's its payload there;
       │             put_many copies verified blocks in (NIXL PUTs, the upstream, pushes)
       v
    commit ──no lock: header, key, length and payload CRC checked where the bytes landed
           (blocks put_many verified before the copy are not checked again)──>
           ──lock──> seqs stamped, summary entries, index ──durable?──> written and synced
    abort  ──> the view zeroed, the room given back

:meth:`Puts.put_many` answers present keys, keys repeated in its batch and (``skip_deleted``)
keys deleted lately from the index, and places the rest in one reservation where one region takes
them all (all or nothing), else reservation by reservation, as many as the open region takes; such
a batch that fails after crossing into a new region keeps what it committed before.

At most one reservation is in flight (:attr:`Allocator.reservation`); while it is, every other
writer of the open image waits (:meth:`Allocator.wait_unreserved`, bounded) and the image is not
sealed, so the blocks of a reservation are placed at ``data_end`` in one step and get seqs in
place order (the recovery walk and the summary rely on both). A TCP PUT that finds one in flight
waits for it up to RESERVATION_WAIT_S, then is received into a buffer and stored by put_many.

Crash ordering: a reservation's bytes lie past ``data_end`` until commit, so no durability
write and no seal covers them while they arrive; an aborted one is zeroed before its room is
given back, so nothing a client sent for it is left past ``data_end`` where a later
page-aligned prefix write could carry it to flash for the recovery walk to find. A crash with
a reservation in flight, or after an abort, therefore recovers no block of it; a committed one
is exactly an appended block.
"""
from __future__ import annotations

import threading
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from kvtier.common.blockformat import HEADER_SIZE, BlockFormatError, BlockHeader, verify_block

from . import regionfmt as fmt
from .allocator import Allocator
from .blockmap import BlockMap
from .buffers import copy_bytes
from .durability import Durability
from .errors import DeviceError, EngineError
from .seqs import SeqCounter
from .statistics import EngineCounters
from .take_back import appends_or_nothing, forget_new_keys, take_back_failed_commit

RESERVATION_WAIT_S = 0.25  # a TCP PUT waits this long for the reservation in flight (a few frames' worth at
# loopback rates) before it is received into a buffer, whose put_many waits for the reservation too: the
# data server bounds a stalled one (connection_loop.RESERVED_PAYLOAD_STALL_S, NIXL's TRANSFER_TIMEOUT_S)


@dataclass
class Reservation:
    """Room in the open image for blocks, back to back from ``offset``."""

    region: int
    offset: int
    view: memoryview  # the blocks land here (writable, ``sum(lengths)`` bytes)
    keys: tuple[bytes, ...]
    lengths: tuple[int, ...]
    resolved: bool = False  # committed or aborted


@dataclass
class _Batch:
    """What put_many has answered so far of its blocks."""

    keys: list[bytes]
    k0: np.ndarray
    k1: np.ndarray
    seqs: list[int]
    first_of: dict  # (k0, k1) -> the index of the block that places that key
    repeats: list[tuple[int, int]]  # (index, index of the same key's first block)
    placed: list[tuple]  # (k0, k1, addr, seq) of what it committed, for its durable commit


class Puts:
    def __init__(self, blocks: BlockMap, allocator: Allocator, durability: Durability, lock: threading.RLock,
                 seqs: SeqCounter, counters: EngineCounters, check_open: Callable[[], None],
                 block_size_max: Callable[[], int], region_size_bytes: int, fail: Callable[[str], None]):
        self._blocks = blocks
        self._allocator = allocator
        self._durability = durability
        self._lock = lock
        self._seqs = seqs
        self._counters = counters
        self._check_open = check_open
        self._block_size_max = block_size_max
        self._region_size = region_size_bytes
        self._fail = fail

    # -- put_many: reservations filled by copying ---------------------------------
    def put_many(self, views: list[memoryview], headers: list, durable: bool, skip_deleted: bool) -> list[int]:
        """Store verified blocks (``headers``: theirs); their seqs, 0 for one skipped as deleted."""
        keys = [h.key for h in headers]
        k0, k1 = fmt.keys_to_halves(keys)
        batch = _Batch(keys, k0, k1, [0] * len(views), {}, [], [])
        todo = list(range(len(views)))
        while todo:
            reservation, chunk, todo = self._reserve_next(views, todo, batch, skip_deleted)
            if reservation is None:
                break
            try:
                pos = 0
                for i in chunk:
                    copy_bytes(reservation.view[pos:pos + views[i].nbytes], views[i])
                    pos += views[i].nbytes
            except BaseException:
                self.abort(reservation)
                raise
            for i, seq in zip(chunk, self._place(reservation, [headers[i] for i in chunk], batch.placed)):
                batch.seqs[i] = seq
        for i, first in batch.repeats:
            batch.seqs[i] = batch.seqs[first]
        if durable:  # present keys too: one a buffered PUT placed is durable only once committed
            self.commit_durable(batch.placed)
        return batch.seqs

    def _reserve_next(self, views, todo: list[int], batch: _Batch, skip_deleted: bool):
        """(reservation, its blocks, the blocks left) for the next blocks of ``todo`` that need
        placing, as many as the open region takes (a new one if it takes none); (None, [], [])
        once none is left to place."""
        allocator = self._allocator
        allocator.await_seal_for(sum(views[i].nbytes for i in todo), len(todo))
        with self._lock:
            while True:  # waits below let go of the lock: every decision is taken again after one
                self._check_open()
                allocator.wait_unreserved()
                new, present, repeats, skipped = self._new_keys(todo, batch, skip_deleted)
                total = sum(views[i].nbytes for i in new)
                if new and not allocator.appendable(total, len(new)) and \
                        total + fmt.ENTRY_BYTES * len(new) <= allocator.capacity_bytes:
                    allocator.ensure_room(total, len(new))  # what fits one region goes in one: all or nothing
                    continue
                total = count = 0
                for i in new:  # more than a region takes: as many as the open region takes
                    if not allocator.appendable(total + views[i].nbytes, count + 1):
                        break
                    total, count = total + views[i].nbytes, count + 1
                if new and not count:
                    allocator.ensure_room(views[new[0]].nbytes)
                    continue
                for i, seq in present:
                    batch.seqs[i] = seq
                batch.repeats += repeats
                self._counters.puts_skipped_deleted += skipped
                if not new:
                    return None, [], []
                chunk = new[:count]
                for i in chunk:
                    batch.first_of[(int(batch.k0[i]), int(batch.k1[i]))] = i
                return self._reserve_here([views[i].nbytes for i in chunk], [batch.keys[i] for i in chunk]), \
                    chunk, new[count:]

    def _new_keys(self, todo: list[int], batch: _Batch, skip_deleted: bool):
        """Of ``todo``: the blocks to place, (index, seq) of those present, (index, first index) of
        repeats, and how many are skipped as deleted (under the lock)."""
        slots = self._blocks.index.find_many(batch.k0[todo], batch.k1[todo]).tolist()
        new, present, repeats, skipped = [], [], [], 0
        first_of = dict(batch.first_of)
        for i, slot in zip(todo, slots):
            key = (int(batch.k0[i]), int(batch.k1[i]))
            if slot >= 0:
                present.append((i, self._blocks.seq_of(slot)))
            elif key in first_of:
                repeats.append((i, first_of[key]))
            elif skip_deleted and self._blocks.deleted.contains(*key):
                skipped += 1
            else:
                first_of[key] = i
                new.append(i)
        return new, present, repeats, skipped

    # -- reservations a caller fills (a TCP PUT's payload) -------------------------------
    def reserve(self, keys: Sequence[bytes], lengths: Sequence[int], new_region: bool) -> Reservation | None:
        """Room for blocks of these keys and lengths in the open image, or None: one is in flight,
        a key is present or repeated, a length is implausible, the open region cannot take them and
        ``new_region`` is False, or making that room failed (the caller then receives them into a
        buffer of its own and stores them with put_many, which meets the same failure and raises it).
        ``new_region``: seal the open region (or reclaim one) when the blocks do not fit it."""
        keys, lengths = tuple(bytes(k) for k in keys), tuple(int(n) for n in lengths)
        total, allocator = sum(lengths), self._allocator
        if not keys or min(lengths) < HEADER_SIZE or max(lengths) > self._block_size_max() or \
                total + fmt.ENTRY_BYTES * len(keys) > allocator.capacity_bytes or len(set(keys)) != len(keys):
            return None
        k0, k1 = fmt.keys_to_halves(keys)
        if new_region:
            allocator.await_seal_for(total, len(keys))
        with self._lock:
            self._check_open()
            if not allocator.wait_unreserved(RESERVATION_WAIT_S) or (self._blocks.index.find_many(k0, k1) >= 0).any():
                return None
            if not allocator.appendable(total, len(keys)):
                if not new_region:
                    return None
                try:
                    allocator.ensure_room(total, len(keys))
                except (EngineError, DeviceError):
                    return None
                if allocator.reservation is not None or (self._blocks.index.find_many(k0, k1) >= 0).any():
                    return None  # the lock was let go while waiting for a clean region: another PUT came first
            return self._reserve_here(lengths, keys)

    def _reserve_here(self, lengths, keys) -> Reservation:
        """The room at the open image's data_end (under the lock, no reservation in flight, room checked)."""
        image = self._allocator.open
        total = sum(lengths)
        image.pending_bytes, image.pending_entries = total, len(lengths)
        offset = image.data_end
        reservation = Reservation(image.region, offset, image.buffer[offset:offset + total], tuple(keys),
                                  tuple(lengths))
        self._allocator.reservation = reservation
        return reservation

    def commit(self, reservation: Reservation, durable: bool) -> list[int]:
        """Check every block where it landed, then store them all (durable: on flash and synced on
        return); returns their seqs. A block that fails its check aborts the reservation and
        raises BlockFormatError naming it: nothing of it is stored."""
        headers, pos = [], 0
        for i, (key, length) in enumerate(zip(reservation.keys, reservation.lengths)):
            try:
                headers.append(verify_item(reservation.view[pos:pos + length], i, key))
            except BlockFormatError:
                self.abort(reservation)
                raise
            pos += length
        placed: list[tuple] = []
        seqs = self._place(reservation, headers, placed, received_in_place=True)
        if durable:
            self.commit_durable(placed)
        return seqs

    def _place(self, reservation: Reservation, headers: list, placed: list[tuple],
               received_in_place: bool = False) -> list[int]:
        """The reservation's blocks become appends: seqs in place order, summary entries, index
        (taken back, and the rest of the room zeroed, if that fails). Adds their (k0, k1, addr, seq)
        to ``placed``; returns their seqs."""
        assert not reservation.resolved, "reservation committed or aborted twice"
        k0, k1 = fmt.keys_to_halves(reservation.keys)
        allocator = self._allocator
        with self._lock, ExitStack() as on_error:
            assert allocator.reservation is reservation, "a reservation that is not the one in flight"
            assert (self._blocks.index.find_many(k0, k1) < 0).all(), "a reserved key was stored meanwhile"
            image, base = allocator.open, reservation.region * self._region_size
            assert image.region == reservation.region and image.data_end == reservation.offset
            self._release(reservation)  # its blocks become appends (the lock is held throughout)
            on_error.push(lambda kind, *_: _zero_if_failed(kind, reservation))  # after the take-back below
            on_error.enter_context(appends_or_nothing(  # a commit that fails (a durable write) is taken back
                allocator, self._blocks.table, self._region_size, self._durability.cover,
                forget_new_keys(self._blocks, k0, k1)))
            seqs, pending = [], []
            for k0_, k1_, header, length in zip(k0.tolist(), k1.tolist(), headers, reservation.lengths):
                seq = self._seqs.take()
                offset = image.data_end
                image.place_block(offset, length, seq, k0_, k1_, header.ns_id, 0)
                pending.append((k0_, k1_, base + offset, length, seq - image.base_seq))
                self._blocks.table.add_block(image.region, length, False)
                seqs.append(seq)
            self._blocks.table.last_seq[image.region] = seqs[-1]
            self._counters.puts += len(seqs)
            self._counters.put_bytes += sum(reservation.lengths)
            self._counters.puts_received_in_place += len(seqs) if received_in_place else 0
            placed += [(k0_, k1_, addr, seq) for (k0_, k1_, addr, _, _), seq in zip(pending, seqs)]
            self._blocks.insert_appended(pending)
            allocator.reap_seal(wait=False)
        return seqs

    def abort(self, reservation: Reservation) -> None:
        """Give the room back: nothing of it is stored (idempotent after a commit)."""
        if reservation.resolved:
            return
        np.frombuffer(reservation.view, np.uint8).fill(0)  # no client bytes left past data_end
        with self._lock:
            if not reservation.resolved:
                self._release(reservation)

    def _release(self, reservation: Reservation) -> None:
        image = self._allocator.open
        assert self._allocator.reservation is reservation and image.data_end == reservation.offset
        image.pending_bytes = image.pending_entries = 0
        reservation.resolved = True
        self._allocator.reservation_resolved()

    # -- durability ------------------------------------------------------------------
    def commit_durable(self, placed: list[tuple]) -> None:
        """Group commit, without the lock (it syncs every device after a seal). If it fails, the
        blocks ``placed`` leave the index and get tombstones (take_back.take_back_failed_commit), and
        the error is raised; if even that fails (no room for a tombstone), the engine fails closed."""
        try:
            self._durability.commit()
        except DeviceError:
            if placed:
                with self._lock:
                    try:
                        take_back_failed_commit(self._blocks, self._allocator, self._durability, placed,
                                                self._region_size)
                    except EngineError as exc:
                        self._fail(f"the blocks of a failed durable commit could not be tombstoned ({exc})")
                        raise
                try:
                    self._durability.commit(with_entries=True)  # their tombstones, without the lock
                except DeviceError:
                    pass  # failed again (counted): every later commit writes them
            raise


def verify_item(view, index: int, key) -> BlockHeader:
    """``view`` checked as PUT item ``index``, of ``key``: header, key, length and payload CRC;
    BlockFormatError naming the item where it fails."""
    try:
        return verify_block(view, expected_key=bytes(key))
    except BlockFormatError as exc:
        raise BlockFormatError(f"PUT item {index} (key {bytes(key).hex()}): {exc}; nothing stored") from None


def _zero_if_failed(kind, reservation: Reservation) -> None:
    """A commit that failed after its reservation became appends: the take-back zeroed what it
    placed; this zeroes the rest of the room, so no client bytes are left past ``data_end``."""
    if kind is not None:
        np.frombuffer(reservation.view, np.uint8).fill(0)
