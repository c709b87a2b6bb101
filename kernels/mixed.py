"""Mixed precision: a ``[layers, ...]`` block with a codec chosen per layer.

Seed article 000 advises keeping chosen layers (typically the first and the
last, whose errors hurt most) in fp16 once sequences pass about 8 K tokens,
where quantization error accumulates over the long attention span.
``MixedPrecisionPolicy`` states that choice; ``MixedCodec`` ("mixed") applies
it and records each layer's codec in its payload, so decoding needs no policy::

    offset size field
    0      4    magic b"KVM1"
    4      1    version (1)
    5      3    reserved, zero
    8      4    num_layers
    12     4    reserved, zero
    16     16*L per layer: codec id (uint16), 6 reserved bytes, payload length (uint64)
    ...         the layers' codec payloads, in order
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, ClassVar

from kvtier.common import codec_ids
from .codec import DEFAULT_GROUP_TOKENS, QuantCodec, RawCodec

MAGIC = b"KVM1"
VERSION = 1
_HEAD = struct.Struct("<4sB3xI4x")
_ENTRY = struct.Struct("<H6xQ")
assert _HEAD.size == 16 and _ENTRY.size == 16
MAX_LAYERS = 1024  # far above any model's layer count; guards a corrupt count
LAYER_CODECS = ("raw", "int8", "fp8", "int4")
DEFAULT_MIN_TOKENS = 8192  # seed 000: mixed precision matters beyond 8 K tokens


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Keep ``raw_layers`` (negative = from the end) in raw once ``seq_tokens >= min_tokens``; ``base`` elsewhere."""

    raw_layers: tuple[int, ...] = (0, -1)
    min_tokens: int = DEFAULT_MIN_TOKENS
    base: str = "int8"

    def __post_init__(self) -> None:
        if self.base not in LAYER_CODECS:
            raise ValueError(f"mixed policy base {self.base!r} must be one of {LAYER_CODECS}")
        if self.min_tokens < 0:
            raise ValueError(f"mixed policy min_tokens {self.min_tokens} must be >= 0")
        if not all(isinstance(i, int) for i in self.raw_layers):
            raise ValueError(f"mixed policy raw_layers {self.raw_layers!r} must be ints")

    def layer_codecs(self, num_layers: int, seq_tokens: int) -> tuple[str, ...]:
        """The codec name of each layer for a sequence of ``seq_tokens`` tokens."""
        if not 1 <= num_layers <= MAX_LAYERS:
            raise ValueError(f"num_layers {num_layers} outside 1..{MAX_LAYERS}")
        bad = [i for i in self.raw_layers if not -num_layers <= i < num_layers]
        if bad:
            raise ValueError(f"mixed policy raw_layers {bad} out of range for {num_layers} layers")
        names = [self.base] * num_layers
        if seq_tokens >= self.min_tokens:
            for i in self.raw_layers:
                names[i % num_layers] = "raw"
        return tuple(names)


def _layer_codec(name: str, group_tokens: int | None) -> Any:
    if name == "raw":
        return RawCodec()
    return QuantCodec(name, DEFAULT_GROUP_TOKENS[name] if group_tokens is None else group_tokens)


@dataclass(frozen=True)
class MixedCodec:
    """``mixed``: per-layer codecs over axis 0 of a ``[layers, ..., tokens, head_dim]`` block."""

    policy: MixedPrecisionPolicy = MixedPrecisionPolicy()
    group_tokens: int | None = None
    name: ClassVar[str] = "mixed"
    takes_seq_tokens: ClassVar[bool] = True  # encode(x, seq_tokens=...): the policy's input

    @property
    def codec_id(self) -> int:
        return codec_ids.codec_id(self.name)

    def encode(self, x: Any, *, seq_tokens: int | None = None) -> bytes:
        """``seq_tokens``: the whole sequence's length (the policy's input); default: this block's tokens."""
        shape = tuple(int(n) for n in x.shape)
        if len(shape) < 3:
            raise ValueError(f"mixed codec needs [layers, ..., tokens, head_dim], got shape {shape}")
        names = self.policy.layer_codecs(shape[0], shape[-2] if seq_tokens is None else seq_tokens)
        bodies = [_layer_codec(n, self.group_tokens).encode(x[i]) for i, n in enumerate(names)]
        table = b"".join(_ENTRY.pack(codec_ids.codec_id(n), len(b)) for n, b in zip(names, bodies))
        return _HEAD.pack(MAGIC, VERSION, len(names)) + table + b"".join(bodies)

    def encoded_size_max(self, x: Any) -> int:
        """The largest payload of an array shaped like ``x``, over every sequence length."""
        shape = tuple(int(n) for n in x.shape)
        if len(shape) < 3:
            raise ValueError(f"mixed codec needs [layers, ..., tokens, head_dim], got shape {shape}")
        outcomes = {self.policy.layer_codecs(shape[0], seq) for seq in (0, self.policy.min_tokens)}
        per_layer = {n: _layer_codec(n, self.group_tokens).encoded_size(x[0]) for n in set().union(*outcomes)}
        body = max(sum(per_layer[n] for n in names) for names in outcomes)
        return _HEAD.size + shape[0] * _ENTRY.size + body

    def layer_payloads(self, data: bytes | memoryview) -> list[tuple[str, memoryview]]:
        """(codec name, payload) per layer; ValueError on a malformed payload."""
        mv = memoryview(data)
        if len(mv) < _HEAD.size:
            raise ValueError(f"mixed payload truncated: {len(mv)} bytes, header needs {_HEAD.size}")
        magic, version, layers = _HEAD.unpack_from(mv, 0)
        if magic != MAGIC:
            raise ValueError(f"not a mixed payload: magic {bytes(magic)!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise ValueError(f"mixed payload version {version} unsupported (expected {VERSION})")
        if not 1 <= layers <= MAX_LAYERS:
            raise ValueError(f"mixed payload layer count {layers} outside 1..{MAX_LAYERS}")
        pos = _HEAD.size + layers * _ENTRY.size
        if len(mv) < pos:
            raise ValueError(f"mixed payload truncated inside the layer table: {len(mv)} bytes")
        out = []
        for i in range(layers):
            cid, length = _ENTRY.unpack_from(mv, _HEAD.size + i * _ENTRY.size)
            name = codec_ids.codec_name(cid)
            if name not in LAYER_CODECS:
                raise ValueError(f"mixed payload layer {i} has codec {name!r}; allowed: {LAYER_CODECS}")
            if len(mv) < pos + length:
                raise ValueError(f"mixed payload truncated in layer {i}: {len(mv)} bytes, need {pos + length}")
            out.append((name, mv[pos:pos + length]))
            pos += length
        if pos != len(mv):
            raise ValueError(f"mixed payload has {len(mv) - pos} trailing bytes")
        return out

    def decode(self, data: bytes | memoryview, out: Any) -> Any:
        layers = self.layer_payloads(data)
        if len(out.shape) < 1 or int(out.shape[0]) != len(layers):
            raise ValueError(f"out shape {tuple(out.shape)} does not have {len(layers)} layers on axis 0")
        for i, (name, body) in enumerate(layers):
            _layer_codec(name, None).decode(body, out[i])
        return out
