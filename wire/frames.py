"""Frame layout and per-op encoding of the data protocol (pure, no I/O).

Every frame is a fixed 32-byte header, a *meta* section (item tables, keys,
JSON) and a *payload* section (block bytes only)::

    offset size field
    0      4    magic        b"KVTP"
    4      1    version      PROTOCOL_VERSION
    5      1    op           Op (requests) or Op | 0x80 (replies); 0x7F|0x80 = ERROR
    6      2    flags        HAS_NS | DURABLE | WANT_LOCATIONS
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

import json
import struct
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np

from kvtier.wire import events as m
from kvtier.wire.events import ErrorCode, Limits, Op, ProtocolError

MAGIC = b"KVTP"
FRAME_HEADER = struct.Struct("<4sBBHQIIIHH")
FRAME_HEADER_SIZE = FRAME_HEADER.size
assert FRAME_HEADER_SIZE == 32, FRAME_HEADER_SIZE

FLAG_HAS_NS = 0x1  # the meta section starts with a 16-byte namespace id
FLAG_DURABLE = 0x2  # PUT: acknowledge only once on flash and synced
FLAG_WANT_LOCATIONS = 0x4  # LOOKUP: answer each key's location too
FLAG_READER_VERIFIES = 0x8  # GET: the reader checks payload CRCs itself, the daemon may leave them out
KNOWN_FLAGS = FLAG_HAS_NS | FLAG_DURABLE | FLAG_WANT_LOCATIONS | FLAG_READER_VERIFIES

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_PUT_ITEM = struct.Struct("<16sI")  # key, block length
_LOCATION = struct.Struct("<QIQB3x")  # logical_offset, length, seq, flags (1 present, 2 sealed)
assert _LOCATION.size == 24
_LOC_PRESENT, _LOC_SEALED = 0x1, 0x2
_LOCATION_RECORD = np.dtype([("logical_offset", "<u8"), ("length", "<u4"), ("seq", "<u8"), ("flags", "u1"),
                             ("pad", "V3")])  # _LOCATION as columns
assert _LOCATION_RECORD.itemsize == _LOCATION.size
DEFERRED_LENGTH = 0xFFFFFFFF  # GET reply: item not sent in this reply (payload limit), ask again
REQUEST_ID_MAX = 2**64 - 1


@dataclass(frozen=True)
class FrameHead:
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


def parse_header(buf, limits: Limits) -> FrameHead:
    """Check the fixed header; a bad one loses the framing, so errors are fatal."""
    magic, version, op, flags, rid, count, meta_len, payload_len, status, _ = FRAME_HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"bad frame magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != m.PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.BAD_VERSION,
                            f"unsupported protocol version {version}, this side speaks {m.PROTOCOL_VERSION}", rid)
    if meta_len > limits.meta_bytes_max:
        raise ProtocolError(ErrorCode.LIMIT, f"meta section of {meta_len} bytes is over the limit "
                            f"{limits.meta_bytes_max}", rid)
    if payload_len > limits.payload_bytes_max:
        raise ProtocolError(ErrorCode.LIMIT, f"payload of {payload_len} bytes is over the limit "
                            f"{limits.payload_bytes_max}", rid)
    return FrameHead(version, op, flags, rid, count, meta_len, payload_len, status)


# -- meta checks: run before the payload is received (and allocated) --------
def _reject(head: FrameHead, code: ErrorCode, message: str) -> ProtocolError:
    return ProtocolError(code, message, head.request_id, fatal=False)


def _split_ns(head: FrameHead, meta: bytes) -> tuple[bytes | None, int]:
    if head.flags & FLAG_HAS_NS:
        if len(meta) < m.KEY_SIZE:
            raise _reject(head, ErrorCode.BAD_REQUEST, "namespace flag set but the meta section has no namespace id")
        return meta[:m.KEY_SIZE], m.KEY_SIZE
    return None, 0


def _check_count(head: FrameHead, limits: Limits) -> None:
    if head.count > limits.batch_count_max:
        raise _reject(head, ErrorCode.LIMIT, f"batch of {head.count} items is over the limit {limits.batch_count_max}")


def _no_payload(head: FrameHead) -> None:
    if head.payload_len:
        raise _reject(head, ErrorCode.BAD_REQUEST, f"op {head.op:#x} carries no payload, got {head.payload_len} bytes")


def _meta_keys(head: FrameHead, meta: bytes, limits: Limits) -> tuple[bytes | None, tuple[bytes, ...]]:
    _check_count(head, limits)
    _no_payload(head)
    ns, off = _split_ns(head, meta)
    if len(meta) - off != head.count * m.KEY_SIZE:
        raise _reject(head, ErrorCode.BAD_REQUEST,
                      f"key section of {len(meta) - off} bytes does not hold {head.count} keys of "
                      f"{m.KEY_SIZE} bytes (wrong key size?)")
    return ns, split_keys(meta, off)


_KEY_DTYPE = np.dtype(f"V{m.KEY_SIZE}")  # opaque 16-byte items: .tolist() gives bytes, nothing stripped


class PackedKeys(Sequence):
    """The keys of a received batch as they came off the wire: ``packed`` is
    count x 16 bytes. A consumer that works on the whole batch takes it as is
    (the engine probes its index with the two uint64 halves of each key, one
    ``np.frombuffer``); the keys as ``bytes`` objects are split off only when
    someone indexes or iterates, once, in one vectorized pass (a Python slice
    per key costs ~6x more). Compares and hashes like the tuple of its keys."""

    __slots__ = ("packed", "_keys")

    def __init__(self, packed: bytes):
        if len(packed) % m.KEY_SIZE:
            raise ValueError(f"{len(packed)} bytes is not a whole number of {m.KEY_SIZE}-byte keys")
        self.packed = packed
        self._keys: tuple[bytes, ...] | None = None

    def as_tuple(self) -> tuple[bytes, ...]:
        if self._keys is None:
            self._keys = tuple(np.frombuffer(self.packed, _KEY_DTYPE).tolist())
        return self._keys

    def __len__(self) -> int:
        return len(self.packed) // m.KEY_SIZE

    def __getitem__(self, index):
        return self.as_tuple()[index]

    def __iter__(self):
        return iter(self.as_tuple())

    def __contains__(self, key) -> bool:
        return key in self.as_tuple()

    def __eq__(self, other) -> bool:
        if isinstance(other, PackedKeys):
            return self.packed == other.packed
        if isinstance(other, tuple):
            return self.as_tuple() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.as_tuple())

    def __repr__(self) -> str:
        return f"PackedKeys({self.as_tuple()!r})"


def split_keys(meta, offset: int = 0) -> PackedKeys:
    """The 16-byte keys packed in ``meta[offset:]`` (see :class:`PackedKeys`)."""
    return PackedKeys(bytes(meta[offset:]))


def _meta_put(head: FrameHead, meta: bytes, limits: Limits):
    _check_count(head, limits)
    ns, off = _split_ns(head, meta)
    if len(meta) - off != head.count * _PUT_ITEM.size:
        raise _reject(head, ErrorCode.BAD_REQUEST,
                      f"PUT item table of {len(meta) - off} bytes does not hold {head.count} items of "
                      f"{_PUT_ITEM.size} bytes (16-byte key + u32 length; wrong key size?)")
    items = tuple(_PUT_ITEM.iter_unpack(memoryview(meta)[off:]))
    total = 0
    for index, (_, length) in enumerate(items):
        if length > limits.block_bytes_max:
            raise _reject(head, ErrorCode.TOO_LARGE, f"PUT item {index}: block of {length} bytes is larger than "
                          f"the limit of {limits.block_bytes_max} bytes (the region size)")
        total += length
    if total != head.payload_len:
        raise _reject(head, ErrorCode.BAD_REQUEST,
                      f"PUT item lengths add up to {total} bytes but the payload is {head.payload_len}")
    return ns, items


def _meta_empty(head: FrameHead, meta: bytes, limits: Limits):
    _no_payload(head)
    if head.count or meta:
        raise _reject(head, ErrorCode.BAD_REQUEST, f"op {head.op:#x} takes no items, got count {head.count} "
                      f"and {len(meta)} meta bytes")
    return None


def _meta_hello(head: FrameHead, meta: bytes, limits: Limits):
    _no_payload(head)
    try:
        (name_len,) = _U16.unpack_from(meta, 0)
        name = meta[2:2 + name_len]
        (token_len,) = _U16.unpack_from(meta, 2 + name_len)
        token = meta[4 + name_len:4 + name_len + token_len]
    except struct.error:
        raise _reject(head, ErrorCode.BAD_REQUEST, "HELLO meta section is truncated") from None
    if len(name) != name_len or len(token) != token_len or 4 + name_len + token_len != len(meta):
        raise _reject(head, ErrorCode.BAD_REQUEST, "HELLO meta section lengths do not match its size")
    if name_len > m.NAME_BYTES_MAX or token_len > m.TOKEN_BYTES_MAX:
        raise _reject(head, ErrorCode.LIMIT, f"HELLO name ({name_len} bytes, limit {m.NAME_BYTES_MAX}) or "
                      f"token ({token_len} bytes, limit {m.TOKEN_BYTES_MAX}) over its limit")
    try:
        return name.decode("utf-8"), token.decode("utf-8")
    except UnicodeDecodeError:
        raise _reject(head, ErrorCode.BAD_REQUEST, "HELLO name or token is not UTF-8") from None


def _meta_ping(head: FrameHead, meta: bytes, limits: Limits):
    _no_payload(head)
    if len(meta) > m.PING_BYTES_MAX:
        raise _reject(head, ErrorCode.LIMIT, f"PING body of {len(meta)} bytes is over the limit {m.PING_BYTES_MAX}")
    return meta


def _meta_json(head: FrameHead, meta: bytes, limits: Limits):
    _no_payload(head)
    try:
        doc = json.loads(meta.decode("utf-8")) if meta else {}
    except (UnicodeDecodeError, ValueError) as exc:
        raise _reject(head, ErrorCode.BAD_REQUEST, f"reply JSON does not parse: {exc}") from None
    if not isinstance(doc, dict):
        raise _reject(head, ErrorCode.BAD_REQUEST, "reply JSON is not an object")
    return doc


def _meta_lookup_reply(head: FrameHead, meta: bytes, limits: Limits):
    _check_count(head, limits)
    _no_payload(head)
    want = bool(head.flags & FLAG_WANT_LOCATIONS)
    expect = 4 + (head.count * _LOCATION.size if want else 0)
    if len(meta) != expect:
        raise _reject(head, ErrorCode.BAD_REQUEST, f"LOOKUP reply meta of {len(meta)} bytes, expected {expect}")
    (leading,) = _U32.unpack_from(meta, 0)
    if not want:
        return leading, None
    return leading, _decode_locations(meta, 4)


def _decode_locations(meta: bytes, offset: int) -> tuple:
    """Location records -> a tuple of Location / None, columns first (one
    ``tolist`` per field instead of a struct unpack per key). The objects are
    filled in directly: the frozen dataclass ``__init__`` (one
    ``object.__setattr__`` per field) would double the cost per key, and
    Location has no checks in it to skip."""
    rec = np.frombuffer(meta, _LOCATION_RECORD, offset=offset)
    present = (rec["flags"] & _LOC_PRESENT) != 0
    out: list = [None] * len(rec)
    new, cls = object.__new__, m.Location
    for i, off, length, seq, flags in zip(np.nonzero(present)[0].tolist(), rec["logical_offset"][present].tolist(),
                                          rec["length"][present].tolist(), rec["seq"][present].tolist(),
                                          rec["flags"][present].tolist()):
        loc = new(cls)
        fields = loc.__dict__
        fields["logical_offset"], fields["length"], fields["seq"] = off, length, seq
        fields["sealed"] = bool(flags & _LOC_SEALED)
        out[i] = loc
    return tuple(out)


def _meta_get_reply(head: FrameHead, meta: bytes, limits: Limits):
    _check_count(head, limits)
    if len(meta) != head.count * 4:
        raise _reject(head, ErrorCode.BAD_REQUEST, f"GET reply length table of {len(meta)} bytes for "
                      f"{head.count} items")
    lengths = struct.unpack(f"<{head.count}I", meta)
    if sum(n for n in lengths if n != DEFERRED_LENGTH) != head.payload_len:
        raise _reject(head, ErrorCode.BAD_REQUEST, "GET reply lengths do not add up to its payload")
    return lengths


def _meta_put_reply(head: FrameHead, meta: bytes, limits: Limits):
    _check_count(head, limits)
    _no_payload(head)
    if len(meta) != head.count * 8:
        raise _reject(head, ErrorCode.BAD_REQUEST, f"PUT reply of {len(meta)} bytes for {head.count} items")
    return struct.unpack(f"<{head.count}Q", meta)


def _meta_bools(head: FrameHead, meta: bytes, limits: Limits):
    _check_count(head, limits)
    _no_payload(head)
    if len(meta) != head.count:
        raise _reject(head, ErrorCode.BAD_REQUEST, f"result table of {len(meta)} bytes for {head.count} items")
    return tuple(bool(b) for b in meta)


def _meta_error(head: FrameHead, meta: bytes, limits: Limits):
    _no_payload(head)
    return meta.decode("utf-8", errors="replace")


# op -> (meta check, message builder(head, parsed meta, payload view))
RequestDecoder = tuple[Callable[[FrameHead, bytes, Limits], Any], Callable[[FrameHead, Any, memoryview], Any]]


def _build_put(head: FrameHead, parsed, payload: memoryview) -> m.Put:
    ns, items = parsed
    blocks, pos = [], 0
    for _, length in items:
        blocks.append(payload[pos:pos + length])
        pos += length
    return m.Put(head.request_id, tuple(k for k, _ in items), tuple(blocks),
                 bool(head.flags & FLAG_DURABLE), ns)


def _build_get_reply(head: FrameHead, lengths, payload: memoryview) -> m.GetReply:
    blocks, pos = [], 0
    for length in lengths:
        if length == DEFERRED_LENGTH:
            blocks.append(m.DEFERRED)
            continue
        blocks.append(payload[pos:pos + length] if length else None)
        pos += length
    return m.GetReply(head.request_id, tuple(blocks))


REQUEST_DECODERS: dict[int, RequestDecoder] = {
    Op.HELLO: (_meta_hello, lambda h, p, _: m.Hello(h.request_id, p[0], p[1])),
    Op.LOOKUP: (_meta_keys, lambda h, p, _: m.Lookup(h.request_id, p[1], bool(h.flags & FLAG_WANT_LOCATIONS), p[0])),
    Op.GET: (_meta_keys, lambda h, p, _: m.Get(h.request_id, p[1], p[0], bool(h.flags & FLAG_READER_VERIFIES))),
    Op.PUT: (_meta_put, _build_put),
    Op.DELETE: (_meta_keys, lambda h, p, _: m.Delete(h.request_id, p[1], p[0])),
    Op.PIN: (_meta_keys, lambda h, p, _: m.Pin(h.request_id, p[1], p[0])),
    Op.UNPIN: (_meta_keys, lambda h, p, _: m.Unpin(h.request_id, p[1], p[0])),
    Op.FLUSH: (_meta_empty, lambda h, p, _: m.Flush(h.request_id)),
    Op.STATS: (_meta_empty, lambda h, p, _: m.Stats(h.request_id)),
    Op.PING: (_meta_ping, lambda h, p, _: m.Ping(h.request_id, p)),
}

REPLY_DECODERS: dict[int, RequestDecoder] = {
    Op.HELLO: (_meta_json, lambda h, p, _: m.HelloReply(h.request_id, p)),
    Op.LOOKUP: (_meta_lookup_reply, lambda h, p, _: m.LookupReply(h.request_id, p[0], p[1])),
    Op.GET: (_meta_get_reply, _build_get_reply),
    Op.PUT: (_meta_put_reply, lambda h, p, _: m.PutReply(h.request_id, p)),
    Op.DELETE: (_meta_bools, lambda h, p, _: m.DeleteReply(h.request_id, p)),
    Op.PIN: (_meta_bools, lambda h, p, _: m.PinReply(h.request_id, p)),
    Op.UNPIN: (_meta_bools, lambda h, p, _: m.UnpinReply(h.request_id, p)),
    Op.FLUSH: (_meta_empty, lambda h, p, _: m.FlushReply(h.request_id)),
    Op.STATS: (_meta_json, lambda h, p, _: m.StatsReply(h.request_id, p)),
    Op.PING: (_meta_ping, lambda h, p, _: m.PingReply(h.request_id, p)),
    Op.ERROR: (_meta_error, lambda h, p, _: m.ErrorReply(h.request_id, h.status, p)),
}


# -- encoding ---------------------------------------------------------------
def location_records(present, logical_offset, length, seq, sealed) -> m.LocationRecords:
    """A LOOKUP reply's locations from columns (one entry per key; the other
    columns are ignored where ``present`` is False), encoded in one pass."""
    present = np.asarray(present, bool)
    rec = np.zeros(len(present), _LOCATION_RECORD)
    rec["logical_offset"] = np.where(present, logical_offset, 0)
    rec["length"] = np.where(present, length, 0)
    rec["seq"] = np.where(present, seq, 0)
    rec["flags"] = np.where(present, _LOC_PRESENT | np.where(np.asarray(sealed, bool), _LOC_SEALED, 0), 0)
    return m.LocationRecords(rec.tobytes(), len(rec))


def _check_key(key) -> bytes:
    key = bytes(key)
    if len(key) != m.KEY_SIZE:
        raise ValueError(f"a key must be {m.KEY_SIZE} bytes, got {len(key)}")
    return key


def _ns_prefix(ns_id) -> tuple[int, bytes]:
    if ns_id is None:
        return 0, b""
    return FLAG_HAS_NS, _check_key(ns_id)


def _keys_meta(keys, ns_id) -> tuple[int, bytes]:
    flag, prefix = _ns_prefix(ns_id)
    joined = b"".join(keys)
    if len(joined) != len(keys) * m.KEY_SIZE:  # one check for the batch; find the culprit only on failure
        for k in keys:
            _check_key(k)
    return flag, prefix + joined


def _json_bytes(doc) -> bytes:
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def encode_message(msg) -> tuple[int, int, int, int, bytes, list, int]:
    """``(op, flags, request_id, count, meta, payload_parts, status)`` for a message."""
    t = type(msg)
    rid = msg.request_id
    if t is m.Hello:
        name, token = msg.client_name.encode(), msg.token.encode()
        return Op.HELLO, 0, rid, 0, _U16.pack(len(name)) + name + _U16.pack(len(token)) + token, [], 0
    if t in (m.Lookup, m.Get, m.Delete, m.Pin, m.Unpin):
        flags, meta = _keys_meta(msg.keys, msg.ns_id)
        if t is m.Lookup and msg.want_locations:
            flags |= FLAG_WANT_LOCATIONS
        if t is m.Get and msg.reader_verifies:
            flags |= FLAG_READER_VERIFIES
        op = {m.Lookup: Op.LOOKUP, m.Get: Op.GET, m.Delete: Op.DELETE, m.Pin: Op.PIN, m.Unpin: Op.UNPIN}[t]
        return op, flags, rid, len(msg.keys), meta, [], 0
    if t is m.Put:
        if len(msg.keys) != len(msg.blocks):
            raise ValueError(f"PUT of {len(msg.keys)} keys and {len(msg.blocks)} blocks")
        flags, prefix = _ns_prefix(msg.ns_id)
        flags |= FLAG_DURABLE if msg.durable else 0
        views = [memoryview(b).cast("B") for b in msg.blocks]
        meta = prefix + b"".join(_PUT_ITEM.pack(_check_key(k), v.nbytes) for k, v in zip(msg.keys, views))
        return Op.PUT, flags, rid, len(views), meta, views, 0
    if t in (m.Flush, m.Stats):
        return (Op.FLUSH if t is m.Flush else Op.STATS), 0, rid, 0, b"", [], 0
    if t is m.Ping:
        return Op.PING, 0, rid, 0, bytes(msg.data), [], 0
    return _encode_reply(msg)


def _encode_reply(msg):
    t = type(msg)
    rid = msg.request_id
    R = m.REPLY_BIT
    if t is m.HelloReply:
        return Op.HELLO | R, 0, rid, 0, _json_bytes(dict(msg.info)), [], 0
    if t is m.StatsReply:
        return Op.STATS | R, 0, rid, 0, _json_bytes(dict(msg.stats)), [], 0
    if t is m.LookupReply:
        if msg.locations is None:
            return Op.LOOKUP | R, 0, rid, 0, _U32.pack(msg.leading), [], 0
        if type(msg.locations) is m.LocationRecords:
            return (Op.LOOKUP | R, FLAG_WANT_LOCATIONS, rid, msg.locations.count,
                    _U32.pack(msg.leading) + msg.locations.records, [], 0)
        parts = [_U32.pack(msg.leading)]
        pack = _LOCATION.pack
        for loc in msg.locations:
            if loc is None:
                parts.append(pack(0, 0, 0, 0))
            else:
                parts.append(pack(loc.logical_offset, loc.length, loc.seq,
                                  _LOC_PRESENT | (_LOC_SEALED if loc.sealed else 0)))
        return Op.LOOKUP | R, FLAG_WANT_LOCATIONS, rid, len(msg.locations), b"".join(parts), [], 0
    if t is m.GetReply:
        views = [b if b is None or b is m.DEFERRED else memoryview(b).cast("B") for b in msg.blocks]
        meta = struct.pack(f"<{len(views)}I", *(0 if v is None else DEFERRED_LENGTH if v is m.DEFERRED else v.nbytes
                                                  for v in views))
        return Op.GET | R, 0, rid, len(views), meta, [v for v in views if isinstance(v, memoryview) and v.nbytes], 0
    if t is m.PutReply:
        return Op.PUT | R, 0, rid, len(msg.seqs), struct.pack(f"<{len(msg.seqs)}Q", *msg.seqs), [], 0
    if t in (m.DeleteReply, m.PinReply, m.UnpinReply):
        op = {m.DeleteReply: Op.DELETE, m.PinReply: Op.PIN, m.UnpinReply: Op.UNPIN}[t]
        return op | R, 0, rid, len(msg.results), bytes(1 if r else 0 for r in msg.results), [], 0
    if t is m.FlushReply:
        return Op.FLUSH | R, 0, rid, 0, b"", [], 0
    if t is m.PingReply:
        return Op.PING | R, 0, rid, 0, bytes(msg.data), [], 0
    if t is m.ErrorReply:
        text = msg.message.encode("utf-8")[:m.ERROR_MESSAGE_BYTES_MAX]
        return Op.ERROR | R, 0, rid, 0, text, [], int(msg.code)
    raise TypeError(f"not a protocol message: {msg!r}")
