"""The in-memory index: key -> location, 32 bytes a slot (pure, no I/O).

An open-addressing hash table with linear probing, kept as five NumPy
columns (structure of arrays) so batch lookups and bulk inserts are one
vectorized pass::

    slot:  k0 u64 | k1 u64 | addr u64 | length u32 | meta u32     = 32 bytes
           key halves  logical offset   0 = empty    bit 31: pinned
                                        ~0 = deleted bits 0-30: seq - region base seq
    [hits u8]  reads since written or moved, saturating: only with ``track_hits``
               (a reinsertion policy needs it), +1 byte a slot

The home slot is a seeded multiplicative mix of both key halves, not
``k0 % capacity``: kvtier's own keys are BLAKE2b digests, but the
daemon stores whatever 16 bytes a client sends, and keys that count up in
their first 8 bytes would pile into one run of slots (every probe of an
absent key would walk the whole run). The seed is drawn per table, so a
client cannot choose keys that pile up (short of trivially related pairs,
which collide in twos). The table grows by GROWTH_FACTOR when live + deleted
slots would pass LOAD_FACTOR_MAX; a rehash drops the deleted markers. The seq of a
block is ``region base seq + delta``: the region table holds the base, so the
index does not spend 8 bytes a block on it. Namespace ids are not kept here
(they live in the on-flash summaries).
"""
from __future__ import annotations

import secrets
from contextlib import contextmanager
from typing import Iterator

import numpy as np

CAPACITY_MIN = 1024  # smallest table
LOAD_FACTOR_MAX = 0.75  # linear probing stays short below this
GROWTH_FACTOR = 1.5  # not 2: at 32 B/slot, doubling would put a just-grown table at ~85 B/block
EMPTY = 0
DELETED = 0xFFFFFFFF
PINNED_BIT = 1 << 31
SEQ_DELTA_MAX = PINNED_BIT - 1  # a region's seq span must fit 31 bits
SLOT_BYTES = 32
HITS_BYTES = 1  # the optional read-count column
HITS_MAX = 255  # read counts saturate (one byte)
BULK_RATIO = 16  # an insert of >= capacity/16 keys is a bulk load (recovery, rehash)
PROBE_WINDOW = 16  # slots per key per round of find_many after the home slot
_PROBE_OFFSETS = np.arange(PROBE_WINDOW, dtype=np.int64)
_MASK64 = (1 << 64) - 1
_M0, _M1, _M2 = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0xFF51AFD7ED558CCD  # odd multipliers
_U32, _U0, _U1, _U2 = np.uint64(32), np.uint64(_M0), np.uint64(_M1), np.uint64(_M2)


def _home(k0: int, k1: int, seed: int, capacity: int) -> int:
    """The home slot of a key: both halves multiplied in, mixed once more, and the high 32
    bits scaled onto the table (no division)."""
    k0, k1 = int(k0), int(k1)
    x = (((k0 ^ seed) * _M0) ^ (k1 * _M1)) & _MASK64
    x = ((x ^ (x >> 32)) * _M2) & _MASK64
    return ((x >> 32) * capacity) >> 32


def _home_many(k0: np.ndarray, k1: np.ndarray, seed: int, capacity: int) -> np.ndarray:
    """:func:`_home` of each key, in wrapping uint64 arithmetic, in place where it can."""
    x = np.bitwise_xor(np.asarray(k0, np.uint64), np.uint64(seed))
    x *= _U0
    x ^= np.multiply(np.asarray(k1, np.uint64), _U1)
    x ^= x >> _U32
    x *= _U2
    x >>= _U32
    x *= np.uint64(capacity)
    x >>= _U32
    return x.view(np.int64)


