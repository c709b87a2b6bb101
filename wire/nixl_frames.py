"""The byte layout of the NIXL ops (pure, no I/O): NIXL_METADATA (0x0B), NIXL_GET (0x0C), NIXL_PUT (0x0D).

Control stays on the data protocol; only block bytes move through NIXL. Both ops
are refused before HELLO like every other op (:func:`kvtier.wire.state.check_before_hello`),
so agent metadata is only ever exchanged on an authenticated connection::

    NIXL_METADATA request   count = regions
        count x REGION (u64 address, u64 length_bytes)    the client's registered destinations
        agent metadata                                    the rest (1..NIXL_AGENT_METADATA_BYTES_MAX)
    NIXL_METADATA reply     count = 0
        the daemon's agent metadata

    NIXL_GET request        count = items; flags HAS_NS, READER_VERIFIES, SCATTER
        [ns] u16 name_len, agent name (UTF-8)
        count x DESCRIPTOR (key, u64 address, u32 capacity_bytes)
        [SCATTER] count x u32 extents, then every item's EXTENTs (u64 address, u32 length) in order;
                  an item's descriptor is its first extent's address and its extents' total
    NIXL_GET reply          count = items, no payload
        count x u32 length written at the item's descriptor (0 miss, 0xFFFFFFFF deferred)

    NIXL_PUT request        count = items; flags HAS_NS, DURABLE
        [ns] u16 name_len, agent name (UTF-8)
        count x SOURCE (key, u32 extents)
        then every item's EXTENTs (u64 address, u32 length) in order: its block's bytes
    NIXL_PUT reply          count = items, no payload
        count x u64 seq, as a PUT's

Neither carries a payload. The decoders are pairs like :mod:`kvtier.wire.readers`'
(a meta check, then a builder); :func:`encode` is the writer's half.
"""
from __future__ import annotations

import struct

from kvtier.wire import events as m
from kvtier.wire.events import ErrorCode, Limits, Op, ProtocolError
from kvtier.wire.frames import (DEFERRED_LENGTH, FLAG_DURABLE, FLAG_HAS_NS, FLAG_READER_VERIFIES, FLAG_SCATTER, U16,
                                FrameHead)
from kvtier.common.keys import repeated_key

REGION = struct.Struct("<QQ")  # NIXL_METADATA item: address, length_bytes
assert REGION.size == 16
DESCRIPTOR = struct.Struct("<16sQI")  # NIXL_GET item: key, address, capacity_bytes
assert DESCRIPTOR.size == m.KEY_SIZE + 12
EXTENT = struct.Struct("<QI")  # NIXL_GET with SCATTER, NIXL_PUT: address, length
SOURCE = struct.Struct("<16sI")  # NIXL_PUT item: key, extents
assert SOURCE.size == m.KEY_SIZE + 4
COUNT = struct.Struct("<I")
ADDRESS_MAX = 2**64 - 1
NOTIFICATION_PREFIX = b"kvtier-get:"  # a NIXL_GET part's notification: this, the request id, its ranges
PART_HEAD = struct.Struct("<QI")  # request id, ranges
PART_RANGE = struct.Struct("<IQI")  # item index, offset within the item's block, length
PART_RANGES_MAX = 4096  # one notification names at most this many ranges


def notification_prefix(request_id: int) -> bytes:
    """What every notification of one NIXL_GET starts with."""
    return NOTIFICATION_PREFIX + struct.pack("<Q", request_id)


def part_notification(request_id: int, ranges) -> bytes:
    """The notification the daemon sends once one part of a NIXL_GET is written: the
    ``(item, offset, length)`` ranges of the items' blocks that part carried."""
    ranges = list(ranges)
    if not 0 < len(ranges) <= PART_RANGES_MAX:
        raise ValueError(f"a part notification names 1..{PART_RANGES_MAX} ranges, got {len(ranges)}")
    return NOTIFICATION_PREFIX + PART_HEAD.pack(request_id, len(ranges)) + b"".join(
        PART_RANGE.pack(item, offset, length) for item, offset, length in ranges)


