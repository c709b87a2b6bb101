"""Base codecs: ``raw``, ``int8``, ``fp8``, ``int4`` (one byte format, host or device).

``encode(x) -> bytes`` takes a KV block shaped ``[..., tokens, head_dim]``
(fp16, bf16 or fp32; NumPy, torch CPU/CUDA or CuPy) and returns the codec
payload (header, see payload.py, then sections). ``decode(data, out) -> out``
fills a caller-provided C-contiguous array of the original dtype and shape.
Host arrays run the NumPy reference (quant_ref.py); device arrays run the CuPy
kernels (quant_cupy.py), which produce the same bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from kvtier.common import codec_ids

from . import quant_numba
from .arrays import DTYPES_BY_CODE, dtype_code, host_view, is_device_array
from .payload import PayloadHeader, unpack_header
from .quant_ref import (QUANT_KINDS, QuantKind, dequantize_into, num_groups, quantize_into, scale_dtype_for,
                        section_sizes)

@dataclass
class HostBackend:
    """Which CPU implementation runs: the fused numba loops when numba imports, else the NumPy reference.

    Both write the same bytes (tests/test_codecs.py checks them against each other).
    ``HOST_BACKEND.fused = False`` forces the reference.
    """

    fused: bool = quant_numba.AVAILABLE


HOST_BACKEND = HostBackend()

DEFAULT_GROUP_TOKENS = {"int8": 64, "fp8": 64, "int4": 32}  # 2-byte scales cost 3 % (int8) / 6 % (int4) of the values
MAX_GROUP_TOKENS = 1 << 16  # a group longer than any stored block is a caller mistake


def check_block_shape(shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(shape) < 2:
        raise ValueError(f"KV block must be shaped [..., tokens, head_dim], got shape {shape}")
    if 0 in shape:
        raise ValueError(f"KV block shape {shape} has no elements")
    b = int(np.prod(shape[:-2], dtype=np.int64))
    return b, int(shape[-2]), int(shape[-1])


def check_out(header: PayloadHeader, out_dtype: np.dtype, out_shape: tuple[int, ...]) -> None:
    """ValueError naming the mismatch between a payload and the caller's ``out``."""
    want = DTYPES_BY_CODE.get(header.dtype_code)
    if want is None:
        raise ValueError(f"codec payload has unknown dtype code {header.dtype_code}")
    if np.dtype(out_dtype) != want:
        raise ValueError(f"out dtype {np.dtype(out_dtype)} does not match the encoded dtype {want}")
    if tuple(out_shape) != header.shape:
        raise ValueError(f"out shape {tuple(out_shape)} does not match the encoded shape {header.shape}")


def check_length(data_len: int, expected: int, name: str) -> None:
    if data_len < expected:
        raise ValueError(f"{name} payload truncated: {data_len} bytes, expected {expected}")
    if data_len > expected:
        raise ValueError(f"{name} payload has {data_len - expected} trailing bytes (expected {expected})")


def _writable(buf: bytearray | memoryview, size: int) -> memoryview:
    """The first ``size`` bytes of a caller's output buffer; ValueError if it is too small or read-only."""
    mv = memoryview(buf).cast("B")
    if mv.readonly:
        raise ValueError("output buffer is read-only")
    if len(mv) < size:
        raise ValueError(f"output buffer has {len(mv)} bytes, the payload needs {size}")
    return mv[:size]


def _host_out(out: Any) -> np.ndarray:
    arr = host_view(out)
    if not arr.flags.c_contiguous:
        raise ValueError("out must be C-contiguous")
    if not arr.flags.writeable:
        raise ValueError("out is read-only")
    return arr


