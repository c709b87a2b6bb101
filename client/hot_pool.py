"""The hot tier: ref-counted KV blocks in the engine's device memory.

Two layers, as vLLM's block pool separates bookkeeping from memory:

* :class:`HotPoolIndex` - pure bookkeeping, no tensors, no I/O. A prefix
  table (block key -> slot; keys chain, so a key names its whole prefix and
  a shared prefix is held once), a reference count per block, and an LRU
  queue over the *unreferenced* resident blocks. A referenced block is never
  evicted; a block being filled is invisible to readers until committed.
* :class:`HotPool` - one preallocated tensor ``[capacity, *block_shape]`` on
  the engine's device (HBM on a GPU, host memory on the CPU) plus the index,
  behind one lock.

Life of a slot::

    free --reserve--> filling(refs=1) --commit--> ready(refs>=1) --release--> ready(refs=0, in LRU)
                         |                            ^                              |
                         +--abort--> free             +-----------acquire------------+
    ready(refs=0) --evicted (LRU head, when a slot is needed)--> free

Error tiers (vLLM style): a shortage (every slot referenced) returns ``None``;
a caller error (releasing what it does not hold) raises ``ValueError``; a
broken invariant is an assert naming the key.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

from .block_payload import copy_tensor
from kvtier.common.keys import KVLayout

HOT_POOL_BLOCKS_MAX = 1 << 22  # 4M slots: keeps the index's dicts well under 1 GiB of host memory


@dataclass
class _Entry:
    slot: int
    refs: int
    ready: bool


@dataclass(frozen=True)
class HotPoolStatistics:
    capacity_blocks: int
    resident_blocks: int  # ready or filling
    referenced_blocks: int
    free_blocks: int
    evictions: int
    reservations_refused: int  # reserve() found every slot referenced


class HotPoolIndex:
    """Bookkeeping of the hot pool (see the module doc). Not thread-safe by
    itself: :class:`HotPool` serialises calls."""

    def __init__(self, capacity_blocks: int) -> None:
        if not isinstance(capacity_blocks, int) or not 0 <= capacity_blocks <= HOT_POOL_BLOCKS_MAX:
            raise ValueError(f"hot pool capacity must be an int in 0..{HOT_POOL_BLOCKS_MAX} blocks, "
                             f"got {capacity_blocks!r}")
        self.capacity_blocks = capacity_blocks
        self._entries: dict[bytes, _Entry] = {}
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # unreferenced ready blocks, oldest first
        self._free: list[int] = list(range(capacity_blocks - 1, -1, -1))  # pop() gives slot 0 first
        self._evictions = 0
        self._refused = 0

    # --- readers -------------------------------------------------------
    def acquire(self, key: bytes) -> int | None:
        """Reference one ready block; its slot, or None if absent or being filled."""
        entry = self._entries.get(key)
        if entry is None or not entry.ready:
            return None
        self._ref(key, entry)
        return entry.slot

    def acquire_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """Reference the leading ready blocks of ``keys``; their slots, in order.
        Stops at the first key that is absent or still being filled."""
        slots: list[int] = []
        for key in keys:
            slot = self.acquire(key)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def contains(self, key: bytes) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.ready

    def release(self, keys: Sequence[bytes]) -> None:
        """Drop one reference from each key; a block whose count reaches zero
        becomes the most recently used entry of the LRU queue."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or entry.refs <= 0:
                raise ValueError(f"release of hot block {key.hex()} that is not referenced")
            if not entry.ready:
                raise ValueError(f"release of hot block {key.hex()} that is still being filled; "
                                 "commit or abort it")
            entry.refs -= 1
            if entry.refs == 0:
                assert key not in self._lru, f"referenced block {key.hex()} was in the LRU queue"
                self._lru[key] = None

    # --- writers -------------------------------------------------------
    def reserve(self, key: bytes) -> tuple[int, bool] | None:
        """A slot for ``key``, referenced by the caller: ``(slot, True)`` for a
        fresh slot to fill and then :meth:`commit` (or :meth:`abort`);
        ``(slot, False)`` when the block is already resident and ready (held
        once: the caller shares it). ``None`` when the key is being filled by
        someone else, or when every slot is referenced (a shortage)."""
        entry = self._entries.get(key)
        if entry is not None:
            if not entry.ready:
                return None
            self._ref(key, entry)
            return entry.slot, False
        slot = self._take_slot()
        if slot is None:
            self._refused += 1
            return None
        self._entries[key] = _Entry(slot=slot, refs=1, ready=False)
        return slot, True

    def commit(self, key: bytes) -> None:
        """Mark a reserved block filled: readers may now acquire it. The
        caller keeps its reference (release it when done)."""
        entry = self._entries.get(key)
        if entry is None or entry.ready:
            raise ValueError(f"commit of hot block {key.hex()} that was not reserved")
        assert entry.refs == 1, f"block {key.hex()} being filled has {entry.refs} references"
        entry.ready = True

    def abort(self, key: bytes) -> None:
        """Give back a reserved slot whose fill failed; the block stays absent."""
        entry = self._entries.get(key)
        if entry is None or entry.ready:
            raise ValueError(f"abort of hot block {key.hex()} that was not reserved")
        del self._entries[key]
        self._free.append(entry.slot)

    def discard(self, key: bytes) -> bool:
        """Drop an unreferenced ready block (its data turned out stale). False
        if absent, referenced or being filled."""
        entry = self._entries.get(key)
        if entry is None or not entry.ready or entry.refs:
            return False
        del self._lru[key]
        del self._entries[key]
        self._free.append(entry.slot)
        return True

    def lru_order(self) -> list[bytes]:
        """Unreferenced resident keys, next to be evicted first (for tests and tools)."""
        return list(self._lru)

    def statistics(self) -> HotPoolStatistics:
        referenced = sum(1 for e in self._entries.values() if e.refs)
        return HotPoolStatistics(capacity_blocks=self.capacity_blocks, resident_blocks=len(self._entries),
                                 referenced_blocks=referenced, free_blocks=len(self._free),
                                 evictions=self._evictions, reservations_refused=self._refused)

    # --- internals -----------------------------------------------------
    def _ref(self, key: bytes, entry: _Entry) -> None:
        if entry.refs == 0:
            del self._lru[key]
        entry.refs += 1

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._lru:
            return None
        victim, _ = self._lru.popitem(last=False)
        entry = self._entries.pop(victim)
        assert entry.refs == 0 and entry.ready, f"evicting block {victim.hex()} with {entry.refs} references"
        self._evictions += 1
        return entry.slot