def parse_part_notification(message: bytes) -> tuple[int, list[tuple[int, int, int]]]:
    """(request id, ranges) of a part notification; ValueError names what is wrong with it."""
    head = len(NOTIFICATION_PREFIX)
    if not message.startswith(NOTIFICATION_PREFIX) or len(message) < head + PART_HEAD.size:
        raise ValueError(f"not a kvtier NIXL_GET notification ({len(message)} bytes)")
    request_id, count = PART_HEAD.unpack_from(message, head)
    body = head + PART_HEAD.size
    if not 0 < count <= PART_RANGES_MAX or len(message) != body + count * PART_RANGE.size:
        raise ValueError(f"notification of request {request_id}: {count} ranges in {len(message) - body} bytes")
    return request_id, [PART_RANGE.unpack_from(message, body + i * PART_RANGE.size) for i in range(count)]


def _reject(head: FrameHead, code: ErrorCode, message: str) -> ProtocolError:
    return ProtocolError(code, message, head.request_id, fatal=False)


def _no_payload(head: FrameHead) -> None:
    if head.payload_len:
        raise _reject(head, ErrorCode.BAD_REQUEST, f"op {head.op:#x} carries no payload, got {head.payload_len} bytes")


def _check_regions(head: FrameHead, regions) -> None:
    for index, (address, length) in enumerate(regions):
        if length <= 0 or address == 0 or address + length > ADDRESS_MAX:
            raise _reject(head, ErrorCode.BAD_REQUEST, f"NIXL region {index}: {length} bytes at {address:#x} is "
                          "empty, at address 0 or past the end of the address space")


# -- meta checks ---------------------------------------------------------------
def _meta_metadata(head: FrameHead, meta: bytes, limits: Limits):
    _no_payload(head)
    if head.count > m.NIXL_REGIONS_MAX:
        raise _reject(head, ErrorCode.LIMIT, f"{head.count} NIXL regions is over the limit {m.NIXL_REGIONS_MAX}")
    blob = len(meta) - head.count * REGION.size
    if blob <= 0:
        raise _reject(head, ErrorCode.BAD_REQUEST, f"NIXL_METADATA of {len(meta)} meta bytes holds {head.count} "
                      "regions and no agent metadata")
    if blob > m.NIXL_AGENT_METADATA_BYTES_MAX:
        raise _reject(head, ErrorCode.LIMIT, f"NIXL agent metadata of {blob} bytes is over the limit "
                      f"{m.NIXL_AGENT_METADATA_BYTES_MAX}")
    regions = tuple(REGION.iter_unpack(meta[:head.count * REGION.size]))
    _check_regions(head, regions)
    return regions, bytes(meta[head.count * REGION.size:])


def _meta_metadata_reply(head: FrameHead, meta: bytes, limits: Limits):
    _no_payload(head)
    if head.count or not meta or len(meta) > m.NIXL_AGENT_METADATA_BYTES_MAX:
        raise _reject(head, ErrorCode.BAD_REQUEST, f"NIXL_METADATA reply of {len(meta)} bytes and count "
                      f"{head.count}: expected 1..{m.NIXL_AGENT_METADATA_BYTES_MAX} bytes of metadata, no items")
    return bytes(meta)


def _meta_get(head: FrameHead, meta: bytes, limits: Limits):
    _no_payload(head)
    if head.count > limits.batch_count_max:
        raise _reject(head, ErrorCode.LIMIT, f"batch of {head.count} items is over the limit {limits.batch_count_max}")
    ns, name, items_at = _ns_and_agent(head, meta, "NIXL_GET")
    table_end = items_at + head.count * DESCRIPTOR.size
    scatter = bool(head.flags & FLAG_SCATTER)
    if len(meta) < table_end or (not scatter and len(meta) != table_end):
        raise _reject(head, ErrorCode.BAD_REQUEST,
                      f"NIXL_GET descriptor table of {len(meta) - items_at} bytes does not hold {head.count} items "
                      f"of {DESCRIPTOR.size} bytes (16-byte key, u64 address, u32 capacity)")
    items = tuple(DESCRIPTOR.iter_unpack(meta[items_at:table_end]))
    return ns, name, items, _scatter_extents(head, meta[table_end:], items) if scatter else None


