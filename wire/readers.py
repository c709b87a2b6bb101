"""Reading frames (pure, no I/O): the header check and one decoder per op.

Each decoder is a pair: a *meta check* that runs as soon as the meta section
is in, before anything is allocated for the payload, and a *builder* that
turns the checked meta and the payload into a message of
:mod:`kvtier.wire.events`. A meta check that fails raises a non-fatal
:class:`~kvtier.wire.events.ProtocolError`: the frame is refused, the framing
kept. The layout itself is :mod:`kvtier.wire.frames`.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np

from kvtier.wire import events as m
from kvtier.wire.events import ErrorCode, Limits, Op, ProtocolError
from kvtier.wire.frames import (DEFERRED_LENGTH, FLAG_DURABLE, FLAG_HAS_NS, FLAG_READER_VERIFIES, FLAG_WANT_LOCATIONS,
                                FLAG_WANT_ORIGIN, FRAME_HEADER, KEY_RECORD, LOCATION, LOCATION_PRESENT, LOCATION_RECORD,
                                LOCATION_SEALED, MAGIC, PUT_ITEM, U16, U32, FrameHead)
from kvtier.common.keys import repeated_key
from kvtier.wire.frames import FLAG_PIN_TTL, FLAG_SKIP_DELETED, flag_names, flags_taken
from kvtier.wire import nixl_frames


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


class PackedKeys(Sequence):
    """The keys of a received batch as they came off the wire: ``packed`` is
    count x 16 bytes. A consumer that works on the whole batch takes it as is
    (the engine probes its index with the two uint64 halves of each key, one
    ``np.frombuffer``); the keys as ``bytes`` objects are split off only when
    someone indexes or iterates, once, in one vectorized pass. Compares and
    hashes like the tuple of its keys."""

    __slots__ = ("packed", "_keys")

    def __init__(self, packed: bytes):
        if len(packed) % m.KEY_SIZE:
            raise ValueError(f"{len(packed)} bytes is not a whole number of {m.KEY_SIZE}-byte keys")
        self.packed = packed
        self._keys: tuple[bytes, ...] | None = None

    def as_tuple(self) -> tuple[bytes, ...]:
        if self._keys is None:
            self._keys = tuple(np.frombuffer(self.packed, KEY_RECORD).tolist())
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


# -- meta checks: run before the payload is received (and allocated) --------
def _reject(head: FrameHead, code: ErrorCode, message: str) -> ProtocolError:
    return ProtocolError(code, message, head.request_id, fatal=False)


def check_flags(head: FrameHead) -> None:
    """Refuse a frame of a known op that carries a flag its op does not take (frames.REQUEST_FLAGS,
    REPLY_FLAGS): defined for another op, or not defined at all."""
    taken = flags_taken(head.op)
    refused = head.flags & ~taken
    if refused:
        what = f"{m.Op(head.base_op).name} {'reply' if head.is_reply else 'request'}"
        raise _reject(head, ErrorCode.BAD_REQUEST, f"{what} carries {flag_names(refused)} ({refused:#x}), a flag it "
                      f"does not take (it takes {flag_names(taken)})" + ("" if head.is_reply else "; nothing done"))


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


def _meta_keys(head: FrameHead, meta: bytes, limits: Limits) -> tuple[bytes | None, PackedKeys]:
    _check_count(head, limits)
    _no_payload(head)
    ns, off = _split_ns(head, meta)
    if len(meta) - off != head.count * m.KEY_SIZE:
        raise _reject(head, ErrorCode.BAD_REQUEST,
                      f"key section of {len(meta) - off} bytes does not hold {head.count} keys of "
                      f"{m.KEY_SIZE} bytes (wrong key size?)")
    return ns, split_keys(meta, off)


def _meta_pin(head: FrameHead, meta: bytes, limits: Limits) -> tuple[bytes | None, PackedKeys, int | None]:
    """A PIN's keys and, with FLAG_PIN_TTL, its u32 ttl_ms (after the namespace id)."""
    if not head.flags & FLAG_PIN_TTL:
        return (*_meta_keys(head, meta, limits), None)
    ns_bytes = m.KEY_SIZE if head.flags & FLAG_HAS_NS else 0
    if len(meta) < ns_bytes + U32.size:
        raise _reject(head, ErrorCode.BAD_REQUEST, f"PIN with FLAG_PIN_TTL: a meta section of {len(meta)} bytes "
                      f"holds no ttl_ms")
    (ttl_ms,) = U32.unpack_from(meta, ns_bytes)
    if ttl_ms == 0:
        raise _reject(head, ErrorCode.BAD_REQUEST, "PIN with FLAG_PIN_TTL: ttl_ms is 0 (a soft pin lasts >= 1 ms)")
    ns, keys = _meta_keys(head, meta[:ns_bytes] + meta[ns_bytes + U32.size:], limits)
    return ns, keys, ttl_ms