@dataclass(frozen=True)
class RawCodec:
    """The array's own bytes after the payload header."""

    name: ClassVar[str] = "raw"

    @property
    def codec_id(self) -> int:
        return codec_ids.codec_id(self.name)

    def encode(self, x: Any) -> bytes:
        if is_device_array(x):
            from .quant_cupy import encode_raw_device

            return encode_raw_device(x)
        buf = bytearray(self.encoded_size(x))
        self.encode_into(x, buf)
        return bytes(buf)

    def encoded_size(self, x: Any) -> int:
        arr = host_view(x)
        check_block_shape(arr.shape)
        return PayloadHeader(1, dtype_code(arr.dtype), arr.shape).size_bytes + arr.nbytes

    def payload_header(self, shape: tuple[int, ...], dtype: np.dtype) -> bytes:
        """The codec header of a raw payload; the array's C-order bytes follow it, so a
        caller may gather an array straight into place after it."""
        check_block_shape(tuple(shape))
        return PayloadHeader(codec_ids.BASE_CODEC_IDS["raw"], dtype_code(dtype), tuple(shape)).pack()

    def encode_into(self, x: Any, buf: bytearray | memoryview) -> int:
        """Encode a host array into ``buf`` (reusable, at least ``encoded_size(x)`` bytes); returns the size."""
        arr = host_view(x)
        header = self.payload_header(arr.shape, arr.dtype)
        total = len(header) + arr.nbytes
        mv = _writable(buf, total)
        mv[: len(header)] = header
        np.copyto(np.frombuffer(mv, arr.dtype, arr.size, len(header)).reshape(arr.shape), arr)
        return total

    def decode(self, data: bytes | memoryview, out: Any) -> Any:
        header = self.parse(data)
        if is_device_array(out):
            from .quant_cupy import decode_raw_device

            return decode_raw_device(header, data, out)
        arr = host_view(out)  # any strides: a raw payload is copied straight into place
        if not arr.flags.writeable:
            raise ValueError("out is read-only")
        check_out(header, arr.dtype, arr.shape)
        check_length(len(data), header.size_bytes + arr.nbytes, self.name)
        np.copyto(arr, np.frombuffer(data, arr.dtype, arr.size, header.size_bytes).reshape(arr.shape))
        return out

    def parse(self, data: bytes | memoryview) -> PayloadHeader:
        header = unpack_header(data)
        if header.base_codec_id != codec_ids.BASE_CODEC_IDS["raw"]:
            raise ValueError(f"payload is codec id {header.base_codec_id}, not {self.name}")
        return header


@dataclass(frozen=True)
class QuantLayout:
    """Where a quantized payload's sections lie."""

    header: PayloadHeader
    b: int
    t: int
    d: int
    scale_dtype: np.dtype
    scale_bytes: int
    value_bytes: int
    value_dtype: np.dtype  # int8 for int8; uint8 bits for fp8 and packed int4

    @property
    def total_bytes(self) -> int:
        return self.header.size_bytes + self.scale_bytes + self.value_bytes

    def views(self, buf: Any) -> tuple[np.ndarray, np.ndarray]:
        """(scales [b, ng, d], values [b, t, d or d/2]) views over a payload buffer."""
        ng = num_groups(self.t, self.header.group_tokens)
        off = self.header.size_bytes
        scales = np.frombuffer(buf, self.scale_dtype, self.b * ng * self.d, off).reshape(self.b, ng, self.d)
        values = np.frombuffer(buf, self.value_dtype, self.value_bytes, off + self.scale_bytes)
        return scales, values.reshape(self.b, self.t, -1)


