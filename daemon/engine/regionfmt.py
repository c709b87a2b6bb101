"""On-flash layout of one region (pure, no I/O).

::

    region (region_size_bytes)
    +--------------------+ 0
    | region header page |   magic KVRH, generation, region index, base_seq, CRC
    +--------------------+ REGION_HEADER_BYTES
    | block | block | ...|   blocks back to back, each a self-describing
    |                    |   kvtier.common.blockformat block (header + payload)
    |        free        |
    +--------------------+ region_size - TRAILER_BYTES - n * ENTRY_BYTES
    | summary entries    |   n x 64 bytes (SUMMARY_DTYPE), entry 0 last: they grow down
    | trailer            |   64 bytes: magic KVRS, counts, seqs, CRCs
    +--------------------+ region_size

A region is *sealed* when its trailer is valid and carries the same
generation and base_seq as its header (or a newer base_seq: the header of
that use never reached flash, see recovery). A region whose header is valid but
whose trailer is not was open when the store stopped: its blocks are found by
walking the self-describing block headers from REGION_HEADER_BYTES (every
block's seq is > base_seq; the walk stops at the first block that is torn,
corrupt or older), then the summary entries already made durable (pins,
tombstones, pinned flags), read down from the trailer while seqs increase.

Summary entries record blocks and small metadata records (tombstones, pins);
the namespace id lives here, never in the in-memory index.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import crc32c
import numpy as np

from .errors import BadArgumentError

REGION_HEADER_BYTES = 4096  # one O_DIRECT page, so it can be rewritten alone when a region opens
REGION_HEADER_MAGIC = b"KVRH"
TRAILER_MAGIC = b"KVRS"
REGION_FORMAT_VERSION = 1
ENTRY_BYTES = 64
TRAILER_BYTES = 64

_HEADER = struct.Struct("<4sHHQIQ")  # magic, version, reserved, generation, region index, base_seq
_TRAILER = struct.Struct("<4sHHQIIQQII")  # magic, version, reserved, generation, index, count, base, last, data_end, entries crc
assert _TRAILER.size + 4 <= TRAILER_BYTES

# entry kinds
KIND_BLOCK = 1  # a block at offset/length
KIND_TOMBSTONE = 2  # key deleted; target_seq is the seq of the block it deletes
KIND_PIN = 3  # block (key, target_seq) pinned
KIND_UNPIN = 4  # block (key, target_seq) unpinned
KIND_NS_TOMBSTONE = 5  # every block of namespace ns (k0/k1 hold the ns id) with seq < this seq is deleted
FLAG_PINNED = 1
NO_NAMESPACE = bytes(16)  # the ns field of a record about one key (a tombstone, pin or unpin)

SUMMARY_DTYPE = np.dtype([
    ("k0", "<u8"), ("k1", "<u8"),  # the block key (little-endian halves)
    ("ns", "V16"),  # namespace id
    ("seq", "<u8"),  # seq of this record
    ("target_seq", "<u8"),  # for metadata records: the seq of the block they refer to
    ("offset", "<u4"),  # block offset inside the region
    ("length", "<u4"),  # block bytes (header + payload)
    ("kind", "u1"), ("flags", "u1"), ("pad", "V6"),
])
assert SUMMARY_DTYPE.itemsize == ENTRY_BYTES


class RegionFormatError(ValueError):
    """A region header or trailer that does not validate."""


@dataclass(frozen=True)
class RegionHeader:
    generation: int
    region_index: int
    base_seq: int


@dataclass(frozen=True)
class RegionTrailer:
    generation: int
    region_index: int
    entry_count: int
    base_seq: int
    last_seq: int
    data_end: int
    entries_crc: int


def encode_region_header(header: RegionHeader) -> bytes:
    body = _HEADER.pack(REGION_HEADER_MAGIC, REGION_FORMAT_VERSION, 0, header.generation,
                        header.region_index, header.base_seq)
    return (body + struct.pack("<I", crc32c.crc32c(body))).ljust(REGION_HEADER_BYTES, b"\0")


def decode_region_header(buf) -> RegionHeader:
    view = memoryview(buf).cast("B")
    magic, version, _, generation, index, base_seq = _HEADER.unpack_from(view)
    if magic != REGION_HEADER_MAGIC:
        raise RegionFormatError("no region header (bad magic)")
    (crc,) = struct.unpack_from("<I", view, _HEADER.size)
    if crc32c.crc32c(view[:_HEADER.size]) != crc:
        raise RegionFormatError("region header CRC mismatch")
    if version != REGION_FORMAT_VERSION:
        raise RegionFormatError(f"unsupported region format version {version}")
    return RegionHeader(generation, index, base_seq)


ENTRY_STRUCT = struct.Struct("<QQ16sQQIIBB6x")  # the same layout as SUMMARY_DTYPE, for one entry
assert ENTRY_STRUCT.size == ENTRY_BYTES


def data_room_bytes(region_size_bytes: int) -> int:
    """Room for blocks in an empty region (each block also takes one summary entry)."""
    return region_size_bytes - REGION_HEADER_BYTES - TRAILER_BYTES


def summary_bytes(entry_count: int) -> int:
    """Bytes the summary of ``entry_count`` entries takes at the region's end."""
    return TRAILER_BYTES + ENTRY_BYTES * entry_count


