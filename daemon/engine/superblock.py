"""The per-device superblock: store identity and geometry (pure, no I/O).

Every device starts with one 4 KiB superblock; the data area follows at
``data_offset_bytes``::

    offset size field
    0      4    magic              b"KVSB"
    4      2    version
    6      2    device_index       this device's place in the stripe set
    8      2    device_count
    10     2    reserved
    12     16   store_uuid         same on every device of one store
    28     8    generation         bumped by delete_all; regions of older generations are free
    36     16   device_uuid        this device
    52     8    device_size_bytes  size when formatted (a resized device is refused)
    60     4    stripe_size_bytes
    64     8    region_size_bytes
    72     8    data_offset_bytes
    80     8    device_data_bytes
    88     16*N device uuids, in stripe order
    1112   8    seq_floor          every seq <= this belongs to an erased store or generation
                                   (delete_all, format): recovery ignores it. 0 in superblocks
                                   written before the field existed (zeros there): no floor
    4092   4    CRC32C of bytes 0..4091
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import crc32c

SUPERBLOCK_BYTES = 4096  # one O_DIRECT page
SUPERBLOCK_MAGIC = b"KVSB"
SUPERBLOCK_VERSION = 1
DATA_OFFSET_BYTES = 64 * 1024  # room for the superblock (and future metadata) before the data area
DEVICE_COUNT_MAX = 64  # the uuid list must fit the superblock page
_FIXED = struct.Struct("<4sHHHH16sQ16sQIQQQ")
assert _FIXED.size == 88, _FIXED.size
SEQ_FLOOR_OFFSET = _FIXED.size + 16 * DEVICE_COUNT_MAX  # just past the longest uuid list
_SEQ_FLOOR = struct.Struct("<Q")
assert SEQ_FLOOR_OFFSET == 1112 and SEQ_FLOOR_OFFSET + _SEQ_FLOOR.size + 4 <= SUPERBLOCK_BYTES


class SuperblockError(ValueError):
    """The page is not a valid kvtier superblock."""


@dataclass(frozen=True)
class Superblock:
    store_uuid: bytes
    generation: int
    device_index: int
    device_uuids: tuple[bytes, ...]
    device_size_bytes: int
    stripe_size_bytes: int
    region_size_bytes: int
    data_offset_bytes: int
    device_data_bytes: int
    seq_floor: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.seq_floor < 1 << 64:
            raise SuperblockError(f"seq floor {self.seq_floor} is outside 0..2**64-1")
        if not 1 <= len(self.device_uuids) <= DEVICE_COUNT_MAX:
            raise SuperblockError(f"device count {len(self.device_uuids)} is outside 1..{DEVICE_COUNT_MAX}")
        if not 0 <= self.device_index < len(self.device_uuids):
            raise SuperblockError(f"device index {self.device_index} is outside the {len(self.device_uuids)} devices")

    @property
    def device_uuid(self) -> bytes:
        return self.device_uuids[self.device_index]

    def encode(self) -> bytes:
        fixed = _FIXED.pack(SUPERBLOCK_MAGIC, SUPERBLOCK_VERSION, self.device_index, len(self.device_uuids), 0,
                            self.store_uuid, self.generation, self.device_uuid, self.device_size_bytes,
                            self.stripe_size_bytes, self.region_size_bytes, self.data_offset_bytes,
                            self.device_data_bytes)
        body = ((fixed + b"".join(self.device_uuids)).ljust(SEQ_FLOOR_OFFSET, b"\0")
                + _SEQ_FLOOR.pack(self.seq_floor)).ljust(SUPERBLOCK_BYTES - 4, b"\0")
        return body + struct.pack("<I", crc32c.crc32c(body))


def decode_superblock(page) -> Superblock:
    view = memoryview(page).cast("B")
    if view.nbytes < SUPERBLOCK_BYTES:
        raise SuperblockError(f"superblock needs {SUPERBLOCK_BYTES} bytes, got {view.nbytes}")
    (magic, version, index, count, _, store_uuid, generation, device_uuid, size, stripe, region, data_off,
     data_bytes) = _FIXED.unpack_from(view)
    if magic != SUPERBLOCK_MAGIC:
        raise SuperblockError("no kvtier superblock (bad magic)")
    (crc,) = struct.unpack_from("<I", view, SUPERBLOCK_BYTES - 4)
    if crc32c.crc32c(view[:SUPERBLOCK_BYTES - 4]) != crc:
        raise SuperblockError("superblock CRC mismatch")
    if version != SUPERBLOCK_VERSION:
        raise SuperblockError(f"unsupported superblock version {version}")
    if not 1 <= count <= DEVICE_COUNT_MAX:
        raise SuperblockError(f"device count {count} is outside 1..{DEVICE_COUNT_MAX}")
    uuids = tuple(bytes(view[_FIXED.size + 16 * i:_FIXED.size + 16 * (i + 1)]) for i in range(count))
    (seq_floor,) = _SEQ_FLOOR.unpack_from(view, SEQ_FLOOR_OFFSET)
    sb = Superblock(bytes(store_uuid), generation, index, uuids, size, stripe, region, data_off, data_bytes,
                    seq_floor)
    if sb.device_uuid != bytes(device_uuid):
        raise SuperblockError("device uuid is not in the superblock's own device list")
    return sb