@dataclass(frozen=True)
class QuantCodec:
    """``int8`` / ``fp8`` / ``int4``: symmetric, per-channel scales over groups of ``group_tokens`` tokens.

    Scheme (KIVI-like; quant_ref.py has the exact byte layout): a block
    ``[..., T, D]`` is seen as ``[B, T, D]``; each channel ``d`` of each group
    of ``group_tokens`` consecutive tokens gets one scale, the smallest stored
    value (fp16 for fp16 data, fp32 for bf16/fp32, at least 2**-126) with ``scale * QMAX >= absmax``;
    values are ``x / scale`` rounded half-even to int8 (QMAX 127), int4 (7, two
    per byte) or e4m3 (448). Per-channel scales keep outlier channels (10-20x
    the others, common in keys) from flattening the rest; token groups bound the
    damage of outlier tokens (attention sinks).
    """

    name: str
    group_tokens: int

    def __post_init__(self) -> None:
        if self.name not in QUANT_KINDS:
            raise ValueError(f"unknown quantized codec {self.name!r}; known: {sorted(QUANT_KINDS)}")
        if not 1 <= self.group_tokens <= MAX_GROUP_TOKENS:
            raise ValueError(f"group_tokens {self.group_tokens} outside 1..{MAX_GROUP_TOKENS}")

    @property
    def codec_id(self) -> int:
        return codec_ids.codec_id(self.name)

    @property
    def kind(self) -> QuantKind:
        return QUANT_KINDS[self.name]

    def layout(self, shape: tuple[int, ...], dtype: np.dtype, group_tokens: int | None = None) -> QuantLayout:
        b, t, d = check_block_shape(shape)
        if self.kind.values_per_byte == 2 and d % 2:
            raise ValueError(f"int4 packs channel pairs: head_dim {d} must be even")
        g = self.group_tokens if group_tokens is None else group_tokens
        sdt = scale_dtype_for(dtype)
        header = PayloadHeader(codec_ids.BASE_CODEC_IDS[self.name], dtype_code(dtype), tuple(shape), g,
                               dtype_code(sdt))
        sb, vb = section_sizes(self.kind, b, t, d, g, sdt)
        vdt = np.dtype(np.int8 if self.name == "int8" else np.uint8)
        return QuantLayout(header, b, t, d, np.dtype(sdt), sb, vb, vdt)

    def encode(self, x: Any) -> bytes:
        if is_device_array(x):
            from .quant_cupy import encode_quant_device

            return encode_quant_device(self, x)
        buf = bytearray(self.encoded_size(x))
        self.encode_into(x, buf)
        return bytes(buf)

    def encoded_size(self, x: Any) -> int:
        arr = host_view(x)
        return self.layout(arr.shape, arr.dtype).total_bytes

    def encode_into(self, x: Any, buf: bytearray | memoryview) -> int:
        """Encode a host array into ``buf`` (reusable, at least ``encoded_size(x)`` bytes); returns the size."""
        arr = np.ascontiguousarray(host_view(x))
        lay = self.layout(arr.shape, arr.dtype)
        mv = _writable(buf, lay.total_bytes)
        mv[: lay.header.size_bytes] = lay.header.pack()
        scales, values = lay.views(mv)
        x3 = arr.reshape(lay.b, lay.t, lay.d)
        if HOST_BACKEND.fused:
            quant_numba.quantize_into(x3, self.name, self.group_tokens, scales, values)
        else:
            quantize_into(x3, self.kind, self.group_tokens, scales, values)
        return lay.total_bytes

    def parse(self, data: bytes | memoryview) -> QuantLayout:
        """Header checks shared by the host and device decoders."""
        header = unpack_header(data)
        if header.base_codec_id != codec_ids.BASE_CODEC_IDS[self.name]:
            raise ValueError(f"payload is codec id {header.base_codec_id}, not {self.name}")
        dtype = DTYPES_BY_CODE.get(header.dtype_code)
        if dtype is None:
            raise ValueError(f"codec payload has unknown dtype code {header.dtype_code}")
        if not 1 <= header.group_tokens <= MAX_GROUP_TOKENS:
            raise ValueError(f"codec payload group_tokens {header.group_tokens} outside 1..{MAX_GROUP_TOKENS}")
        lay = self.layout(header.shape, dtype, header.group_tokens)
        if header.scale_dtype_code != lay.header.scale_dtype_code:
            raise ValueError(f"codec payload scale dtype code {header.scale_dtype_code} is not "
                             f"{lay.header.scale_dtype_code} for {dtype}")
        check_length(len(data), lay.total_bytes, self.name)
        return lay

    def decode(self, data: bytes | memoryview, out: Any) -> Any:
        lay = self.parse(data)
        if is_device_array(out):
            from .quant_cupy import decode_quant_device

            return decode_quant_device(self, lay, data, out)
        arr = _host_out(out)
        check_out(lay.header, arr.dtype, arr.shape)
        scales, values = lay.views(data)
        out3 = arr.reshape(lay.b, lay.t, lay.d)
        if HOST_BACKEND.fused:
            quant_numba.dequantize_into(values, self.name, lay.header.group_tokens, scales, out3)
        else:
            dequantize_into(values, self.kind, lay.header.group_tokens, scales, out3)
        return out