def _ns_and_agent(head: FrameHead, meta: bytes, op: str) -> tuple[bytes | None, str, int]:
    """The namespace id (HAS_NS), the agent name and where the item table starts."""
    off = 0
    ns = None
    if head.flags & FLAG_HAS_NS:
        if len(meta) < m.KEY_SIZE:
            raise _reject(head, ErrorCode.BAD_REQUEST, "namespace flag set but the meta section has no namespace id")
        ns, off = bytes(meta[:m.KEY_SIZE]), m.KEY_SIZE
    try:
        (name_len,) = U16.unpack_from(meta, off)
    except struct.error:
        raise _reject(head, ErrorCode.BAD_REQUEST, f"{op} meta section has no agent name") from None
    if not 0 < name_len <= m.NIXL_AGENT_NAME_BYTES_MAX or len(meta) < off + 2 + name_len:
        raise _reject(head, ErrorCode.BAD_REQUEST, f"{op} agent name of {name_len} bytes: expected "
                      f"1..{m.NIXL_AGENT_NAME_BYTES_MAX}, inside the meta section")
    try:
        name = bytes(meta[off + 2:off + 2 + name_len]).decode("utf-8")
    except UnicodeDecodeError:
        raise _reject(head, ErrorCode.BAD_REQUEST, f"{op} agent name is not UTF-8") from None
    return ns, name, off + 2 + name_len


def _meta_put(head: FrameHead, meta: bytes, limits: Limits):
    _no_payload(head)
    if not 0 < head.count <= limits.batch_count_max:
        raise _reject(head, ErrorCode.LIMIT, f"NIXL_PUT of {head.count} items: expected 1..{limits.batch_count_max}")
    ns, name, items_at = _ns_and_agent(head, meta, "NIXL_PUT")
    table_end = items_at + head.count * SOURCE.size
    if len(meta) < table_end:
        raise _reject(head, ErrorCode.BAD_REQUEST, f"NIXL_PUT item table of {len(meta) - items_at} bytes does not hold "
                      f"{head.count} items of {SOURCE.size} bytes (16-byte key, u32 extents)")
    items = tuple(SOURCE.iter_unpack(meta[items_at:table_end]))
    repeat = repeated_key([key for key, _ in items])
    if repeat is not None:
        raise _reject(head, ErrorCode.BAD_REQUEST, f"NIXL_PUT {repeat}: a batch names each key once; nothing read "
                      "or stored")
    extents = _extent_lists(head, meta[table_end:], [count for _, count in items], "NIXL_PUT")
    for index, mine in enumerate(extents):
        if not mine or any(n == 0 for _, n in mine):
            raise _reject(head, ErrorCode.BAD_REQUEST, f"NIXL_PUT item {index}: {len(mine)} extents; a block is one or "
                          "more extents of one byte or more")
    return ns, name, tuple(key for key, _ in items), extents


def _extent_lists(head: FrameHead, table: bytes, counts: list[int], op: str) -> tuple:
    """``table``: every item's EXTENTs in order, ``counts[i]`` of them for item i; one tuple per item."""
    total = sum(counts)
    if total > m.NIXL_EXTENTS_MAX:
        raise _reject(head, ErrorCode.LIMIT, f"{op} of {total} extents is over the limit {m.NIXL_EXTENTS_MAX}")
    if len(table) != total * EXTENT.size:
        raise _reject(head, ErrorCode.BAD_REQUEST, f"{op} extent table of {len(table)} bytes does not "
                      f"hold {total} extents of {EXTENT.size} bytes (u64 address, u32 length)")
    flat = list(EXTENT.iter_unpack(table))
    out, at = [], 0
    for count in counts:
        out.append(tuple(flat[at:at + count]))
        at += count
    return tuple(out)


def _meta_put_reply(head: FrameHead, meta: bytes, limits: Limits):
    _no_payload(head)
    if len(meta) != head.count * 8:
        raise _reject(head, ErrorCode.BAD_REQUEST, f"NIXL_PUT reply of {len(meta)} bytes for {head.count} items")
    return struct.unpack(f"<{head.count}Q", meta)


