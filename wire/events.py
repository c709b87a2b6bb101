"""Data-protocol vocabulary: ops, error codes, limits, messages, exceptions.

Pure: no I/O. Every message is a frozen dataclass; the bytes are
:mod:`kvtier.wire.frames` (layout), :mod:`kvtier.wire.readers` and
:mod:`kvtier.wire.writers`, the states :mod:`kvtier.wire.state`, and
:mod:`kvtier.wire.connection` puts them together. ``docs/protocol.md``
describes the bytes.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Mapping

PROTOCOL_VERSION = 1
KEY_SIZE = 16  # block keys and namespace ids (kvtier.common.keys.KEY_SIZE_BYTES)

# -- limits (each checked before anything is allocated) ---------------------
BATCH_COUNT_MAX = 16384  # keys per frame: a 256k-token chain at 16 tokens per block
META_BYTES_MAX = 1 << 20  # item tables (16384 x 24-byte locations) and JSON documents
FEATURE_GET_READER_VERIFIES = "get_reader_verifies"  # HELLO features: GET honours FLAG_READER_VERIFIES
FEATURE_KV_EVENTS = "kv_events"  # HELLO features: the daemon publishes KV events (kvtierd --kv-events-endpoint)
FEATURE_PIN_TTL = "pin_ttl"  # HELLO features: PIN honours FLAG_PIN_TTL (soft pins that expire by themselves)
FEATURE_PUT_SKIP_DELETED = "put_skip_deleted"  # HELLO features: PUT honours FLAG_SKIP_DELETED (seq 0: not stored)
PIN_TTL_MS_MAX = 2**32 - 1  # the PIN meta's u32: about 49.7 days
FEATURE_UPSTREAM = "upstream"  # HELLO features: the daemon has an upstream and answers FLAG_WANT_ORIGIN
FEATURE_NIXL = "nixl"  # HELLO features: the daemon runs a NIXL agent and answers NIXL_METADATA / NIXL_GET
FEATURE_NIXL_PUT = "nixl_put"  # HELLO features: the daemon answers NIXL_PUT (READs the blocks from the client)
NIXL_AGENT_METADATA_BYTES_MAX = 256 << 10  # a NIXL agent's metadata blob: ~300 bytes + ~50 per registered region
NIXL_REGIONS_MAX = 1024  # destination regions one client declares: a hot pool or KV pages in a few large buffers
NIXL_AGENT_NAME_BYTES_MAX = 256  # a NIXL agent name: a label, like HELLO's client name
NIXL_EXTENTS_MAX = 1 << 16  # extents one NIXL_GET scatters its blocks across: 32 blocks x 2048 rows
PAYLOAD_BYTES_MAX = 256 << 20  # block bytes per frame: bounds one connection's buffer
NAME_BYTES_MAX = 256  # client name in HELLO: a label, not a document
TOKEN_BYTES_MAX = 4096  # auth token in HELLO: far above any sane secret
PING_BYTES_MAX = 4096  # PING echo body: a liveness probe, not a transfer
HELLO_META_BYTES_MAX = 2 + NAME_BYTES_MAX + 2 + TOKEN_BYTES_MAX  # the largest valid HELLO meta section: all a
# server reads from a peer before its HELLO succeeded (nothing is allocated for an unauthenticated peer)
ERROR_MESSAGE_BYTES_MAX = 4096  # error text: one readable sentence or a few


@dataclass(frozen=True)
class Limits:
    """Per-connection limits. ``block_bytes_max`` is the largest single block
    the peer may send (the daemon sets it to its region size)."""

    batch_count_max: int = BATCH_COUNT_MAX
    meta_bytes_max: int = META_BYTES_MAX
    payload_bytes_max: int = PAYLOAD_BYTES_MAX
    block_bytes_max: int = PAYLOAD_BYTES_MAX

    def __post_init__(self) -> None:
        for name in ("batch_count_max", "meta_bytes_max", "payload_bytes_max", "block_bytes_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"Limits.{name} must be a positive int, got {value!r}")


DEFAULT_LIMITS = Limits()


class Op(enum.IntEnum):
    HELLO = 0x01
    LOOKUP = 0x02
    GET = 0x03
    PUT = 0x04
    DELETE = 0x05
    PIN = 0x06
    UNPIN = 0x07
    FLUSH = 0x08
    STATS = 0x09
    PING = 0x0A
    NIXL_METADATA = 0x0B  # NIXL agent metadata exchange (after HELLO, on the authenticated connection)
    NIXL_GET = 0x0C  # GET whose blocks the daemon WRITEs into the client's NIXL descriptors
    NIXL_PUT = 0x0D  # PUT whose blocks the daemon READs from the client's NIXL memory
    ERROR = 0x7F  # a reply only
    # replies: request op | REPLY_BIT


REPLY_BIT = 0x80
REQUEST_OPS = frozenset(op for op in Op if op is not Op.ERROR)


class ErrorCode(enum.IntEnum):
    BAD_FRAME = 1  # magic, truncation, garbage: the connection is closed
    BAD_VERSION = 2
    LIMIT = 3  # a length or count over its limit
    UNKNOWN_OP = 4
    BAD_REQUEST = 5  # malformed item table, wrong key size, ...
    BAD_BLOCK = 6  # a block that fails verification (CRC, key, size)
    TOO_LARGE = 7  # a block larger than a region
    NO_SPACE = 8  # every region pinned
    AUTH = 9  # missing or wrong token
    BUSY = 10  # over the connection limit, or the daemon's transient request buffers are spent
    TIMEOUT = 11  # the peer stalled mid-frame
    SHUTTING_DOWN = 12
    INTERNAL = 13
    DEVICE_ERROR = 14  # a device I/O failed (full disk, failing drive); the message names the device


class ClientError(Exception):
    """Base of kvtier's protocol and client errors."""


