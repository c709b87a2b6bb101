"""Reading blocks back from the striped array, verified (I/O, no bookkeeping).

Every read covers the block's aligned range, lands in a pooled aligned
buffer (or straight in the caller's, when aligned) and is checked (header CRC, payload CRC, key, seq) before a byte is
handed out -- the payload CRC left out only for a caller that passes the block on to a reader who checks
it; the outcome of each read is a value, not an exception.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Sequence

from kvtier.common.blockformat import BlockFormatError, verify_block

from .buffers import BufferPool, copy_bytes
from kvtier.common.aligned import align_down, align_up, is_aligned
from .errors import DeviceError
from .raid0 import StripedArray


class ReadFailure(Enum):
    CORRUPT = "corrupt"  # the bytes did not verify (torn, flipped, or the region was recycled)
    DEVICE_ERROR = "device_error"  # the device refused the read


class BlockReader:
    def __init__(self, array: StripedArray, pool: ThreadPoolExecutor, buffers: BufferPool | None = None):
        self._array = array
        self._pool = pool
        self._buffers = buffers or BufferPool()

    def read_many(self, requests: Sequence[tuple[bytes, int, int, int]],
                  into: Sequence[memoryview | None] | None = None,
                  verify_payload: bool = True) -> list[bytes | tuple[int, int] | ReadFailure]:
        """``requests``: (key, logical offset, length, seq); ``into``: a destination per request
        (or None: that block comes back as bytes); ``verify_payload`` as in :meth:`read_one`.
        Every block's stripe pieces go into one plan, so each device gets its
        pieces of the whole batch as runs in flight together (the pool's threads bound the queue
        depth), not one block's pieces at a time; then the blocks are verified (and copied where
        they did not land in place) on the pool. A device error fails the batch's plan: each block
        is then read alone, so only the blocks on the failing device come back DEVICE_ERROR."""
        targets = [None] * len(requests) if into is None else into
        assert len(targets) == len(requests), (len(targets), len(requests))
        if len(requests) == 1:
            return [self.read_one(*requests[0], inline=False, into=targets[0], verify_payload=verify_payload)]
        landing = [self._landing(addr, length, dst) for (_, addr, length, _), dst in zip(requests, targets)]
        plan: dict = {}
        for (start, end, buf, _) in landing:
            self._array.add_to_plan(plan, start, buf[:end - start])
        try:
            self._array.run_plan(plan, write=False)
        except DeviceError:
            for (_, _, buf, direct) in landing:
                if not direct:
                    self._buffers.give(buf)
            return list(self._pool.map(lambda req, dst: self.read_one(*req, inline=True, into=dst,
                                                                      verify_payload=verify_payload),
                                       requests, targets))
        return list(self._pool.map(lambda req, dst, land: self._finish(*req, dst, *land, verify_payload),
                                   requests, targets, landing))

    def _landing(self, addr: int, length: int, into: memoryview | None):
        """(start, end, buffer, direct): the block's aligned range and where it is read to."""
        start, end = align_down(addr), align_up(addr + length)
        direct = into is not None and into.nbytes >= end - start and is_aligned(into)
        return start, end, (into if direct else self._buffers.take(end - start)), direct

    def _finish(self, key: bytes, addr: int, length: int, seq: int, into: memoryview | None, start: int, end: int,
                buf: memoryview, direct: bool, verify_payload: bool) -> bytes | tuple[int, int] | ReadFailure:
        """Verify a block read to ``buf`` and hand it out as :meth:`read_one` does."""
        try:
            view = buf[addr - start:addr - start + length]
            verify_block(view, key, seq, payload=verify_payload)
            if into is None:
                return bytes(view)
            if not direct:
                copy_bytes(into[:length], view)
            return (addr - start if direct else 0, length)
        except BlockFormatError:
            return ReadFailure.CORRUPT
        finally:
            if not direct:
                self._buffers.give(buf)

    def read_one(self, key: bytes, addr: int, length: int, seq: int, inline: bool = False,
                 into: memoryview | None = None,
                 verify_payload: bool = True) -> bytes | tuple[int, int] | ReadFailure:
        """The verified block as bytes -- or, with ``into``, placed there: ``(offset, length)``.

        With ``into``, any block, aligned or not, is read straight into an aligned ``into`` that
        holds its aligned range (``align_up(addr + length) - align_down(addr)`` bytes) and sits at
        ``addr - align_down(addr)``: one device read and one CRC pass, no copy. Otherwise the read
        lands in a pooled aligned buffer, is verified there and copied to offset 0. Either way
        nothing is returned unverified; on a failure the contents of ``into`` are undefined.
        ``verify_payload=False`` checks header, key and seq but leaves the payload CRC to whoever
        the block is passed on to. ``inline`` reads in the calling thread (required on a pool
        thread: waiting on the pool from inside it could deadlock)."""
        start, end, buf, direct = self._landing(addr, length, into)
        try:
            if inline:
                self._array.read_inline(start, buf[:end - start])
            else:
                self._array.read(start, buf[:end - start])
        except DeviceError:
            if not direct:
                self._buffers.give(buf)
            return ReadFailure.DEVICE_ERROR
        return self._finish(key, addr, length, seq, into, start, end, buf, direct, verify_payload)
