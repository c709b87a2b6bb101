"""PUT payloads received straight into the open region's image: reserve, fill, commit or abort.

::

    reserve ──lock──> room for the frame's blocks at data_end, held as *pending* ──> a writable view
       │      the connection recv_into's the payload there, without the lock
       v
    commit ──no lock: header, key, length and payload CRC checked where the bytes landed──>
           ──lock──> seqs stamped, summary entries, index ──durable?──> written and synced
    abort  ──> the view zeroed, the room given back

At most one reservation is in flight (:attr:`Allocator.reservation`); while it is, every other
writer of the open image waits (:meth:`Allocator.wait_unreserved`) and the image is not sealed,
so the blocks of a reservation are placed at ``data_end`` in one step and get seqs in place
order, as appended blocks do (the recovery walk and the summary rely on both). A PUT that finds
one in flight waits for it up to RESERVATION_WAIT_S, then is received the old way (an arena,
then :meth:`Engine.put_many`).

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

from kvtier.common.blockformat import HEADER_SIZE, BlockFormatError, verify_block

from . import regionfmt as fmt
from .allocator import Allocator
from .blockmap import BlockMap
from .durability import Durability
from .errors import DeviceError, EngineError
from .take_back import appends_or_nothing, forget_new_keys
from .seqs import SeqCounter
from .statistics import EngineCounters

RESERVATION_WAIT_S = 0.25  # a PUT waits this long for the reservation in flight (a few frames' worth at
# loopback rates) before it is received the copying way, whose append waits for the reservation too: the
# data server bounds a stalled one (connection_loop.RESERVED_PAYLOAD_STALL_S, NIXL's TRANSFER_TIMEOUT_S)


@dataclass
class Reservation:
    """Room in the open image for one PUT frame's blocks, back to back from ``offset``."""

    region: int
    offset: int
    view: memoryview  # the frame's payload lands here (writable, ``sum(lengths)`` bytes)
    keys: tuple[bytes, ...]
    lengths: tuple[int, ...]
    image: memoryview  # the whole open image ``view`` lies in (for a transport that registers memory)
    resolved: bool = False  # committed or aborted


class InPlacePuts:
    def __init__(self, blocks: BlockMap, allocator: Allocator, durability: Durability, lock: threading.RLock,
                 seqs: SeqCounter, counters: EngineCounters, check_open: Callable[[], None], block_size_max: Callable[[], int],
                 region_size_bytes: int, put_many: Callable, commit_durable: Callable[[list[tuple]], None]):
        self._blocks = blocks
        self._allocator = allocator
        self._durability = durability
        self._lock = lock
        self._seqs = seqs
        self._counters = counters
        self._check_open = check_open
        self._block_size_max = block_size_max
        self._region_size = region_size_bytes
        self._put_many = put_many  # the copying path, for a frame whose keys were stored meanwhile
        self._commit_durable = commit_durable  # group commit of (k0, k1, addr, seq) placed; taken back if it fails

    def reserve(self, keys: Sequence[bytes], lengths: Sequence[int], new_region: bool,
                room_errors: bool = False) -> Reservation | None:
        """Room for blocks of these keys and lengths in the open image, or None: one is in flight,
        a key is present or repeated, a length is implausible, or the frame does not fit the open
        region and ``new_region`` is False (the caller then receives it into a buffer of its own).
        ``new_region``: seal the open region (or reclaim one) when the frame does not fit it;
        ``room_errors``: a failure to make that room raises (else None: the copying path meets it)."""
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
                    if room_errors:
                        raise
                    return None  # the copying path meets the same failure and answers it
                if allocator.reservation is not None or (self._blocks.index.find_many(k0, k1) >= 0).any():
                    return None  # the lock was let go while waiting for a clean region: another PUT came first
            image = allocator.open
            image.pending_bytes, image.pending_entries = total, len(keys)
            offset = image.data_end
            reservation = Reservation(image.region, offset, image.buffer[offset:offset + total], keys, lengths,
                                      image.buffer)
            allocator.reservation = reservation
        return reservation

    def commit(self, reservation: Reservation, durable: bool, headers: list | None = None) -> list[int]:
        """Check every block where it landed, then store them all (durable: on flash and synced on
        return); returns their seqs. A block that fails its check aborts the reservation and
        raises BlockFormatError naming it: nothing of the frame is stored. ``headers``: the blocks
        were verified before they were copied here by this process (Engine.put_many), so they are
        not checked again."""
        assert not reservation.resolved, "reservation committed or aborted twice"
        views, pos = [], 0
        checked = headers is not None
        headers = list(headers) if checked else []
        for i, (key, length) in enumerate(zip(reservation.keys, reservation.lengths)):
            view = reservation.view[pos:pos + length]
            pos += length
            if not checked:
                try:
                    headers.append(verify_block(view, expected_key=key))
                except BlockFormatError as exc:
                    self.abort(reservation)
                    raise BlockFormatError(f"PUT item {i} (key {key.hex()}): {exc}; nothing stored") from None
            views.append(view)
        k0, k1 = fmt.keys_to_halves(reservation.keys)
        allocator = self._allocator
        with self._lock, ExitStack() as on_error:
            assert allocator.reservation is reservation, "a reservation that is not the one in flight"
            if (self._blocks.index.find_many(k0, k1) >= 0).any():
                # stored meanwhile by a PUT that had received its frame before this one was reserved:
                # the copying path gives present keys their seqs (rare: one copy of this frame)
                copies = [bytes(view) for view in views]
                np.frombuffer(reservation.view, np.uint8).fill(0)
                self._release(reservation)
                return self._put_many(copies, durable)
            image, base = allocator.open, reservation.region * self._region_size
            assert image.region == reservation.region and image.data_end == reservation.offset
            self._release(reservation)  # its blocks become appends (the lock is held throughout)
            on_error.push(lambda kind, *_: _zero_if_failed(kind, reservation))  # after the take-back below
            on_error.enter_context(appends_or_nothing(  # a commit that fails (a durable write) is taken back
                allocator, self._blocks.table, self._region_size, self._durability.cover,
                forget_new_keys(self._blocks, k0, k1, np.full(len(k0), -1))))
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
            self._counters.puts_received_in_place += len(seqs)
            placed = [(k0_, k1_, addr, seq) for (k0_, k1_, addr, _, _), seq in zip(pending, seqs)]
            self._blocks.insert_appended(pending)
            allocator.reap_seal(wait=False)
        if durable:
            self._commit_durable(placed)  # without the lock (Engine._commit_or_take_back)
        return seqs

    def abort(self, reservation: Reservation) -> None:
        """Give the room back: nothing of the frame is stored (idempotent after a commit)."""
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


def _zero_if_failed(kind, reservation: Reservation) -> None:
    """A commit that failed after its reservation became appends: the take-back zeroed what it
    placed; this zeroes the rest of the frame, so no client bytes are left past ``data_end``."""
    if kind is not None:
        np.frombuffer(reservation.view, np.uint8).fill(0)