class HotPool:
    """Preallocated block memory on the engine's device plus a
    :class:`HotPoolIndex`, thread-safe. Blocks are ``layout.block_shape``
    tensors of ``layout.dtype``."""

    def __init__(self, layout: KVLayout, capacity_bytes: int, device: str = "cpu") -> None:
        import torch

        if capacity_bytes < 0:
            raise ValueError(f"hot pool size must be >= 0 bytes, got {capacity_bytes}")
        self.layout = layout
        self.block_bytes = layout.block_raw_bytes
        capacity = min(capacity_bytes // self.block_bytes, HOT_POOL_BLOCKS_MAX)
        self.index = HotPoolIndex(capacity)
        self._lock = threading.Lock()
        self.device = torch.device(device)
        self.storage = torch.empty((capacity, *layout.block_shape), dtype=getattr(torch, layout.dtype),
                                   device=self.device)

    @property
    def capacity_blocks(self) -> int:
        return self.index.capacity_blocks

    @contextmanager
    def lease(self, keys: Sequence[bytes], prefix_only: bool = True) -> Iterator["HotLease"]:
        """Hold the resident blocks of ``keys`` for the ``with`` body - the
        leading run (``prefix_only``) or every one found; they cannot be
        evicted until the body ends (even by an exception)."""
        keys = list(keys)
        with self._lock:
            if prefix_only:
                found = self.index.acquire_prefix(keys)
                slots: list[int | None] = found + [None] * (len(keys) - len(found))
            else:
                slots = [self.index.acquire(key) for key in keys]
        held = [key for key, slot in zip(keys, slots) if slot is not None]
        try:
            yield HotLease(keys=tuple(keys), slots=tuple(slots), storage=self.storage)
        finally:
            with self._lock:
                self.index.release(held)

    # --- filling (decode straight into pool memory) -------------------
    def reserve(self, key: bytes) -> tuple[int, bool] | None:
        """See :meth:`HotPoolIndex.reserve`; the caller must end with
        :meth:`commit` + :meth:`release` or :meth:`abort` (fresh slots) or
        :meth:`release` (shared ones)."""
        with self._lock:
            return self.index.reserve(key)

    def commit(self, key: bytes) -> None:
        with self._lock:
            self.index.commit(key)

    def abort(self, key: bytes) -> None:
        with self._lock:
            self.index.abort(key)

    def release(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self.index.release(keys)

    def discard(self, key: bytes) -> bool:
        with self._lock:
            return self.index.discard(key)

    def put(self, key: bytes, block) -> bool:
        """Copy ``block`` (a ``block_shape`` tensor) into the pool. True if it
        is resident afterwards (newly or already), False on a shortage."""
        return self.put_with(key, lambda slot: copy_tensor(slot, block))

    def put_with(self, key: bytes, fill) -> bool:
        """:meth:`put`, with ``fill(slot_tensor)`` writing the block into its slot."""
        with self._lock:
            got = self.index.reserve(key)
        if got is None:
            return False
        slot, fresh = got
        if fresh:
            try:
                fill(self.storage[slot])
            except BaseException:
                with self._lock:
                    self.index.abort(key)
                raise
            with self._lock:
                self.index.commit(key)
        with self._lock:
            self.index.release([key])
        return True

    def put_many(self, keys: Sequence[bytes], blocks) -> int:
        """:meth:`put` for each (key, block); the number made resident."""
        return sum(1 for key, block in zip(keys, blocks) if self.put(key, block))

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return self.index.contains(key)

    def statistics(self) -> HotPoolStatistics:
        with self._lock:
            return self.index.statistics()


@dataclass(frozen=True)
class HotLease:
    """Blocks held by a :meth:`HotPool.lease`: ``keys[i]`` lives in
    ``slots[i]``, or is not resident (``None``)."""

    keys: tuple[bytes, ...]
    slots: tuple[int | None, ...]
    storage: object  # the pool's tensor

    @property
    def hits(self) -> int:
        return sum(1 for s in self.slots if s is not None)

    def block(self, i: int):
        """A view of the i-th block (valid while the lease is held); None if not resident."""
        slot = self.slots[i]
        return None if slot is None else self.storage[slot]
