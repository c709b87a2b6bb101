"""The one GET driver behind ``get``, ``get_many`` and ``get_many_placed``, and the engine's other
reads of the index: LOOKUP (leading keys present), LOCATE (where blocks lie) and a block's info.

::

    keys ──index, lock held──> in a DRAM image? ──yes──> copied out under the lock
                                     │ no
                                     v
               flash read outside the lock ──verify key, seq, CRCs──> bytes, or into the buffer
                                     │ failed: re-located (it may have raced a reclaim), read again
                                     v
               still failing at the place the index holds: dropped as corrupt (a miss)
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

import numpy as np


from kvtier.common.aligned import align_down, align_up, aligned_buffer
from kvtier.common.blockformat import HEADER_SIZE, BlockFormatError, decode_header

from . import regionfmt as fmt
from .allocator import Allocator
from .blockmap import BlockMap
from .buffers import copy_bytes
from .errors import BadArgumentError, EngineError
from .index import PINNED_BIT
from .locations import LOCATION_DTYPE
from .raid0 import StripedArray
from .reader import BlockReader, ReadFailure
from .statistics import EngineCounters

READ_RETRIES = 1  # a flash read that fails verification is retried once (it may have raced a reclaim)


class GetDriver:
    def __init__(self, blocks: BlockMap, allocator: Allocator, reader: BlockReader, lock: threading.RLock,
                 counters: EngineCounters, check_open: Callable[[], None], region_size_bytes: int,
                 array: StripedArray):
        self._array = array
        self._blocks = blocks
        self._allocator = allocator
        self._reader = reader
        self._lock = lock
        self._counters = counters
        self._check_open = check_open  # raises once the engine is closed
        self._region_size = region_size_bytes

    def get(self, keys: Sequence, bufs: Sequence | None = None, verify_payload: bool = True,
            located: np.ndarray | None = None) -> list:
        """Block i as bytes, or None -- or, with ``bufs``, placed in ``bufs[i]``: (offset, size)
        (see ``Engine.get_many_placed``). ``located``: the keys' rows from :meth:`locate` with
        ``for_read`` (counted and touched there): the blocks on flash are read where it found them,
        without resolving them again (one that moved since fails its key/seq check and is located
        anew); the others, in a DRAM image, are resolved and copied under the lock."""
        if bufs is not None and len(keys) != len(bufs):
            raise BadArgumentError(f"{len(keys)} keys but {len(bufs)} buffers")
        keys = [bytes(k) for k in keys]
        targets = None
        if bufs is not None:
            targets = [memoryview(b).cast("B") for b in bufs]
            for i, target in enumerate(targets):
                if target.readonly:
                    raise BadArgumentError(f"buffer {i} is read-only")
        results: list = [None] * len(keys)
        if located is None:
            pending = self._serve_or_locate(keys, results, targets)
        else:
            pending = self._located(keys, located, results, targets)
        for _ in range(READ_RETRIES + 1):
            if not pending:
                break
            pending = self._read_sealed(keys, pending, results, targets, verify_payload)
        if pending:
            self._drop_corrupt(keys, pending)
        got = [r for r in results if r is not None]
        sizes = [len(r) for r in got] if targets is None else [r[1] for r in got]
        self.count_gets(len(keys), len(got), sum(sizes))
        return results

    def _located(self, keys, located: np.ndarray, results, targets) -> list[tuple[int, int, int, int]]:
        """(i, addr, length, seq) of the located blocks on flash; those in a DRAM image served."""
        if len(located) != len(keys):
            raise BadArgumentError(f"{len(keys)} keys but {len(located)} located rows")
        on_flash = located["found"] & located["sealed"]
        pending = list(zip(np.flatnonzero(on_flash).tolist(), located["logical_offset"][on_flash].tolist(),
                           located["length"][on_flash].tolist(), located["seq"][on_flash].tolist()))
        in_image = np.flatnonzero(located["found"] & ~located["sealed"]).tolist()
        if in_image:
            served: list = [None] * len(in_image)
            more = self._serve_or_locate([keys[i] for i in in_image], served,
                                         None if targets is None else [targets[i] for i in in_image],
                                         counted=True)
            for j, block in enumerate(served):
                results[in_image[j]] = block
            pending += [(in_image[j], addr, length, seq) for j, addr, length, seq in more]
        return pending

    def count_gets(self, requested: int, hits: int, nbytes: int) -> None:
        with self._lock:
            self._counters.hits += hits
            self._counters.misses += requested - hits
            self._counters.get_bytes += nbytes

    def _serve_or_locate(self, keys, results, targets, counted: bool = False) -> list[tuple[int, int, int, int]]:
        """Serve DRAM-image hits into ``results`` (as bytes, or copied into ``targets``: (0, size));
        ``counted``: these reads were counted for reinsertion and their regions touched already; returns (i, addr, length, seq) of the ones on flash. With
        ``targets``, every hit's buffer is checked for size first."""
        if not keys:
            return []
        k0, k1 = fmt.keys_to_halves(keys)
        with self._lock:
            self._check_open()
            resolved = self._blocks.resolve(k0, k1, self._allocator.image_regions(), count_hits=not counted)
            hit, addr, length, seq, sealed = (a.tolist() for a in resolved)
            if targets is not None:
                for i, nbytes in zip(hit, length):
                    if targets[i].nbytes < nbytes:
                        raise EngineError(f"buffer of {targets[i].nbytes} bytes is too small for the "
                                          f"{nbytes}-byte block")
            if not counted:
                self._touch_regions(addr)
            pending = []
            for i, at, nbytes, sq, on_flash in zip(hit, addr, length, seq, sealed):
                if on_flash:
                    pending.append((i, at, nbytes, sq))
                    continue
                region = at // self._region_size
                block = self._allocator.image_of(region).block(at - region * self._region_size, nbytes)
                if targets is None:
                    results[i] = bytes(block)
                else:
                    copy_bytes(targets[i][:nbytes], block)
                    results[i] = (0, nbytes)
        return pending

    def _touch_regions(self, addrs: list[int]) -> None:
        """Touch the regions of these blocks for the eviction policy, each once, in the order of
        its last block (the order one touch per block would leave)."""
        if not addrs:
            return
        now = time.time()
        newest_first = dict.fromkeys(addr // self._region_size for addr in reversed(addrs))
        for region in reversed(list(newest_first)):
            self._blocks.table.touch(region, now)

    def _read_sealed(self, keys, pending, results, targets, verify_payload: bool) -> list[tuple[int, int, int, int]]:
        """Read blocks from flash (as bytes, or into ``targets``); returns the ones that failed
        verification, re-located (they may have raced a reclaim)."""
        outcomes = self._reader.read_many([(keys[i], addr, length, seq) for i, addr, length, seq in pending],
                                          None if targets is None else [targets[i] for i, _, _, _ in pending],
                                          verify_payload)
        failed = []
        device_errors = 0
        for (i, _, _, _), outcome in zip(pending, outcomes):
            if isinstance(outcome, (bytes, tuple)):
                results[i] = outcome
            elif outcome is ReadFailure.CORRUPT:
                failed.append(i)
            else:
                device_errors += 1
        if device_errors:
            with self._lock:
                self._counters.device_errors += device_errors
        if not failed:
            return []
        relocated = self._serve_or_locate([keys[i] for i in failed], sub := [None] * len(failed),
                                          None if targets is None else [targets[i] for i in failed])
        for j, block in enumerate(sub):
            if block is not None:
                results[failed[j]] = block
        return [(failed[j], addr, length, seq) for j, addr, length, seq in relocated]

    def _drop_corrupt(self, keys, pending) -> None:
        """Blocks that failed verification at a location the index still holds: drop them."""
        index = self._blocks.index
        with self._lock:
            for i, addr, length, seq in pending:
                k0, k1 = fmt.key_to_halves(keys[i])
                slot = index.find(k0, k1)
                if slot >= 0 and int(index.addr[slot]) == addr and self._blocks.seq_of(slot) == seq:
                    self._blocks.forget(np.array([slot]))
                    self._counters.corrupt_reads += 1


    def lookup(self, k0: np.ndarray, k1: np.ndarray) -> int:
        """How many leading keys are present (one vectorized probe, without the lock where it can)."""
        if not len(k0):
            return 0
        self._check_open()
        index = self._blocks.index
        slots = index.find_many_unlocked(k0, k1)  # a LOOKUP never queues behind writers for the lock
        if slots is None:
            with self._lock:
                self._check_open()
                slots = index.find_many(k0, k1)
        present = slots >= 0
        return int(len(present) if present.all() else np.argmin(present))

    def locate(self, k0: np.ndarray, k1: np.ndarray, for_read: bool = False) -> np.ndarray:
        """A LOCATION_DTYPE row per key (``found`` False: absent, the other fields 0). ``for_read``:
        the caller reads the blocks found next (:meth:`get` with ``located``): counted for
        reinsertion and their regions touched here, once."""
        rows = np.zeros(len(k0), LOCATION_DTYPE)
        if not len(k0):
            return rows
        with self._lock:
            self._check_open()
            hit, addr, length, seq, sealed = self._blocks.resolve(k0, k1, self._allocator.image_regions(),
                                                                  count_hits=for_read,
                                                                  durable_ends=self._allocator.image_durable_ends())
            if for_read:
                self._touch_regions(addr.tolist())
        for name, column in (("found", True), ("logical_offset", addr), ("length", length), ("seq", seq),
                             ("sealed", sealed)):
            rows[name][hit] = column
        return rows

    def info(self, key: bytes, soft_pins) -> dict | None:
        """The index's entry for ``key`` and its block's header (read from flash outside the lock),
        or None: absent, or it raced a reclaim."""
        k0, k1 = fmt.key_to_halves(key)
        index, table, size = self._blocks.index, self._blocks.table, self._region_size
        with self._lock:
            self._check_open()
            slot = index.find(k0, k1)
            if slot < 0:
                return None
            addr, length, seq = int(index.addr[slot]), int(index.length[slot]), self._blocks.seq_of(slot)
            region = addr // size
            pinned = bool(index.meta[slot] & np.uint32(PINNED_BIT))
            soft_pinned = soft_pins.contains((k0, k1))
            last_access = float(table.last_access_s[region])
            image = self._allocator.image_of(region)
            on_flash = image is None or addr - region * size + length <= image.durable_end
            head = bytes(image.block(addr - region * size, HEADER_SIZE)) if image is not None else None
        if head is None:
            start = align_down(addr)
            buf = aligned_buffer(align_up(addr + HEADER_SIZE) - start)
            self._array.read(start, buf)
            head = bytes(buf[addr - start:addr - start + HEADER_SIZE])
        try:
            header = decode_header(head)
        except BlockFormatError:
            return None
        if header.key != key or header.seq != seq:  # raced a reclaim
            return None
        return {"present": True, "size_bytes": length, "codec_id": header.codec_id, "ns_id": header.ns_id.hex(),
                "region": region, "seq": seq, "pinned": pinned or soft_pinned, "soft_pinned": soft_pinned,
                "region_last_access": last_access, "sealed": on_flash}