def _meta_put(head: FrameHead, meta: bytes, limits: Limits):
    _check_count(head, limits)
    ns, off = _split_ns(head, meta)
    if len(meta) - off != head.count * PUT_ITEM.size:
        raise _reject(head, ErrorCode.BAD_REQUEST,
                      f"PUT item table of {len(meta) - off} bytes does not hold {head.count} items of "
                      f"{PUT_ITEM.size} bytes (16-byte key + u32 length; wrong key size?)")
    items = tuple(PUT_ITEM.iter_unpack(memoryview(meta)[off:]))
    repeat = repeated_key([key for key, _ in items])
    if repeat is not None:
        raise _reject(head, ErrorCode.BAD_REQUEST, f"PUT {repeat}: a batch names each key once; nothing stored")
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
        (name_len,) = U16.unpack_from(meta, 0)
        name = meta[2:2 + name_len]
        (token_len,) = U16.unpack_from(meta, 2 + name_len)
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
    """``(leading, locations or None, origins or None)``; with WANT_ORIGIN the meta section ends
    with one origin byte per leading key."""
    _check_count(head, limits)
    _no_payload(head)
    want = bool(head.flags & FLAG_WANT_LOCATIONS)
    if len(meta) < 4:
        raise _reject(head, ErrorCode.BAD_REQUEST, f"LOOKUP reply meta of {len(meta)} bytes has no leading count")
    (leading,) = U32.unpack_from(meta, 0)
    records_end = 4 + (head.count * LOCATION.size if want else 0)
    expect = records_end + (leading if head.flags & FLAG_WANT_ORIGIN else 0)
    if len(meta) != expect:
        raise _reject(head, ErrorCode.BAD_REQUEST, f"LOOKUP reply meta of {len(meta)} bytes, expected {expect}")
    origins = _check_origins(head, meta[records_end:]) if head.flags & FLAG_WANT_ORIGIN else None
    return leading, (_decode_locations(meta[:records_end], 4) if want else None), origins


def _check_origins(head: FrameHead, origins: bytes) -> bytes:
    if origins.translate(None, b"\x00\x01"):
        raise _reject(head, ErrorCode.BAD_REQUEST, "reply origin bytes other than 0 (local) and 1 (upstream)")
    return bytes(origins)


class GetReplyLengths(tuple):
    """A GET reply's length table, one u32 per item; ``origins`` is its WANT_ORIGIN byte array, or None."""

    origins: bytes | None = None


def _decode_locations(meta: bytes, offset: int) -> tuple:
    """Location records -> a tuple of Location / None, columns first (one
    ``tolist`` per field instead of a struct unpack per key). The objects are
    filled in directly, past the frozen dataclass ``__init__`` (one
    ``object.__setattr__`` per field): Location has no checks in it to skip."""
    rec = np.frombuffer(meta, LOCATION_RECORD, offset=offset)
    present = (rec["flags"] & LOCATION_PRESENT) != 0
    out: list = [None] * len(rec)
    new, cls = object.__new__, m.Location
    for i, off, length, seq, flags in zip(np.nonzero(present)[0].tolist(), rec["logical_offset"][present].tolist(),
                                          rec["length"][present].tolist(), rec["seq"][present].tolist(),
                                          rec["flags"][present].tolist()):
        loc = new(cls)
        fields = loc.__dict__
        fields["logical_offset"], fields["length"], fields["seq"] = off, length, seq
        fields["sealed"] = bool(flags & LOCATION_SEALED)
        out[i] = loc
    return tuple(out)