class ProtocolError(ClientError):
    """Bytes received that break the protocol (a local finding). ``fatal``
    means the framing is lost and the connection must be closed."""

    def __init__(self, code: ErrorCode, message: str, request_id: int = 0, fatal: bool = True):
        super().__init__(message)
        self.code = ErrorCode(code)
        self.request_id = request_id
        self.fatal = fatal


class RemoteError(ClientError):
    """The daemon answered with an error frame."""

    def __init__(self, code: ErrorCode | int, message: str, request_id: int = 0):
        try:
            code = ErrorCode(code)
        except ValueError:
            pass
        super().__init__(f"{getattr(code, 'name', code)}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


class ConnectionLost(ClientError):
    """The connection closed or timed out before a reply arrived."""


# -- requests ---------------------------------------------------------------
# Batch requests as received carry their keys as kvtier.wire.readers.PackedKeys:
# a sequence of the 16-byte keys that compares equal to the tuple of them.
@dataclass(frozen=True)
class Hello:
    request_id: int
    client_name: str = ""
    token: str = ""


@dataclass(frozen=True)
class Lookup:
    request_id: int
    keys: tuple[bytes, ...]
    want_locations: bool = False
    ns_id: bytes | None = None
    want_origin: bool = False  # the reply says, per leading block, whether it is here or at the upstream


@dataclass(frozen=True)
class Get:
    """``reader_verifies``: the reader checks payload CRCs itself, so the daemon may send blocks
    with only header, key and seq checked (a daemon that says so in HELLO's ``features``);
    without it the daemon checks payloads too and drops a block corrupt on flash."""

    request_id: int
    keys: tuple[bytes, ...]
    ns_id: bytes | None = None
    reader_verifies: bool = False
    want_origin: bool = False  # the reply says, per block, whether it was local or fetched from the upstream


class BlockParts(tuple):
    """One block held in several buffers (bytes-like), sent in order as one block: a PUT of a
    block straight from the memory it lies in, with no joining copy."""

    @property
    def nbytes(self) -> int:
        return sum(memoryview(part).nbytes for part in self)


@dataclass(frozen=True)
class Put:
    """``blocks[i]`` is the full block (header + payload) stored under ``keys[i]``."""

    request_id: int
    keys: tuple[bytes, ...]
    blocks: tuple[Any, ...]  # bytes-like, or BlockParts
    durable: bool = False
    ns_id: bytes | None = None
    skip_deleted: bool = False  # FLAG_SKIP_DELETED: a key the daemon deleted lately is answered seq 0, not stored


@dataclass(frozen=True)
class Delete:
    request_id: int
    keys: tuple[bytes, ...]
    ns_id: bytes | None = None


@dataclass(frozen=True)
class Pin:
    """``ttl_ms``: a soft pin for that many milliseconds (1..PIN_TTL_MS_MAX), which expires by
    itself and is kept in the daemon's memory only; None: a hard pin, durable until UNPIN."""

    request_id: int
    keys: tuple[bytes, ...]
    ns_id: bytes | None = None
    ttl_ms: int | None = None


@dataclass(frozen=True)
class Unpin:
    request_id: int
    keys: tuple[bytes, ...]
    ns_id: bytes | None = None


@dataclass(frozen=True)
class Flush:
    request_id: int


@dataclass(frozen=True)
class Stats:
    request_id: int


@dataclass(frozen=True)
class Ping:
    request_id: int
    data: bytes = b""


# -- replies ----------------------------------------------------------------
@dataclass(frozen=True)
class Location:
    """Where a present block lives in the daemon's logical (striped) space.
    (The block client hands these out as ``BlockLocationInfo``.)"""

    logical_offset: int
    length: int
    seq: int
    sealed: bool


@dataclass(frozen=True)
class LocationRecords:
    """LOOKUP reply locations already in their wire form: ``count`` 24-byte
    records (see ``kvtier.wire.writers.location_records``), for a sender that has
    them as columns -- no object per key. Received replies always carry a
    tuple of :class:`Location` / None instead."""

    records: bytes
    count: int

    def __post_init__(self) -> None:
        if len(self.records) != 24 * self.count:
            raise ValueError(f"{len(self.records)} bytes of location records for {self.count} keys")

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class HelloReply:
    request_id: int
    info: Mapping[str, Any] = field(default_factory=dict)  # JSON document


@dataclass(frozen=True)
class LookupReply:
    request_id: int
    leading: int
    locations: tuple[Location | None, ...] | LocationRecords | None = None
    origins: bytes | None = None  # WANT_ORIGIN: one byte per leading key (frames.ORIGIN_LOCAL / ORIGIN_UPSTREAM)


class _Deferred:
    """A GET reply item left out to keep the reply under PAYLOAD_BYTES_MAX: ask again."""

    def __repr__(self) -> str:
        return "DEFERRED"


DEFERRED = _Deferred()


@dataclass(frozen=True)
class GetReply:
    request_id: int
    blocks: tuple[Any, ...]  # bytes-like, None (miss) or DEFERRED (not sent this time)
    origins: bytes | None = None  # WANT_ORIGIN: one byte per item (frames.ORIGIN_LOCAL / ORIGIN_UPSTREAM)


@dataclass(frozen=True)
class PutReply:
    request_id: int
    seqs: tuple[int, ...]


@dataclass(frozen=True)
class DeleteReply:
    request_id: int
    results: tuple[bool, ...]


@dataclass(frozen=True)
class PinReply:
    request_id: int
    results: tuple[bool, ...]


@dataclass(frozen=True)
class UnpinReply:
    request_id: int
    results: tuple[bool, ...]


@dataclass(frozen=True)
class FlushReply:
    request_id: int


@dataclass(frozen=True)
class StatsReply:
    request_id: int
    stats: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PingReply:
    request_id: int
    data: bytes = b""


@dataclass(frozen=True)
class ErrorReply:
    request_id: int
    code: int
    message: str


@dataclass(frozen=True)
class Rejected:
    """A request the parser refused while keeping the framing (its bytes were
    skipped); the server answers it with an :class:`ErrorReply`."""

    request_id: int
    code: ErrorCode
    message: str


# -- NIXL (docs/nixl.md; the byte layout is kvtier.wire.nixl_frames) ---------
@dataclass(frozen=True)
class NixlMetadata:
    """The client's NIXL agent metadata and the destination regions it registered,
    ``(address, length_bytes)`` each: the daemon writes blocks only inside them."""

    request_id: int
    metadata: bytes
    regions: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class NixlMetadataReply:
    request_id: int
    metadata: bytes  # the daemon's agent metadata


@dataclass(frozen=True)
class NixlGet:
    """A GET whose blocks are written into ``descriptors[i] = (address, capacity_bytes)`` of the
    client agent ``agent_name`` (the one its NIXL_METADATA loaded), then NIXL notifications.
    ``extents`` (or None): per item the ``(address, length)`` pieces its block is written across,
    in order (an engine's KV rows); its descriptor is then ``(first address, total length)``."""

    request_id: int
    keys: tuple[bytes, ...]
    agent_name: str
    descriptors: tuple[tuple[int, int], ...]
    ns_id: bytes | None = None
    reader_verifies: bool = False
    extents: tuple[tuple[tuple[int, int], ...], ...] | None = None


@dataclass(frozen=True)
class NixlGetReply:
    """Per item the length written at its descriptor (0 = miss, DEFERRED_LENGTH = ask again)."""

    request_id: int
    lengths: tuple[int, ...]


@dataclass(frozen=True)
class NixlPut:
    """A PUT whose blocks the daemon READs from the client agent ``agent_name`` (the one its
    NIXL_METADATA loaded): block i is the bytes of ``extents[i] = ((address, length), ...)`` in
    order, each extent inside a region that agent declared."""

    request_id: int
    keys: tuple[bytes, ...]
    agent_name: str
    extents: tuple[tuple[tuple[int, int], ...], ...]
    durable: bool = False
    ns_id: bytes | None = None


@dataclass(frozen=True)
class NixlPutReply:
    request_id: int
    seqs: tuple[int, ...]  # as a PUT's


REQUEST_TYPES = (Hello, Lookup, Get, Put, Delete, Pin, Unpin, Flush, Stats, Ping, NixlMetadata, NixlGet, NixlPut)
REPLY_TYPES = (HelloReply, LookupReply, GetReply, PutReply, DeleteReply, PinReply, UnpinReply,
               FlushReply, StatsReply, PingReply, ErrorReply,
               NixlMetadataReply, NixlGetReply, NixlPutReply)