class BlockIndex:
    def __init__(self, capacity: int = CAPACITY_MIN, track_hits: bool = False):
        self.track_hits = track_hits
        self._seed = secrets.randbits(64)
        self._allocate(max(capacity, CAPACITY_MIN))
        self._live = 0
        self._deleted = 0
        # odd while a change of which keys are present (insert, remove, clear, a resize) is under way,
        # bumped twice by each: a reader without the lock trusts a find only if it saw the same even value
        # before and after (:meth:`find_many_unlocked`)
        self.version = 0

    def _allocate(self, capacity: int) -> None:
        assert capacity < 1 << 32, f"index of {capacity} slots: home slots are scaled from 32 bits"
        self.capacity = capacity
        self.k0 = np.zeros(capacity, np.uint64)
        self.k1 = np.zeros(capacity, np.uint64)
        self.addr = np.zeros(capacity, np.uint64)
        self.length = np.zeros(capacity, np.uint32)
        self.meta = np.zeros(capacity, np.uint32)
        self.hits = np.zeros(capacity if self.track_hits else 0, np.uint8)

    def __len__(self) -> int:
        return self._live

    @property
    def nbytes(self) -> int:
        return self.capacity * (SLOT_BYTES + (HITS_BYTES if self.track_hits else 0))

    # -- lookups ---------------------------------------------------------
    def find(self, k0: int, k1: int) -> int:
        """The slot holding the key, or -1."""
        capacity = self.capacity
        pos = _home(k0, k1, self._seed, capacity)
        length, keys0, keys1 = self.length, self.k0, self.k1
        while True:
            ln = int(length[pos])
            if ln == EMPTY:
                return -1
            if ln != DELETED and int(keys0[pos]) == k0 and int(keys1[pos]) == k1:
                return pos
            pos = pos + 1 if pos + 1 < capacity else 0

    def find_many(self, k0: np.ndarray, k1: np.ndarray) -> np.ndarray:
        """Slots for a batch of keys (-1 where absent). A vectorized pass costs the same for
        one key as for a thousand, so the rounds are what count: one round at the home slots
        (most keys end there), then windows of PROBE_WINDOW slots per key until each key meets
        itself or an empty slot -- the batch's longest probe takes a round or two, not one
        round per slot (10 rounds for 512 keys in a half-full table)."""
        k0, k1 = np.asarray(k0, np.uint64), np.asarray(k1, np.uint64)
        result = np.full(len(k0), -1, np.int64)
        pos = self._home_many(k0, k1)
        ln = self.length[pos]
        hit = (ln != EMPTY) & (ln != DELETED) & (self.k0[pos] == k0) & (self.k1[pos] == k1)
        result[hit] = pos[hit]
        active = np.flatnonzero(~hit & (ln != EMPTY))
        start = pos[active] + 1
        while active.size:
            window = start[:, None] + _PROBE_OFFSETS
            window[window >= self.capacity] -= self.capacity
            ln = self.length[window]
            match = ((ln != EMPTY) & (ln != DELETED) & (self.k0[window] == k0[active, None])
                     & (self.k1[window] == k1[active, None]))
            stop = match | (ln == EMPTY)
            first = stop.argmax(axis=1)
            rows = np.arange(len(active))
            stopped = stop[rows, first]
            found = stopped & match[rows, first]
            result[active[found]] = window[rows[found], first[found]]
            active, start = active[~stopped], window[~stopped, -1] + 1
        return result

    def find_many_unlocked(self, k0: np.ndarray, k1: np.ndarray) -> np.ndarray | None:
        """:meth:`find_many` by a reader that does not hold the engine lock: the slots, or None when
        a change of which keys are present overlapped the probe (the caller asks again under the
        lock). Every table, old or new, keeps empty slots, so a probe over one changing under it
        still ends; what it found is trusted only if no change began or ended meanwhile."""
        before = self.version
        if before & 1:
            return None
        try:
            slots = self.find_many(k0, k1)
        except (IndexError, ValueError):  # arrays swapped by a resize between two reads of the probe
            return None
        return slots if self.version == before else None

    @contextmanager
    def _changing(self) -> Iterator[None]:
        """A change of which keys are present: :attr:`version` is odd while it runs."""
        self.version += 1
        try:
            yield
        finally:
            self.version += 1

    def live_slots(self) -> np.ndarray:
        ln = self.length
        return np.nonzero((ln != EMPTY) & (ln != DELETED))[0]

    def count_hits(self, slots: np.ndarray) -> None:
        """One more read of each of these live slots (a slot listed twice counts once), saturating.
        A no-op unless the index tracks hits."""
        if self.track_hits:
            self.hits[slots] = np.minimum(self.hits[slots].astype(np.uint16) + 1, HITS_MAX)

    def slots_in_range(self, lo: int, hi: int) -> np.ndarray:
        """Live slots whose address is in [lo, hi) -- the blocks of one region."""
        ln = self.length
        return np.nonzero((self.addr >= np.uint64(lo)) & (self.addr < np.uint64(hi))
                          & (ln != EMPTY) & (ln != DELETED))[0]

    # -- updates ---------------------------------------------------------
    def insert(self, k0: int, k1: int, addr: int, length: int, meta: int) -> int:
        """Add a key that is not present; returns its slot."""
        with self._changing():
            assert EMPTY < length < DELETED, length
            self._reserve(1)
            capacity = self.capacity
            pos = _home(k0, k1, self._seed, capacity)
            while True:
                ln = int(self.length[pos])
                if ln == EMPTY or ln == DELETED:
                    break
                assert not (int(self.k0[pos]) == k0 and int(self.k1[pos]) == k1), "insert of a present key"
                pos = pos + 1 if pos + 1 < capacity else 0
            if ln == DELETED:
                self._deleted -= 1
            self.k0[pos], self.k1[pos], self.addr[pos] = k0, k1, addr
            self.length[pos], self.meta[pos] = length, meta
            if self.track_hits:
                self.hits[pos] = 0
            self._live += 1
            return pos

    def insert_many(self, k0, k1, addr, length, meta, hits=None) -> None:
        """Add keys that are absent and unique within the batch, vectorized (read counts 0 unless given)."""
        with self._changing():
            n = len(k0)
            if not n:
                return
            assert np.all(length > EMPTY) and np.all(length < DELETED)
            self._reserve(n)
            self._place(np.asarray(k0, np.uint64), np.asarray(k1, np.uint64), np.asarray(addr, np.uint64),
                        np.asarray(length, np.uint32), np.asarray(meta, np.uint32),
                        np.zeros(n if self.track_hits else 0, np.uint8) if hits is None else np.asarray(hits, np.uint8))

    def _place(self, k0, k1, addr, length, meta, hits) -> None:
        pending = np.arange(len(k0))
        pos = self._home_many(k0, k1)
        # a bulk load marks claims in a table-sized scratch array (linear time); a small batch sorts
        claim = np.full(self.capacity, -1, np.int32) if len(k0) * BULK_RATIO >= self.capacity else None
        while pending.size:
            ln = self.length[pos]
            free = np.nonzero((ln == EMPTY) | (ln == DELETED))[0]
            if claim is not None:
                claim[pos[free]] = free  # with several claimants of one slot, one of them wins
                winners = free[claim[pos[free]] == free]
                claim[pos[free]] = -1
            else:
                winners = free[np.unique(pos[free], return_index=True)[1]]
            slots, items = pos[winners], pending[winners]
            self._deleted -= int(np.count_nonzero(self.length[slots] == DELETED))
            self.k0[slots], self.k1[slots], self.addr[slots] = k0[items], k1[items], addr[items]
            self.length[slots], self.meta[slots] = length[items], meta[items]
            if self.track_hits:
                self.hits[slots] = hits[items]
            self._live += len(slots)
            keep = np.ones(len(pending), bool)
            keep[winners] = False
            pending = pending[keep]
            pos = self._next(pos[keep])

    def _home_many(self, k0: np.ndarray, k1: np.ndarray) -> np.ndarray:
        return _home_many(k0, k1, self._seed, self.capacity)

    def _next(self, pos: np.ndarray) -> np.ndarray:
        pos += 1
        pos[pos == self.capacity] = 0
        return pos

    def remove(self, slots) -> None:
        """Delete the given live slots."""
        with self._changing():
            slots = np.unique(np.asarray(slots, np.int64))
            if not slots.size:
                return
            ln = self.length[slots]
            assert np.all((ln != EMPTY) & (ln != DELETED)), "remove of a free slot"
            self.length[slots] = DELETED
            self._live -= len(slots)
            self._deleted += len(slots)

    def clear(self) -> None:
        with self._changing():
            self._allocate(CAPACITY_MIN)
            self._live = self._deleted = 0

    def _reserve(self, extra: int) -> None:
        if self._live + self._deleted + extra <= self.capacity * LOAD_FACTOR_MAX:
            return
        need = self._live + extra
        capacity = self.capacity
        while need > capacity * LOAD_FACTOR_MAX:
            capacity = int(capacity * GROWTH_FACTOR)
        live = self.live_slots()
        cols = (self.k0[live], self.k1[live], self.addr[live], self.length[live], self.meta[live],
                self.hits[live] if self.track_hits else self.hits)
        self._allocate(capacity)
        self._live = self._deleted = 0
        self._place(*cols)