def _extents_match(extents, address: int, capacity: int) -> bool:
    """An item's extents start at its descriptor's address and add up to its capacity."""
    return bool(extents) and extents[0][0] == address and sum(n for _, n in extents) == capacity


def _scatter_extents(head: FrameHead, table: bytes, items) -> tuple:
    """The SCATTER section: per item its extents, each item's matching its descriptor."""
    counts_end = len(items) * COUNT.size
    if len(table) < counts_end:
        raise _reject(head, ErrorCode.BAD_REQUEST, f"NIXL_GET extent counts of {len(table)} bytes for {len(items)} items")
    counts = [c for (c,) in COUNT.iter_unpack(table[:counts_end])]
    lists = _extent_lists(head, table[counts_end:], counts, "NIXL_GET")
    for index, (extents, (_, address, capacity)) in enumerate(zip(lists, items)):
        if not _extents_match(extents, address, capacity):
            raise _reject(head, ErrorCode.BAD_REQUEST, f"NIXL_GET item {index}: {len(extents)} extents that do not start "
                          f"at its descriptor's address {address:#x} or do not add up to its capacity of {capacity} bytes")
    return lists


def _meta_get_reply(head: FrameHead, meta: bytes, limits: Limits):
    _no_payload(head)
    if len(meta) != head.count * 4:
        raise _reject(head, ErrorCode.BAD_REQUEST, f"NIXL_GET reply length table of {len(meta)} bytes for "
                      f"{head.count} items")
    return struct.unpack(f"<{head.count}I", meta)


def _build_get(head: FrameHead, parsed, _payload) -> m.NixlGet:
    ns, name, items, extents = parsed
    return m.NixlGet(head.request_id, tuple(key for key, _, _ in items), name,
                     tuple((address, capacity) for _, address, capacity in items), ns,
                     bool(head.flags & FLAG_READER_VERIFIES), extents)


REQUEST_DECODERS = {
    Op.NIXL_METADATA: (_meta_metadata, lambda h, p, _: m.NixlMetadata(h.request_id, p[1], p[0])),
    Op.NIXL_GET: (_meta_get, _build_get),
    Op.NIXL_PUT: (_meta_put, lambda h, p, _: m.NixlPut(h.request_id, p[2], p[1], p[3], bool(h.flags & FLAG_DURABLE),
                                                       p[0])),
}
REPLY_DECODERS = {
    Op.NIXL_METADATA: (_meta_metadata_reply, lambda h, p, _: m.NixlMetadataReply(h.request_id, p)),
    Op.NIXL_GET: (_meta_get_reply, lambda h, p, _: m.NixlGetReply(h.request_id, p)),
    Op.NIXL_PUT: (_meta_put_reply, lambda h, p, _: m.NixlPutReply(h.request_id, p)),
}


# -- encoders ------------------------------------------------------------------
def _key(key) -> bytes:
    key = bytes(key)
    if len(key) != m.KEY_SIZE:
        raise ValueError(f"a key must be {m.KEY_SIZE} bytes, got {len(key)}")
    return key


def _encode_metadata(msg: m.NixlMetadata):
    if not msg.metadata or len(msg.metadata) > m.NIXL_AGENT_METADATA_BYTES_MAX:
        raise ValueError(f"NIXL agent metadata of {len(msg.metadata)} bytes: expected "
                         f"1..{m.NIXL_AGENT_METADATA_BYTES_MAX}")
    if len(msg.regions) > m.NIXL_REGIONS_MAX:
        raise ValueError(f"{len(msg.regions)} NIXL regions is over the limit {m.NIXL_REGIONS_MAX}")
    meta = b"".join(REGION.pack(address, length) for address, length in msg.regions) + bytes(msg.metadata)
    return Op.NIXL_METADATA, 0, msg.request_id, len(msg.regions), meta, [], 0


def _ns_and_agent_bytes(msg) -> tuple[int, bytes]:
    """(HAS_NS or 0, the namespace id and the agent name as the meta section starts with them)."""
    name = msg.agent_name.encode("utf-8")
    if not 0 < len(name) <= m.NIXL_AGENT_NAME_BYTES_MAX:
        raise ValueError(f"NIXL agent name of {len(name)} bytes: expected 1..{m.NIXL_AGENT_NAME_BYTES_MAX}")
    if msg.ns_id is None:
        return 0, U16.pack(len(name)) + name
    return FLAG_HAS_NS, _key(msg.ns_id) + U16.pack(len(name)) + name


