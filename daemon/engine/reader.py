"""Reading blocks back from the striped array, verified (I/O, no bookkeeping).

Every read covers the block's aligned range, lands in a pooled aligned
buffer and is checked (header CRC, payload CRC, key, seq) before a byte is
handed out; the outcome of each read is a value, not an exception.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Sequence

from kvtier.client.blockformat import BlockFormatError, verify_block

from .buffers import BufferPool
from .devices import align_down, align_up
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

    def read_many(self, requests: Sequence[tuple[bytes, int, int, int]]) -> list[bytes | ReadFailure]:
        """``requests``: (key, logical offset, length, seq). One block alone reads its stripe pieces
        in parallel; a batch runs one pool task per block (read, verify, copy), so verification of
        one block overlaps the I/O of the others."""
        if len(requests) == 1:
            return [self.read_one(*requests[0], inline=False)]
        return list(self._pool.map(lambda req: self.read_one(*req, inline=True), requests))

    def read_one(self, key: bytes, addr: int, length: int, seq: int, inline: bool = False,
                 into: memoryview | None = None) -> bytes | int | ReadFailure:
        """The verified block as bytes -- or, with ``into``, copied there and its length returned.
        ``inline`` reads in the calling thread (required on a pool thread: waiting on the pool
        from inside it could deadlock)."""
        start, end = align_down(addr), align_up(addr + length)
        buf = self._buffers.take(end - start)
        try:
            if inline:
                self._array.read_inline(start, buf[:end - start])
            else:
                self._array.read(start, buf[:end - start])
            view = buf[addr - start:addr - start + length]
            verify_block(view, key, seq)
            if into is None:
                return bytes(view)
            into[:length] = view
            return length
        except BlockFormatError:
            return ReadFailure.CORRUPT
        except DeviceError:
            return ReadFailure.DEVICE_ERROR
        finally:
            self._buffers.give(buf)
