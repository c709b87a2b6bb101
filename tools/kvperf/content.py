"""Keys and block content for the block workloads.

Keys: block ``i`` of clone ``c`` in key space ``K`` under seed ``S`` is
``BLAKE2b-128(K || c || i, key=S)`` -- deterministic, so a later job (or a
later run) with the same keyspace and seed reads exactly what an earlier one
wrote, like fio's ``filename=``.

Content (``verify``): the payload is the 16-byte key itself followed by a
slice of a fixed pseudo-random pool (SHAKE-256 of a constant) that starts at
an offset taken from the key. A block stored under another key, a flipped
byte, or a torn block all differ from what the key predicts, and building or
checking a block is a memory copy or compare, not hashing the whole payload.
Without ``verify`` every block of a clone carries one fixed payload whose CRC
is computed once, so a put only writes a 64-byte header into a reused buffer.
"""
from __future__ import annotations

import hashlib
import struct

import crc32c
import numpy as np

from kvtier.common.blockformat import (_CRC_COVERED, _HEADER, FORMAT_VERSION, HEADER_SIZE, MAGIC, BlockFormatError,
                                       payload_of, verify_block)
from kvtier.common.codec_ids import OPAQUE_CODEC_ID, codec_id

_KEY_PERSON = b"kvperf-key-v2"  # v2: content is key + pool slice (v1 blocks are not v2 keys)
_DATA_PERSON = b"kvperf-data-v2"
_NS_PERSON = b"kvperf-ns-v1"
_PATTERN_BYTES = 64


def block_key(seed: int, keyspace: str, clone: int, index: int) -> bytes:
    h = hashlib.blake2b(digest_size=16, key=seed.to_bytes(8, "little"), person=_KEY_PERSON)
    h.update(f"{keyspace}\0{clone}\0{index}".encode())
    return h.digest()


def keyspace_ns_id(keyspace: str) -> bytes:
    """The namespace id written in kvperf's block headers."""
    return hashlib.blake2b(keyspace.encode(), digest_size=16, person=_NS_PERSON).digest()


_POOL_OFFSETS = 4096  # distinct pool offsets a key can select
_pool = b""


def _pool_view(nbytes: int) -> memoryview:
    """The first ``nbytes`` of the content pool (SHAKE output is prefix-stable)."""
    global _pool
    if len(_pool) < nbytes:
        _pool = hashlib.shake_256(_DATA_PERSON).digest(max(nbytes, 1 << 20))
    return memoryview(_pool)[:nbytes]


def _pool_slice(key: bytes, nbytes: int) -> memoryview:
    offset = int.from_bytes(key[:4], "little") % _POOL_OFFSETS
    return _pool_view(offset + nbytes)[offset:]


def fill_payload(out: memoryview, key: bytes) -> None:
    """Write the payload ``verify`` expects under ``key`` into ``out``."""
    n = out.nbytes
    stamp = min(n, len(key))
    out[:stamp] = key[:stamp]
    if n > stamp:
        out[stamp:] = _pool_slice(key, n - stamp)


def payload_matches(payload: memoryview, key: bytes) -> bool:
    n = payload.nbytes
    stamp = min(n, len(key))
    if payload[:stamp] != key[:stamp]:
        return False
    if n == stamp:
        return True
    got = np.frombuffer(payload[stamp:], dtype=np.uint8)
    return bool(np.array_equal(got, np.frombuffer(_pool_slice(key, n - stamp), dtype=np.uint8)))


def payload_for(key: bytes, size_bytes: int) -> bytes:
    """The payload ``verify`` expects under ``key``."""
    out = bytearray(size_bytes)
    fill_payload(memoryview(out), key)
    return bytes(out)


def header_codec_id(codec: str) -> int:
    return OPAQUE_CODEC_ID if codec == "opaque" else codec_id(codec)


class BlockMaker:
    """Builds the full blocks (header + payload) a clone puts, in buffers it
    reuses: :meth:`blocks` hands out views, :meth:`release` takes them back
    once the request that sent them has completed."""

    def __init__(self, keyspace: str, codec: str, size_bytes: int, verify: bool):
        self.ns_id = keyspace_ns_id(keyspace)
        self.codec_id = header_codec_id(codec)
        self.size_bytes = size_bytes
        self.verify = verify
        self._free: list[bytearray] = []
        self._fixed_crc = None
        if not verify:
            self._fixed = payload_for(self.ns_id, size_bytes)
            self._fixed_crc = crc32c.crc32c(self._fixed)

    def _buffer(self) -> bytearray:
        if self._free:
            return self._free.pop()
        buf = bytearray(HEADER_SIZE + self.size_bytes)
        if not self.verify:
            buf[HEADER_SIZE:] = self._fixed
        return buf

    def _fill(self, buf: bytearray, key: bytes) -> None:
        view = memoryview(buf)
        payload = view[HEADER_SIZE:]
        if self.verify:
            fill_payload(payload, key)
            pcrc = crc32c.crc32c(payload)
        else:
            pcrc = self._fixed_crc
        head = _HEADER.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE, self.codec_id, 0, key, self.ns_id,
                            self.size_bytes, 0, pcrc, 0)
        view[:_CRC_COVERED] = head[:_CRC_COVERED]
        struct.pack_into("<I", view, _CRC_COVERED, crc32c.crc32c(head[:_CRC_COVERED]))

    def blocks(self, keys: list[bytes]) -> list[bytearray]:
        out = []
        for key in keys:
            buf = self._buffer()
            self._fill(buf, key)
            out.append(buf)
        return out

    def release(self, blocks: list[bytearray]) -> None:
        self._free.extend(blocks)

    def block(self, key: bytes) -> bytes:
        """One block as a new bytes object (tests, tools)."""
        buf = bytearray(HEADER_SIZE + self.size_bytes)
        if not self.verify:
            buf[HEADER_SIZE:] = self._fixed
        self._fill(buf, key)
        return bytes(buf)


def check_block(block: bytes | None, key: bytes, size_bytes: int) -> str | None:
    """None when ``block`` is what ``key`` predicts; else what is wrong."""
    if block is None:
        return f"block {key.hex()} is missing (a miss of a block this run or an earlier one wrote)"
    try:
        verify_block(block, expected_key=key)
    except BlockFormatError as e:
        return f"block {key.hex()}: {e}"
    payload = payload_of(block)
    if payload.nbytes != size_bytes:
        return f"block {key.hex()}: payload is {payload.nbytes} bytes, expected {size_bytes}"
    if not payload_matches(payload, key):
        return f"block {key.hex()}: content differs from what its key predicts"
    return None
