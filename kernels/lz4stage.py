"""The optional ``+lz4`` stage after any base codec, kept only where it pays.

LZ4 finds almost nothing in fp16 or int8 KV bytes as they are (ratio 1.00): the
low mantissa byte of every fp16 value is noise and sits between the exponent
bytes. Two things change that:

* byte-plane shuffle: for 2-byte elements, all low bytes first, then all high
  bytes (sign, exponent, top mantissa bits) - the high-byte plane repeats;
* sparse or padded blocks (zero runs), which LZ4 removes whatever the codec.

The encoder tries the transforms that can help for the base codec, keeps the
smallest, and stores the payload uncompressed when the best saves less than
``MIN_SAVING_FRACTION``. Frame::

    offset size field
    0      4    magic b"KVZ1"
    4      1    mode (0 stored, 1 lz4, 2 byte-plane shuffle (2-byte elements) + lz4)
    5      3    reserved, zero
    8      8    length of the base codec payload, bytes
    16     ...  stored or compressed base payload
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.common import codec_ids

MAGIC = b"KVZ1"
_FRAME = struct.Struct("<4sB3xQ")
assert _FRAME.size == 16
MODE_STORED, MODE_LZ4, MODE_SHUFFLE2_LZ4 = 0, 1, 2
MIN_SAVING_FRACTION = 1 / 32  # below 3 % saved, decompression time costs more than the bytes
MAX_PAYLOAD_BYTES = 1 << 31  # lz4.block handles at most 2 GiB per call


def shuffle2(data: bytes | memoryview) -> bytes:
    """Byte planes of 2-byte elements: b0 b2 b4 ... then b1 b3 b5 ...; an odd tail byte stays last."""
    n = len(data) // 2
    arr = np.frombuffer(data, np.uint8, 2 * n).reshape(n, 2)
    return arr.T.tobytes() + bytes(memoryview(data)[2 * n:])


def unshuffle2(data: bytes | memoryview) -> bytes:
    n = len(data) // 2
    arr = np.frombuffer(data, np.uint8, 2 * n).reshape(2, n)
    return arr.T.tobytes() + bytes(memoryview(data)[2 * n:])


def compress(payload: bytes, *, try_shuffle: bool) -> tuple[int, bytes]:
    """(mode, body) with the smallest body among the transforms tried."""
    if len(payload) >= MAX_PAYLOAD_BYTES:
        raise ValueError(f"payload of {len(payload)} bytes exceeds the lz4 stage limit {MAX_PAYLOAD_BYTES}")
    best_mode, best = MODE_STORED, payload
    candidates = [(MODE_LZ4, payload)]
    if try_shuffle:
        candidates.append((MODE_SHUFFLE2_LZ4, shuffle2(payload)))
    import lz4.block  # lazy: only the +lz4 codecs need it

    limit = len(payload) * (1 - MIN_SAVING_FRACTION)
    for mode, body in candidates:
        packed = lz4.block.compress(body, store_size=False)
        if len(packed) < limit and len(packed) < len(best):
            best_mode, best = mode, packed
    return best_mode, best


def decompress(frame: bytes | memoryview) -> bytes | memoryview:
    mv = memoryview(frame)
    if len(mv) < _FRAME.size:
        raise ValueError(f"lz4 frame truncated: {len(mv)} bytes, header needs {_FRAME.size}")
    magic, mode, length = _FRAME.unpack_from(mv, 0)
    if magic != MAGIC:
        raise ValueError(f"not an lz4 stage frame: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if length >= MAX_PAYLOAD_BYTES:
        raise ValueError(f"lz4 frame claims {length} bytes, over the limit {MAX_PAYLOAD_BYTES}")
    body = mv[_FRAME.size:]
    if mode == MODE_STORED:
        if len(body) != length:
            raise ValueError(f"lz4 frame (stored) truncated: {len(body)} bytes, expected {length}")
        return body
    if mode not in (MODE_LZ4, MODE_SHUFFLE2_LZ4):
        raise ValueError(f"lz4 frame has unknown mode {mode}")
    import lz4.block

    try:
        raw = lz4.block.decompress(body, uncompressed_size=length)
    except lz4.block.LZ4BlockError as exc:
        raise ValueError(f"lz4 frame corrupt or truncated: {exc}") from exc
    if len(raw) != length:
        raise ValueError(f"lz4 frame decompressed to {len(raw)} bytes, expected {length}")
    return unshuffle2(raw) if mode == MODE_SHUFFLE2_LZ4 else raw


def frame_mode(frame: bytes | memoryview) -> int:
    """The mode byte of a frame (for statistics and tests)."""
    return _FRAME.unpack_from(memoryview(frame), 0)[1]


@dataclass(frozen=True)
class Lz4Codec:
    """``<base>+lz4``: the base codec, then the lz4 stage on its payload."""

    base: Any  # a base codec (RawCodec, QuantCodec, MixedCodec)

    @property
    def name(self) -> str:
        return self.base.name + "+lz4"

    @property
    def codec_id(self) -> int:
        return codec_ids.codec_id(self.name)

    @property
    def takes_seq_tokens(self) -> bool:
        return getattr(self.base, "takes_seq_tokens", False)

    def encoded_size_max(self, x: Any) -> int:
        """The largest frame of an array shaped like ``x``: the base payload stored, after the frame header."""
        base_max = getattr(self.base, "encoded_size_max", None) or self.base.encoded_size
        return _FRAME.size + base_max(x)

    def encode(self, x: Any, *, seq_tokens: int | None = None) -> bytes:
        """``seq_tokens`` goes to a base codec that takes it (mixed)."""
        payload = self.base.encode(x) if seq_tokens is None else self.base.encode(x, seq_tokens=seq_tokens)
        # byte planes only help 2-byte elements, i.e. raw fp16/bf16 bytes
        mode, body = compress(payload, try_shuffle=self.base.name == "raw")
        return _FRAME.pack(MAGIC, mode, len(payload)) + body

    def decode(self, data: bytes | memoryview, out: Any) -> Any:
        return self.base.decode(decompress(data), out)
