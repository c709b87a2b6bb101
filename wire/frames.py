"""The byte layout of a frame (pure, no I/O): its header, its flags and the
records inside its meta section. Reading a frame is :mod:`kvtier.wire.readers`,
writing one :mod:`kvtier.wire.writers`.

Every frame is a fixed 32-byte header, a *meta* section (item tables, keys,
JSON) and a *payload* section (block bytes only)::

    offset size field
    0      4    magic        b"KVTP"
    4      1    version      PROTOCOL_VERSION
    5      1    op           Op (requests) or Op | 0x80 (replies); 0x7F|0x80 = ERROR
    6      2    flags        FLAG_*: each op takes its own (REQUEST_FLAGS, REPLY_FLAGS), other bits are refused
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
FLAG_SKIP_DELETED = 0x80  # PUT: a copy (read-repair, re-replication): keys this daemon deleted lately are not stored
FLAG_NAMES = {FLAG_HAS_NS: "HAS_NS", FLAG_DURABLE: "DURABLE", FLAG_WANT_LOCATIONS: "WANT_LOCATIONS",
              FLAG_READER_VERIFIES: "READER_VERIFIES", FLAG_WANT_ORIGIN: "WANT_ORIGIN", FLAG_PIN_TTL: "PIN_TTL",
              FLAG_SCATTER: "SCATTER", FLAG_SKIP_DELETED: "SKIP_DELETED"}
KNOWN_FLAGS = sum(FLAG_NAMES)
FLAG_BITS = 16  # the header's u16
# The flags each op's frames take; any other bit, defined or not, is refused (a newer peer's flag is
# never silently dropped). A request op's replies take REPLY_FLAGS.
REQUEST_FLAGS: dict[int, int] = {
    m.Op.HELLO: 0,
    m.Op.LOOKUP: FLAG_HAS_NS | FLAG_WANT_LOCATIONS | FLAG_WANT_ORIGIN,
    m.Op.GET: FLAG_HAS_NS | FLAG_READER_VERIFIES | FLAG_WANT_ORIGIN,
    m.Op.PUT: FLAG_HAS_NS | FLAG_DURABLE | FLAG_SKIP_DELETED,
    m.Op.DELETE: FLAG_HAS_NS,
    m.Op.PIN: FLAG_HAS_NS | FLAG_PIN_TTL,
    m.Op.UNPIN: FLAG_HAS_NS,
    m.Op.FLUSH: 0,
    m.Op.STATS: 0,
    m.Op.PING: 0,
    m.Op.NIXL_METADATA: 0,
    m.Op.NIXL_GET: FLAG_HAS_NS | FLAG_READER_VERIFIES | FLAG_SCATTER,
    m.Op.NIXL_PUT: FLAG_HAS_NS | FLAG_DURABLE,
}
REPLY_FLAGS: dict[int, int] = {op: 0 for op in m.Op} | {
    m.Op.LOOKUP: FLAG_WANT_LOCATIONS | FLAG_WANT_ORIGIN,
    m.Op.GET: FLAG_WANT_ORIGIN,
}
assert set(REQUEST_FLAGS) == m.REQUEST_OPS and set(REPLY_FLAGS) == set(m.Op)
assert all(not flags & ~KNOWN_FLAGS for flags in (*REQUEST_FLAGS.values(), *REPLY_FLAGS.values()))

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


def flags_taken(op: int) -> int:
    """The flags a frame of ``op`` (a request op, or one with REPLY_BIT) takes; 0 for an unknown op."""
    table = REPLY_FLAGS if op & m.REPLY_BIT else REQUEST_FLAGS
    return table.get(op & ~m.REPLY_BIT, 0)


def flag_names(flags: int) -> str:
    """``flags`` by name (``HAS_NS | DURABLE``), an undefined bit as its value, no bit as ``no flags``."""
    bits = [1 << bit for bit in range(FLAG_BITS) if flags >> bit & 1]
    return " | ".join(FLAG_NAMES.get(bit, f"{bit:#x}") for bit in bits) or "no flags"