def _meta_get_reply(head: FrameHead, meta: bytes, limits: Limits):
    _check_count(head, limits)
    want_origin = bool(head.flags & FLAG_WANT_ORIGIN)
    if len(meta) != head.count * (5 if want_origin else 4):
        raise _reject(head, ErrorCode.BAD_REQUEST, f"GET reply length table of {len(meta)} bytes for "
                      f"{head.count} items" + (" with origins" if want_origin else ""))
    lengths = GetReplyLengths(struct.unpack(f"<{head.count}I", meta[:head.count * 4]))
    if sum(n for n in lengths if n != DEFERRED_LENGTH) != head.payload_len:
        raise _reject(head, ErrorCode.BAD_REQUEST, "GET reply lengths do not add up to its payload")
    if want_origin:
        lengths.origins = _check_origins(head, meta[head.count * 4:])
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


# -- builders: checked meta + payload view -> message -------------------------
def _build_put(head: FrameHead, parsed, payload: memoryview) -> m.Put:
    ns, items = parsed
    blocks, pos = [], 0
    for _, length in items:
        blocks.append(payload[pos:pos + length])
        pos += length
    return m.Put(head.request_id, tuple(k for k, _ in items), tuple(blocks),
                 bool(head.flags & FLAG_DURABLE), ns, bool(head.flags & FLAG_SKIP_DELETED))


def _build_get_reply(head: FrameHead, lengths, payload: memoryview) -> m.GetReply:
    blocks, pos = [], 0
    for length in lengths:
        if length == DEFERRED_LENGTH:
            blocks.append(m.DEFERRED)
            continue
        blocks.append(payload[pos:pos + length] if length else None)
        pos += length
    return m.GetReply(head.request_id, tuple(blocks), origins=getattr(lengths, "origins", None))


# op -> (meta check, message builder(head, checked meta, payload view))
Decoder = tuple[Callable[[FrameHead, bytes, Limits], Any], Callable[[FrameHead, Any, memoryview], Any]]

REQUEST_DECODERS: dict[int, Decoder] = {
    Op.HELLO: (_meta_hello, lambda h, p, _: m.Hello(h.request_id, p[0], p[1])),
    Op.LOOKUP: (_meta_keys, lambda h, p, _: m.Lookup(h.request_id, p[1], bool(h.flags & FLAG_WANT_LOCATIONS), p[0],
                                                     want_origin=bool(h.flags & FLAG_WANT_ORIGIN))),
    Op.GET: (_meta_keys, lambda h, p, _: m.Get(h.request_id, p[1], p[0], bool(h.flags & FLAG_READER_VERIFIES),
                                               want_origin=bool(h.flags & FLAG_WANT_ORIGIN))),
    Op.PUT: (_meta_put, _build_put),
    Op.DELETE: (_meta_keys, lambda h, p, _: m.Delete(h.request_id, p[1], p[0])),
    Op.PIN: (_meta_pin, lambda h, p, _: m.Pin(h.request_id, p[1], p[0], p[2])),
    Op.UNPIN: (_meta_keys, lambda h, p, _: m.Unpin(h.request_id, p[1], p[0])),
    Op.FLUSH: (_meta_empty, lambda h, p, _: m.Flush(h.request_id)),
    Op.STATS: (_meta_empty, lambda h, p, _: m.Stats(h.request_id)),
    Op.PING: (_meta_ping, lambda h, p, _: m.Ping(h.request_id, p)),
}

REPLY_DECODERS: dict[int, Decoder] = {
    Op.HELLO: (_meta_json, lambda h, p, _: m.HelloReply(h.request_id, p)),
    Op.LOOKUP: (_meta_lookup_reply, lambda h, p, _: m.LookupReply(h.request_id, p[0], p[1], origins=p[2])),
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
REQUEST_DECODERS.update(nixl_frames.REQUEST_DECODERS)  # NIXL_METADATA, NIXL_GET, NIXL_PUT: kvtier.wire.nixl_frames
REPLY_DECODERS.update(nixl_frames.REPLY_DECODERS)
