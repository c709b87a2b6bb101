"""The block format: one layout on the wire and on disk.

::

    offset size field
    0      4    magic          b"KVTB"
    4      2    version        FORMAT_VERSION
    6      2    header_size    HEADER_SIZE (64)
    8      2    codec_id       kvtier.common.codec_ids
    10     2    flags          reserved, 0
    12     16   key            chained block key
    28     16   ns_id          namespace id
    44     4    payload_len    bytes after the header
    48     8    seq            write sequence, stamped by the daemon (0 from clients)
    56     4    payload_crc    CRC32C of the payload
    60     4    header_crc     CRC32C of bytes 0..59
    64     ...  payload

All little-endian. The daemon stores what the client sent and never
re-encodes the payload; it only stamps ``seq`` (which also rewrites
``header_crc``). Every reader verifies both CRCs, and the key and sequence it
expects: a mismatch is a miss, never data.

Pure: no I/O, no dependencies beyond ``crc32c``.
"""
from __future__ import annotations

import struct
import sys
from dataclasses import dataclass

import crc32c

MAGIC = b"KVTB"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHHHH16s16sIQII")
HEADER_SIZE = _HEADER.size
assert HEADER_SIZE == 64, HEADER_SIZE
# payloads, regions and frames are little-endian and read as native NumPy arrays (np.frombuffer)
assert sys.byteorder == "little", "kvtier's formats are little-endian: a big-endian host would misread them"
_CRC_COVERED = HEADER_SIZE - 4
_SEQ_OFFSET = 48
KEY_SIZE = 16
PAYLOAD_SIZE_MAX = 2**31  # a payload must fit a region; regions are far smaller than this


class BlockFormatError(ValueError):
    """Bytes that are not a valid block (bad magic, version, size or CRC)."""


@dataclass(frozen=True)
class BlockHeader:
    key: bytes
    ns_id: bytes
    codec_id: int
    payload_len: int
    seq: int
    payload_crc: int
    flags: int = 0

    @property
    def block_size(self) -> int:
        return HEADER_SIZE + self.payload_len


def encode_header(
    key: bytes, ns_id: bytes, codec_id: int, payload, seq: int = 0, flags: int = 0
) -> bytes:
    """The 64-byte header for ``payload`` (any bytes-like object)."""
    if len(key) != KEY_SIZE:
        raise BlockFormatError(f"key must be {KEY_SIZE} bytes, got {len(key)}")
    if len(ns_id) != KEY_SIZE:
        raise BlockFormatError(f"namespace id must be {KEY_SIZE} bytes, got {len(ns_id)}")
    view = memoryview(payload).cast("B")
    if view.nbytes >= PAYLOAD_SIZE_MAX:
        raise BlockFormatError(f"payload of {view.nbytes} bytes is over the limit {PAYLOAD_SIZE_MAX}")
    return header_for_crc(key, ns_id, codec_id, view.nbytes, crc32c.crc32c(view), seq, flags)


def header_for_crc(key: bytes, ns_id: bytes, codec_id: int, payload_len: int, payload_crc: int,
                   seq: int = 0, flags: int = 0) -> bytes:
    """The 64-byte header of a payload whose length and CRC32C are already known (a payload
    in several pieces, its CRC chained over them)."""
    if len(key) != KEY_SIZE or len(ns_id) != KEY_SIZE:
        raise BlockFormatError(f"key and namespace id must be {KEY_SIZE} bytes, got {len(key)} and {len(ns_id)}")
    if payload_len >= PAYLOAD_SIZE_MAX:
        raise BlockFormatError(f"payload of {payload_len} bytes is over the limit {PAYLOAD_SIZE_MAX}")
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE, codec_id, flags, bytes(key), bytes(ns_id),
                        payload_len, seq, payload_crc, 0)
    return head[:_CRC_COVERED] + struct.pack("<I", crc32c.crc32c(head[:_CRC_COVERED]))


def encode_block(key: bytes, ns_id: bytes, codec_id: int, payload, seq: int = 0) -> bytes:
    """Header and payload as one bytes object (copies the payload once)."""
    return encode_header(key, ns_id, codec_id, payload, seq) + bytes(memoryview(payload).cast("B"))


def decode_header(buf) -> BlockHeader:
    """Parse and check the first 64 bytes of ``buf`` (magic, version, size, header CRC)."""
    view = memoryview(buf).cast("B")
    if view.nbytes < HEADER_SIZE:
        raise BlockFormatError(f"block of {view.nbytes} bytes is shorter than its {HEADER_SIZE}-byte header")
    magic, version, hsize, codec, flags, key, ns_id, plen, seq, pcrc, hcrc = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise BlockFormatError(f"bad block magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise BlockFormatError(f"unsupported block format version {version}, expected {FORMAT_VERSION}")
    if hsize != HEADER_SIZE:
        raise BlockFormatError(f"bad header size {hsize}, expected {HEADER_SIZE}")
    if crc32c.crc32c(view[:_CRC_COVERED]) != hcrc:
        raise BlockFormatError("block header CRC mismatch")
    return BlockHeader(key=bytes(key), ns_id=bytes(ns_id), codec_id=codec, payload_len=plen,
                       seq=seq, payload_crc=pcrc, flags=flags)


def verify_block(buf, expected_key: bytes | None = None, expected_seq: int | None = None,
                 payload: bool = True) -> BlockHeader:
    """Check a whole block: header, payload length and CRC, and the key and
    sequence the reader expects. Raises :class:`BlockFormatError` naming the
    first problem found. ``payload=False`` skips the payload CRC: for a holder
    that only passes the block on to a reader who checks it (the daemon's GET)."""
    view = memoryview(buf).cast("B")
    header = decode_header(view)
    check_header(header, view.nbytes, expected_key, expected_seq)
    if payload and crc32c.crc32c(view[HEADER_SIZE:]) != header.payload_crc:
        raise BlockFormatError(f"payload CRC mismatch for key {header.key.hex()}")
    return header


def check_header(header: BlockHeader, block_nbytes: int, expected_key: bytes | None = None,
                 expected_seq: int | None = None) -> None:
    """A decoded header against the block it heads: its size (``block_nbytes``), and the key and
    sequence the reader expects. Raises :class:`BlockFormatError` naming the first mismatch."""
    if block_nbytes != header.block_size:
        raise BlockFormatError(f"block is {block_nbytes} bytes, header says {header.block_size}")
    if expected_key is not None and header.key != bytes(expected_key):
        raise BlockFormatError(f"block key {header.key.hex()} is not the expected {bytes(expected_key).hex()}")
    if expected_seq is not None and header.seq != expected_seq:
        raise BlockFormatError(f"block sequence {header.seq} is not the expected {expected_seq}")


def stamp_sequence(block: bytearray | memoryview, seq: int) -> None:
    """Write ``seq`` into a block's header in place and refresh the header CRC."""
    view = memoryview(block).cast("B")
    struct.pack_into("<Q", view, _SEQ_OFFSET, seq)
    struct.pack_into("<I", view, _CRC_COVERED, crc32c.crc32c(view[:_CRC_COVERED]))


def payload_of(buf) -> memoryview:
    """The payload part of a block, without copying."""
    return memoryview(buf).cast("B")[HEADER_SIZE:]
