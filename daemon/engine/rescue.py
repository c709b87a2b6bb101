"""The rescue journal: what an in-place compaction must not lose, on a filesystem beside the store.

A store with no clean region cannot compact a region the usual way (its pinned blocks need
somewhere to go first). At open the region manager then compacts one region *in place*
(:meth:`RegionManager.repair_at_open`): the blocks and records it must keep go to this journal
(written whole, synced, renamed into place), the region is freed and opened again, they are
appended to it and committed, and the journal is removed. A journal found at open is an
in-place compaction a crash cut short: it is done again, with the journal's blocks added to
what the region holds by then.

File format (little-endian): a header -- magic ``KVRJ``, version, region, the region's base_seq
when the journal was written, block and record counts, the body's CRC32C, the header's CRC32C --
then each block (u32 length, u8 pinned, the block's bytes) and each record (u8 kind, u64 k0,
u64 k1, 16-byte namespace, u64 target seq). Encoding and decoding are pure; :class:`RescueJournal`
does the file I/O.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

import crc32c

JOURNAL_NAME = "rescue.kvrj"
MAGIC = b"KVRJ"
VERSION = 1
_HEADER = struct.Struct("<4sHHIQIII")  # magic, version, pad, region, base_seq, blocks, records, body crc
_HEADER_CRC = struct.Struct("<I")
_BLOCK = struct.Struct("<IB")
_RECORD = struct.Struct("<BQQ16sQ")


class RescueFormatError(ValueError):
    """A journal that cannot be read (torn, damaged, another version)."""


@dataclass
class Rescue:
    region: int
    base_seq: int
    blocks: list[tuple[bytes, bool]] = field(default_factory=list)  # (block, pinned)
    records: list[tuple] = field(default_factory=list)  # (kind, k0, k1, ns, target_seq)


def encode_rescue(rescue: Rescue) -> bytes:
    body = bytearray()
    for block, pinned in rescue.blocks:
        body += _BLOCK.pack(len(block), int(pinned)) + block
    for kind, k0, k1, ns, target_seq in rescue.records:
        body += _RECORD.pack(kind, k0, k1, bytes(ns), target_seq)
    header = _HEADER.pack(MAGIC, VERSION, 0, rescue.region, rescue.base_seq, len(rescue.blocks), len(rescue.records),
                          crc32c.crc32c(body))
    return header + _HEADER_CRC.pack(crc32c.crc32c(header)) + bytes(body)


def decode_rescue(data: bytes) -> Rescue:
    head_end = _HEADER.size + _HEADER_CRC.size
    if len(data) < head_end:
        raise RescueFormatError(f"{len(data)} bytes: shorter than a journal header")
    magic, version, _, region, base_seq, nblocks, nrecords, body_crc = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise RescueFormatError("not a rescue journal (bad magic)")
    if _HEADER_CRC.unpack_from(data, _HEADER.size)[0] != crc32c.crc32c(data[:_HEADER.size]):
        raise RescueFormatError("journal header CRC mismatch")
    if version != VERSION:
        raise RescueFormatError(f"unsupported journal version {version}")
    body = memoryview(data)[head_end:]
    if crc32c.crc32c(body) != body_crc:
        raise RescueFormatError("journal body CRC mismatch (torn or damaged)")
    rescue, at = Rescue(region, base_seq), 0
    try:
        for _ in range(nblocks):
            length, pinned = _BLOCK.unpack_from(body, at)
            at += _BLOCK.size
            if at + length > len(body):
                raise RescueFormatError("a journal block runs past the end")
            rescue.blocks.append((bytes(body[at:at + length]), bool(pinned)))
            at += length
        for _ in range(nrecords):
            rescue.records.append(_RECORD.unpack_from(body, at))
            at += _RECORD.size
    except struct.error as exc:
        raise RescueFormatError(f"journal shorter than its counts: {exc}") from None
    if at != len(body):
        raise RescueFormatError(f"{len(body) - at} bytes past the journal's last record")
    return rescue


class RescueJournal:
    """The journal file in ``directory`` (the daemon's data directory)."""

    def __init__(self, directory: str):
        self.directory = directory
        self.path = os.path.join(directory, JOURNAL_NAME)

    def read(self) -> Rescue | None:
        """The journal left by a compaction a crash cut short, or None. One that cannot be read was
        torn before its rename (the compaction had not begun): it is removed."""
        try:
            with open(self.path, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            return None
        try:
            return decode_rescue(data)
        except RescueFormatError:
            self.remove()
            return None

    def write(self, rescue: Rescue) -> None:
        """Write the journal whole and durably (a temporary file, fsync, rename, fsync of the directory)."""
        os.makedirs(self.directory, exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "wb") as fh:
            fh.write(encode_rescue(rescue))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        self._sync_directory()

    def remove(self) -> None:
        for path in (self.path, self.path + ".tmp"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._sync_directory()

    def _sync_directory(self) -> None:
        if not os.path.isdir(self.directory):
            return
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
