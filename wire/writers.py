"""Writing frames (pure, no I/O): one encoder per message, and the key check.

:func:`encode_message` turns a message of :mod:`kvtier.wire.events` into the
fields of its frame; the connection packs the header (:func:`kvtier.wire.frames.pack_header`)
and checks the frame limits. Block bytes are never copied here: a payload is
a list of the caller's buffers for ``sendmsg``.
"""
from __future__ import annotations

import json
import struct

import numpy as np

from kvtier.wire import events as m
from kvtier.wire.events import Op
from kvtier.wire.frames import (DEFERRED_LENGTH, FLAG_DURABLE, FLAG_HAS_NS, FLAG_READER_VERIFIES, FLAG_WANT_LOCATIONS,
                                FLAG_WANT_ORIGIN, LOCATION, LOCATION_PRESENT, LOCATION_RECORD, LOCATION_SEALED, PUT_ITEM, U16, U32)
from kvtier.wire.frames import FLAG_PIN_TTL, FLAG_SKIP_DELETED
from kvtier.wire import nixl_frames

_KEYS_OPS = {m.Lookup: Op.LOOKUP, m.Get: Op.GET, m.Delete: Op.DELETE, m.Pin: Op.PIN, m.Unpin: Op.UNPIN}
_BOOLS_REPLY_OPS = {m.DeleteReply: Op.DELETE, m.PinReply: Op.PIN, m.UnpinReply: Op.UNPIN}


def payload_nbytes(part) -> int:
    """The bytes of one payload buffer, which must be contiguous. Payload parts are sent as they
    come (bytes, memoryviews, NumPy arrays), not wrapped: a wrapper per part of a block in flight
    is an object the garbage collector tracks."""
    view = memoryview(part)
    if not view.c_contiguous:
        raise ValueError(f"a payload buffer must be contiguous, got one of shape {view.shape} and strides {view.strides}")
    return view.nbytes


def check_key(key) -> bytes:
    """``key`` as bytes, if it is a block key or namespace id (KEY_SIZE bytes); else ValueError."""
    key = bytes(key)
    if len(key) != m.KEY_SIZE:
        raise ValueError(f"a key must be {m.KEY_SIZE} bytes, got {len(key)}")
    return key


def location_records(present, logical_offset, length, seq, sealed) -> m.LocationRecords:
    """A LOOKUP reply's locations from columns (one entry per key; the other
    columns are ignored where ``present`` is False), encoded in one pass."""
    present = np.asarray(present, bool)
    rec = np.zeros(len(present), LOCATION_RECORD)
    rec["logical_offset"] = np.where(present, logical_offset, 0)
    rec["length"] = np.where(present, length, 0)
    rec["seq"] = np.where(present, seq, 0)
    rec["flags"] = np.where(present, LOCATION_PRESENT | np.where(np.asarray(sealed, bool), LOCATION_SEALED, 0), 0)
    return m.LocationRecords(rec.tobytes(), len(rec))


def _ns_prefix(ns_id) -> tuple[int, bytes]:
    if ns_id is None:
        return 0, b""
    return FLAG_HAS_NS, check_key(ns_id)


def _keys_meta(keys, ns_id) -> tuple[int, bytes]:
    flag, prefix = _ns_prefix(ns_id)
    joined = b"".join(keys)
    if len(joined) != len(keys) * m.KEY_SIZE:  # one check for the batch; find the culprit only on failure
        for k in keys:
            check_key(k)
    return flag, prefix + joined


def _pin_ttl_meta(meta: bytes, flags: int, ttl_ms) -> bytes:
    """A soft PIN's meta: the u32 ttl_ms goes after the namespace id, before the keys."""
    if isinstance(ttl_ms, bool) or not isinstance(ttl_ms, int) or not 1 <= ttl_ms <= m.PIN_TTL_MS_MAX:
        raise ValueError(f"a PIN's ttl_ms must be an int in 1..{m.PIN_TTL_MS_MAX}, got {ttl_ms!r}")
    ns_bytes = m.KEY_SIZE if flags & FLAG_HAS_NS else 0
    return meta[:ns_bytes] + U32.pack(ttl_ms) + meta[ns_bytes:]


