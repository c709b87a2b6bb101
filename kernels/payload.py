"""The codec payload header: what a decoder needs to reject a wrong ``out``.

Every codec payload starts with this little-endian header, then its sections
(scales, then quantized values; or the raw bytes)::

    offset size field
    0      4    magic b"KVC1"
    4      1    version (1)
    5      1    base codec id (low byte of kvtier.common.codec_ids)
    6      1    dtype code of the original array (1 fp16, 2 bf16, 3 fp32)
    7      1    ndim
    8      4    group_tokens (tokens per scale group; 0 for raw)
    12     1    scale dtype code (0 none, 1 fp16, 3 fp32)
    13     3    reserved, zero
    16     4*n  shape, uint32 each

The header is not checksummed: the block header's CRC32C covers the payload.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

MAGIC = b"KVC1"
VERSION = 1
_FIXED = struct.Struct("<4sBBBBIB3x")
assert _FIXED.size == 16
MAX_NDIM = 8  # [layers, kv, heads, tokens, dim] plus room for batch/extra axes
MAX_DIM = 2**32 - 1  # each dim is stored as uint32


@dataclass(frozen=True)
class PayloadHeader:
    base_codec_id: int
    dtype_code: int
    shape: tuple[int, ...]
    group_tokens: int = 0
    scale_dtype_code: int = 0

    def __post_init__(self) -> None:
        if not 1 <= len(self.shape) <= MAX_NDIM:
            raise ValueError(f"array must have 1..{MAX_NDIM} dims, got {len(self.shape)}")
        if any(not 0 <= n <= MAX_DIM for n in self.shape):
            raise ValueError(f"shape {self.shape} has a dim outside 0..{MAX_DIM}")

    @property
    def size_bytes(self) -> int:
        return _FIXED.size + 4 * len(self.shape)

    def pack(self) -> bytes:
        fixed = _FIXED.pack(MAGIC, VERSION, self.base_codec_id, self.dtype_code, len(self.shape),
                            self.group_tokens, self.scale_dtype_code)
        return fixed + struct.pack(f"<{len(self.shape)}I", *self.shape)


def unpack_header(data: bytes | memoryview) -> PayloadHeader:
    """Parse and check the fixed part; ValueError naming what is wrong."""
    mv = memoryview(data)
    if len(mv) < _FIXED.size:
        raise ValueError(f"codec payload truncated: {len(mv)} bytes, header needs {_FIXED.size}")
    magic, version, base, dtype_code, ndim, group, scale_code = _FIXED.unpack_from(mv, 0)
    if magic != MAGIC:
        raise ValueError(f"not a codec payload: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise ValueError(f"codec payload version {version} unsupported (expected {VERSION})")
    if not 1 <= ndim <= MAX_NDIM:
        raise ValueError(f"codec payload ndim {ndim} outside 1..{MAX_NDIM}")
    if len(mv) < _FIXED.size + 4 * ndim:
        raise ValueError(f"codec payload truncated inside the shape: {len(mv)} bytes")
    shape = struct.unpack_from(f"<{ndim}I", mv, _FIXED.size)
    return PayloadHeader(base, dtype_code, tuple(shape), group, scale_code)