def _encode_get(msg: m.NixlGet):
    if len(msg.keys) != len(msg.descriptors):
        raise ValueError(f"NIXL_GET of {len(msg.keys)} keys and {len(msg.descriptors)} descriptors")
    flags, prefix = _ns_and_agent_bytes(msg)
    flags |= FLAG_READER_VERIFIES if msg.reader_verifies else 0
    items = b"".join(DESCRIPTOR.pack(_key(k), address, capacity)
                     for k, (address, capacity) in zip(msg.keys, msg.descriptors))
    if msg.extents is not None:
        flags |= FLAG_SCATTER
        items += _encode_extents(msg)
    return Op.NIXL_GET, flags, msg.request_id, len(msg.keys), prefix + items, [], 0


def _encode_put(msg: m.NixlPut):
    if not msg.keys or len(msg.keys) != len(msg.extents):
        raise ValueError(f"NIXL_PUT of {len(msg.keys)} keys and {len(msg.extents)} extent lists (one or more items)")
    if any(not extents or any(n <= 0 for _, n in extents) for extents in msg.extents):
        raise ValueError("NIXL_PUT: every block is one or more extents of one byte or more")
    total = sum(len(e) for e in msg.extents)
    if total > m.NIXL_EXTENTS_MAX:
        raise ValueError(f"NIXL_PUT of {total} extents is over the limit {m.NIXL_EXTENTS_MAX}")
    flags, prefix = _ns_and_agent_bytes(msg)
    flags |= FLAG_DURABLE if msg.durable else 0
    meta = prefix + b"".join(SOURCE.pack(_key(k), len(e)) for k, e in zip(msg.keys, msg.extents)) + b"".join(
        EXTENT.pack(address, length) for extents in msg.extents for address, length in extents)
    return Op.NIXL_PUT, flags, msg.request_id, len(msg.keys), meta, [], 0


def _encode_extents(msg: m.NixlGet) -> bytes:
    if len(msg.extents) != len(msg.keys):
        raise ValueError(f"NIXL_GET of {len(msg.keys)} keys and {len(msg.extents)} extent lists")
    total = sum(len(e) for e in msg.extents)
    if total > m.NIXL_EXTENTS_MAX:
        raise ValueError(f"NIXL_GET of {total} extents is over the limit {m.NIXL_EXTENTS_MAX}")
    for index, (extents, (address, capacity)) in enumerate(zip(msg.extents, msg.descriptors)):
        if not _extents_match(extents, address, capacity):
            raise ValueError(f"NIXL_GET item {index}: its extents must start at its descriptor's address and add up "
                             "to its capacity")
    return b"".join(COUNT.pack(len(e)) for e in msg.extents) + b"".join(
        EXTENT.pack(address, length) for extents in msg.extents for address, length in extents)


def _encode_get_reply(msg: m.NixlGetReply):
    for length in msg.lengths:
        if not 0 <= length <= DEFERRED_LENGTH:
            raise ValueError(f"NIXL_GET reply length {length} does not fit a u32")
    meta = struct.pack(f"<{len(msg.lengths)}I", *msg.lengths)
    return Op.NIXL_GET | m.REPLY_BIT, 0, msg.request_id, len(msg.lengths), meta, [], 0


ENCODERS = {
    m.NixlMetadata: _encode_metadata,
    m.NixlMetadataReply: lambda msg: (Op.NIXL_METADATA | m.REPLY_BIT, 0, msg.request_id, 0, bytes(msg.metadata),
                                      [], 0),
    m.NixlGet: _encode_get,
    m.NixlGetReply: _encode_get_reply,
    m.NixlPut: _encode_put,
    m.NixlPutReply: lambda msg: (Op.NIXL_PUT | m.REPLY_BIT, 0, msg.request_id, len(msg.seqs),
                                 struct.pack(f"<{len(msg.seqs)}Q", *msg.seqs), [], 0),
}