def _json_bytes(doc) -> bytes:
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def encode_message(msg) -> tuple[int, int, int, int, bytes, list, int]:
    """``(op, flags, request_id, count, meta, payload_parts, status)`` for a message."""
    t = type(msg)
    rid = msg.request_id
    if t is m.Hello:
        name, token = msg.client_name.encode(), msg.token.encode()
        return Op.HELLO, 0, rid, 0, U16.pack(len(name)) + name + U16.pack(len(token)) + token, [], 0
    if t in _KEYS_OPS:
        flags, meta = _keys_meta(msg.keys, msg.ns_id)
        if t is m.Lookup and msg.want_locations:
            flags |= FLAG_WANT_LOCATIONS
        if t is m.Get and msg.reader_verifies:
            flags |= FLAG_READER_VERIFIES
        if t in (m.Get, m.Lookup) and msg.want_origin:
            flags |= FLAG_WANT_ORIGIN
        if t is m.Pin and msg.ttl_ms is not None:
            flags |= FLAG_PIN_TTL
            meta = _pin_ttl_meta(meta, flags, msg.ttl_ms)
        return _KEYS_OPS[t], flags, rid, len(msg.keys), meta, [], 0
    if t is m.Put:
        if len(msg.keys) != len(msg.blocks):
            raise ValueError(f"PUT of {len(msg.keys)} keys and {len(msg.blocks)} blocks")
        flags, prefix = _ns_prefix(msg.ns_id)
        flags |= (FLAG_DURABLE if msg.durable else 0) | (FLAG_SKIP_DELETED if msg.skip_deleted else 0)
        blocks = [b if isinstance(b, m.BlockParts) else (b,) for b in msg.blocks]
        meta = prefix + b"".join(PUT_ITEM.pack(check_key(k), sum(map(payload_nbytes, parts)))
                                 for k, parts in zip(msg.keys, blocks))
        return Op.PUT, flags, rid, len(blocks), meta, [part for parts in blocks for part in parts], 0
    if t in (m.Flush, m.Stats):
        return (Op.FLUSH if t is m.Flush else Op.STATS), 0, rid, 0, b"", [], 0
    if t is m.Ping:
        return Op.PING, 0, rid, 0, bytes(msg.data), [], 0
    if t in nixl_frames.ENCODERS:  # NIXL_METADATA, NIXL_GET, NIXL_PUT and their replies
        return nixl_frames.ENCODERS[t](msg)
    return _encode_reply(msg)


def _encode_locations(locations) -> tuple[int, bytes]:
    """``(count, records)`` of a LOOKUP reply's locations: LocationRecords as they are, else any
    objects with the Location fields (the daemon's engine hands its own), None for absent."""
    if type(locations) is m.LocationRecords:
        return locations.count, locations.records
    pack = LOCATION.pack
    parts = [pack(0, 0, 0, 0) if loc is None else
             pack(loc.logical_offset, loc.length, loc.seq, LOCATION_PRESENT | (LOCATION_SEALED if loc.sealed else 0))
             for loc in locations]
    return len(parts), b"".join(parts)


def _origins(origins, count: int, what: str) -> tuple[int, bytes]:
    """``(flags, bytes)`` of a reply's WANT_ORIGIN array: one byte per item, or nothing."""
    if origins is None:
        return 0, b""
    origins = bytes(origins)
    if len(origins) != count:
        raise ValueError(f"{len(origins)} origin bytes for {count} {what}")
    return FLAG_WANT_ORIGIN, origins


def _encode_reply(msg):
    t = type(msg)
    rid = msg.request_id
    R = m.REPLY_BIT
    if t is m.HelloReply:
        return Op.HELLO | R, 0, rid, 0, _json_bytes(dict(msg.info)), [], 0
    if t is m.StatsReply:
        return Op.STATS | R, 0, rid, 0, _json_bytes(dict(msg.stats)), [], 0
    if t is m.LookupReply:
        origin_flag, origins = _origins(msg.origins, msg.leading, "LOOKUP reply leading keys")
        if msg.locations is None:
            return Op.LOOKUP | R, origin_flag, rid, 0, U32.pack(msg.leading) + origins, [], 0
        count, records = _encode_locations(msg.locations)
        return (Op.LOOKUP | R, FLAG_WANT_LOCATIONS | origin_flag, rid, count, U32.pack(msg.leading) + records + origins,
                [], 0)
    if t is m.GetReply:
        views = [b if b is None or b is m.DEFERRED else memoryview(b).cast("B") for b in msg.blocks]
        meta = struct.pack(f"<{len(views)}I", *(0 if v is None else DEFERRED_LENGTH if v is m.DEFERRED else v.nbytes
                                                  for v in views))
        origin_flag, origins = _origins(msg.origins, len(views), "GET reply items")
        return (Op.GET | R, origin_flag, rid, len(views), meta + origins,
                [v for v in views if isinstance(v, memoryview) and v.nbytes], 0)
    if t is m.PutReply:
        return Op.PUT | R, 0, rid, len(msg.seqs), struct.pack(f"<{len(msg.seqs)}Q", *msg.seqs), [], 0
    if t in _BOOLS_REPLY_OPS:
        return _BOOLS_REPLY_OPS[t] | R, 0, rid, len(msg.results), bytes(1 if r else 0 for r in msg.results), [], 0
    if t is m.FlushReply:
        return Op.FLUSH | R, 0, rid, 0, b"", [], 0
    if t is m.PingReply:
        return Op.PING | R, 0, rid, 0, bytes(msg.data), [], 0
    if t is m.ErrorReply:
        text = msg.message.encode("utf-8")[:m.ERROR_MESSAGE_BYTES_MAX]
        return Op.ERROR | R, 0, rid, 0, text, [], int(msg.code)
    raise TypeError(f"not a protocol message: {msg!r}")