def entry_position(region_size_bytes: int, index: int) -> int:
    """Where entry ``index`` sits: entries grow down from the trailer, entry 0 nearest it,
    so an entry's place is fixed when it is appended."""
    return region_size_bytes - TRAILER_BYTES - ENTRY_BYTES * (index + 1)


def pack_entry(buf, position: int, k0: int, k1: int, ns: bytes, seq: int, target_seq: int,
               offset: int, length: int, kind: int, flags: int = 0) -> None:
    ENTRY_STRUCT.pack_into(buf, position, k0, k1, ns, seq, target_seq, offset, length, kind, flags)


def make_trailer(raw_entries, generation: int, region_index: int, entry_count: int, base_seq: int,
                 last_seq: int, data_end: int) -> RegionTrailer:
    return RegionTrailer(generation, region_index, entry_count, base_seq, last_seq, data_end,
                         crc32c.crc32c(raw_entries))


def encode_trailer(trailer: RegionTrailer) -> bytes:
    body = _TRAILER.pack(TRAILER_MAGIC, REGION_FORMAT_VERSION, 0, trailer.generation, trailer.region_index,
                         trailer.entry_count, trailer.base_seq, trailer.last_seq, trailer.data_end,
                         trailer.entries_crc).ljust(TRAILER_BYTES - 4, b"\0")
    return body + struct.pack("<I", crc32c.crc32c(body))


def decode_trailer(tail) -> RegionTrailer:
    """Parse the last TRAILER_BYTES of a region."""
    view = memoryview(tail).cast("B")
    if view.nbytes != TRAILER_BYTES:
        raise RegionFormatError(f"trailer needs {TRAILER_BYTES} bytes, got {view.nbytes}")
    (crc,) = struct.unpack_from("<I", view, TRAILER_BYTES - 4)
    if crc32c.crc32c(view[:TRAILER_BYTES - 4]) != crc:
        raise RegionFormatError("region trailer CRC mismatch")
    magic, version, _, generation, index, count, base, last, data_end, entries_crc = _TRAILER.unpack_from(view)
    if magic != TRAILER_MAGIC:
        raise RegionFormatError("no region trailer (bad magic)")
    if version != REGION_FORMAT_VERSION:
        raise RegionFormatError(f"unsupported region format version {version}")
    return RegionTrailer(generation, index, count, base, last, data_end, entries_crc)


def decode_entries(raw, trailer: RegionTrailer) -> np.ndarray:
    """The summary entries in append order (a copy), checked against the trailer's CRC.
    ``raw`` is the ``ENTRY_BYTES * entry_count`` bytes just before the trailer."""
    view = memoryview(raw).cast("B")
    if view.nbytes != ENTRY_BYTES * trailer.entry_count:
        raise RegionFormatError(f"summary of {trailer.entry_count} entries needs "
                                f"{ENTRY_BYTES * trailer.entry_count} bytes, got {view.nbytes}")
    if crc32c.crc32c(view) != trailer.entries_crc:
        raise RegionFormatError("region summary CRC mismatch")
    return np.frombuffer(view, dtype=SUMMARY_DTYPE)[::-1].copy()


def keys_to_halves(keys) -> tuple[np.ndarray, np.ndarray]:
    """16-byte keys -> (k0, k1) little-endian uint64 halves, vectorized."""
    joined = b"".join(bytes(k) for k in keys)
    if len(joined) != 16 * len(keys):
        bad = next(k for k in keys if len(bytes(k)) != 16)
        raise BadArgumentError(f"keys must be 16 bytes, got {len(bytes(bad))}")
    pairs = np.frombuffer(joined, dtype="<u8").reshape(-1, 2)
    return pairs[:, 0].copy(), pairs[:, 1].copy()


def key_buffer_to_halves(keys_buf) -> tuple[np.ndarray, np.ndarray]:
    """N keys given as one contiguous buffer of N x 16 bytes (bytes, bytearray, memoryview, a
    C-contiguous NumPy array) -> (k0, k1), without a per-key step."""
    try:
        view = memoryview(keys_buf).cast("B")
    except TypeError as exc:
        raise BadArgumentError(f"keys buffer must be C-contiguous: {exc}") from exc
    if view.nbytes % 16:
        raise BadArgumentError(f"keys buffer of {view.nbytes} bytes is not a whole number of 16-byte keys")
    pairs = np.frombuffer(view, dtype="<u8").reshape(-1, 2)
    return pairs[:, 0].copy(), pairs[:, 1].copy()


def key_to_halves(key: bytes) -> tuple[int, int]:
    """One 16-byte key -> its (k0, k1) little-endian halves."""
    if len(key) != 16:
        raise BadArgumentError(f"keys must be 16 bytes, got {len(key)}")
    return int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")


def halves_to_key(k0: int, k1: int) -> bytes:
    return struct.pack("<QQ", int(k0), int(k1))
