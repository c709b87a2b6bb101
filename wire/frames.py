"""The byte layout of a frame (pure, no I/O): its header, its flags and the
records inside its meta section. Reading a frame is :mod:`kvtier.wire.readers`,
writing one :mod:`kvtier.wire.writers`.

Every frame is a fixed 32-byte header, a *meta* section (item tables, keys,
JSON) and a *payload* section (block bytes only)::

    offset size field
    0      4    magic        b"KVTP"
    4      1    version      PROTOCOL_VERSION
    5      1    op           Op (requests) or Op | 0x80 (replies); 0x7F|0x80 = ERROR
    6      2    flags        HAS_NS | DURABLE | WANT_LOCATIONS | READER_VERIFIES | WANT_ORIGIN
    8      8    request_id   echoed in the reply
    16     4    count        items in the batch
    20     4    meta_len     bytes of the meta section
    24     4    payload_len  bytes of the payload section
    28     2    status       ErrorCode in ERROR replies, else 0
    30     2    reserved     0
    32     ...  meta, then payload

All little-endian. Keeping block bytes in their own section lets a reader
receive them straight into a preallocated buffer. See docs/protocol.md.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from kvtier.wire import events as m

MAGIC = b"KVTP"
FRAME_HEADER = struct.Struct("<4sBBHQIIIHH")
FRAME_HEADER_SIZE = FRAME_HEADER.size
assert FRAME_HEADER_SIZE == 32, FRAME_HEADER_SIZE

FLAG_HAS_NS = 0x1  # the meta section starts with a 16-byte namespace id
FLAG_DURABLE = 0x2  # PUT: acknowledge only once on flash and synced
FLAG_WANT_LOCATIONS = 0x4  # LOOKUP: answer each key's location too
FLAG_READER_VERIFIES = 0x8  # GET: the reader checks payload CRCs itself, the daemon may leave them out
FLAG_WANT_ORIGIN = 0x10  # GET, LOOKUP: the reply says per block whether it was local or fetched upstream
FLAG_PIN_TTL = 0x20  # PIN: a soft pin; the meta section holds a u32 ttl_ms (after the namespace id) before the keys
FLAG_SCATTER = 0x40  # NIXL_GET: each item's block is written across extents (the table after the descriptors)
KNOWN_FLAGS = (FLAG_HAS_NS | FLAG_DURABLE | FLAG_WANT_LOCATIONS | FLAG_READER_VERIFIES | FLAG_WANT_ORIGIN | FLAG_PIN_TTL
               | FLAG_SCATTER)

U16 = struct.Struct("<H")  # HELLO string lengths
U32 = struct.Struct("<I")  # LOOKUP reply: the leading count
PUT_ITEM = struct.Struct("<16sI")  # PUT request item: key, block length
assert PUT_ITEM.size == m.KEY_SIZE + 4
LOCATION = struct.Struct("<QIQB3x")  # LOOKUP reply item: logical_offset, length, seq, flags
assert LOCATION.size == 24
LOCATION_PRESENT, LOCATION_SEALED = 0x1, 0x2  # LOCATION flags
LOCATION_RECORD = np.dtype([("logical_offset", "<u8"), ("length", "<u4"), ("seq", "<u8"), ("flags", "u1"),
                            ("pad", "V3")])  # LOCATION as columns
assert LOCATION_RECORD.itemsize == LOCATION.size
KEY_RECORD = np.dtype(f"V{m.KEY_SIZE}")  # a key as an opaque item: .tolist() gives bytes, nothing stripped
ORIGIN_LOCAL, ORIGIN_UPSTREAM = 0, 1  # WANT_ORIGIN reply bytes: held by this daemon, fetched from its upstream
DEFERRED_LENGTH = 0xFFFFFFFF  # GET reply length: item not sent in this reply (payload limit), ask again
REQUEST_ID_MAX = 2**64 - 1  # the header's u64


@dataclass(frozen=True)
class FrameHead:
    """The header fields of one received frame (magic and reserved dropped)."""

    version: int
    op: int
    flags: int
    request_id: int
    count: int
    meta_len: int
    payload_len: int
    status: int

    @property
    def is_reply(self) -> bool:
        return bool(self.op & m.REPLY_BIT)

    @property
    def base_op(self) -> int:
        return self.op & ~m.REPLY_BIT


def pack_header(op: int, flags: int, request_id: int, count: int, meta_len: int, payload_len: int,
                status: int = 0, version: int = m.PROTOCOL_VERSION, magic: bytes = MAGIC) -> bytes:
    """The raw 32-byte header (exposed so tests can build broken frames)."""
    return FRAME_HEADER.pack(magic, version, op, flags, request_id, count, meta_len, payload_len, status, 0)
