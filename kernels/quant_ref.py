"""NumPy reference of the quantized codecs: this file *is* the byte format.

Scheme (KIVI-style, chosen to survive outlier channels)::

    x : [B, T, D]  (B = product of leading axes, T tokens, D head_dim)
    groups of G tokens along T (the last group may be shorter)
    scale[b, g, d] = absmax(x[b, g*G:(g+1)*G, d]) / QMAX      (per channel, per token group)
    q[b, t, d]     = quantize(x[b, t, d] * (1 / scale[b, t // G, d]))   (|.| <= QMAX, no clip)
    x'[b, t, d]    = dequantize(q[b, t, d]) * scale[b, t // G, d]

A channel that is 20x the others gets its own scale, so it wastes no range of
the others (per-token scales would). The scale is stored (fp16 for fp16 input,
fp32 for bf16/fp32 input, whose range fp16 cannot hold) rounded *up* to the
smallest value with scale * QMAX >= absmax, and quantizing uses that stored
number, so encoder and decoder agree and |x / scale| never exceeds QMAX. An fp32 scale
is at least SCALE_F32_MIN (2**-126, unless it is 0), so its inverse is finite; a channel
below QMAX * 2**-126 is then off by less than 2**-127. Decoded values are clamped to the
output dtype's finite range: a scale rounded up can put QMAX * scale just past it (fp16
65504), and the input was finite. All arithmetic
is fp32 with IEEE rounding (division, multiply, round-half-even), which is what
makes the CuPy kernels byte-identical to this file.

    kind   QMAX  stored value                       bytes per value
    int8   127   rint (half-even), int8             1
    fp8    448   e4m3fn (RNE)                       1
    int4   7     rint (half-even), two's-complement nibbles,
                 even channel in the low nibble     1/2

Payload sections after the header: scales ``[B, ceil(T/G), D]``, then the
quantized values ``[B, T, D]`` (``[B, T, D/2]`` bytes for int4).
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .arrays import FP16, FP32
from .hostcast import narrow, widen

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
SCALE_F32_MIN = np.float32(np.finfo(np.float32).tiny)  # 2**-126: 1 / scale stays finite (2**126)
Q_STORED_MAX = {"int8": 128.0, "fp8": 448.0, "int4": 8.0}  # the largest |q| a payload's bytes can hold
CHUNK_ELEMENTS = 1 << 16  # per pass: the fp32 scratch (256 KiB) stays in a 512 KiB L2


@dataclass(frozen=True)
class QuantKind:
    name: str
    qmax: float
    values_per_byte: int  # 1, or 2 for packed int4


QUANT_KINDS: dict[str, QuantKind] = {
    "int8": QuantKind("int8", 127.0, 1),
    "fp8": QuantKind("fp8", 448.0, 1),
    "int4": QuantKind("int4", 7.0, 2),
}


def scale_dtype_for(dtype: np.dtype) -> np.dtype:
    """fp16 scales for fp16 data; fp32 for bf16/fp32 data (fp16 cannot hold their range)."""
    return FP16 if np.dtype(dtype) == FP16 else FP32


def num_groups(tokens: int, group_tokens: int) -> int:
    return -(-tokens // group_tokens)


def section_sizes(kind: QuantKind, b: int, t: int, d: int, group_tokens: int,
                  scale_dtype: np.dtype) -> tuple[int, int]:
    """(scale bytes, value bytes) of one payload."""
    scales = b * num_groups(t, group_tokens) * d * np.dtype(scale_dtype).itemsize
    return scales, b * t * d // kind.values_per_byte


def _group_views(a: np.ndarray, g: int) -> list[tuple[np.ndarray, slice]]:
    """Views of a [b, T, ...] array as [b, groups, g, ...] blocks, plus the group slice each covers."""
    b, t = a.shape[:2]
    full = t // g
    views = []
    if full:
        views.append((a[:, : full * g].reshape(b, full, g, *a.shape[2:]), slice(0, full)))
    if t % g:
        views.append((a[:, full * g:].reshape(b, 1, t % g, *a.shape[2:]), slice(full, full + 1)))
    return views


def _absmax_groups(x: np.ndarray, g: int) -> np.ndarray:
    """absmax over token groups, [b, T, D] -> [b, ng, D] fp32, via the sign-cleared bits.

    Positive IEEE floats order like their bit patterns, so the max of the
    magnitude bits is the absmax (and NaN/inf show up as non-finite).
    Runs in cache-sized chunks.
    """
    b_total, t, d = x.shape
    uint = np.uint16 if x.dtype.itemsize == 2 else np.uint32
    mask = uint(0x7FFF if x.dtype.itemsize == 2 else 0x7FFFFFFF)
    xbits = x.view(uint)
    out = np.empty((b_total, num_groups(t, g), d), uint)
    bits = _scratch(b_total, t, d, g, uint)
    for rs, ts, gs in _chunks(b_total, t, d, g):
        xc = xbits[rs, ts]
        bc = bits[: xc.shape[0], : xc.shape[1]]
        np.bitwise_and(xc, mask, out=bc)
        oc = out[rs, gs]
        for view, vgs in _group_views(bc, g):
            np.max(view, axis=2, out=oc[:, vgs])
    return _to_f32(out.view(x.dtype))


def _to_f32(a: np.ndarray) -> np.ndarray:
    """A new C-contiguous fp32 copy (fast fp16 path; NumPy's own fp16 cast is a scalar loop)."""
    out = np.empty(a.shape, FP32)
    widen(np.ascontiguousarray(a), out)
    return out


def scales_from_absmax(absmax: np.ndarray, qmax: float, scale_dtype: np.dtype) -> np.ndarray:
    """The smallest stored-dtype scale s with s * qmax >= absmax (RNE, then one step up if it fell short).

    Rounding the scale up means |x| / s <= qmax, so quantized values never
    overflow and need no clip. The check runs in float64, where s * qmax is exact.
    """
    if not np.isfinite(absmax).all():
        raise ValueError("input has NaN or infinite values; quantized codecs need finite data")
    s = np.empty(absmax.shape, scale_dtype)
    narrow(absmax / np.float32(qmax), s)
    short = _to_f32(s).astype(np.float64) * qmax < absmax.astype(np.float64)
    if short.any():
        uint = np.uint16 if np.dtype(scale_dtype).itemsize == 2 else np.uint32
        s.view(uint)[short] += uint(1)  # next larger positive float
    if np.dtype(scale_dtype) == FP32:
        s[(s != 0) & (s < SCALE_F32_MIN)] = SCALE_F32_MIN
    return s


def finite_max(dtype: np.dtype) -> np.float32:
    """The largest finite value of a KV dtype, as fp32 (exact for fp16, bf16 and fp32)."""
    return np.float32(ml_dtypes.finfo(dtype).max)


def _inverse(scales: np.ndarray) -> np.ndarray:
    s32 = _to_f32(scales)
    inv = np.zeros_like(s32)
    np.divide(np.float32(1.0), s32, out=inv, where=s32 != 0)
    return inv


def _chunks(b: int, t: int, d: int, g: int):
    """(rows, tokens, groups) slices covering [b, t, d] in pieces of about CHUNK_ELEMENTS.

    Whole rows when a row is small; otherwise one row at a time, cut at group boundaries.
    """
    if t * d <= CHUNK_ELEMENTS:
        rows = CHUNK_ELEMENTS // (t * d)
        for r0 in range(0, b, rows):
            yield slice(r0, min(b, r0 + rows)), slice(0, t), slice(0, num_groups(t, g))
        return
    tokens = g * max(1, CHUNK_ELEMENTS // (g * d))
    for r0 in range(b):
        for t0 in range(0, t, tokens):
            t1 = min(t, t0 + tokens)
            yield slice(r0, r0 + 1), slice(t0, t1), slice(t0 // g, num_groups(t1, g))


def _scratch(b: int, t: int, d: int, g: int, dtype) -> np.ndarray:
    if t * d <= CHUNK_ELEMENTS:
        return np.empty((min(b, CHUNK_ELEMENTS // (t * d)), t, d), dtype)
    return np.empty((1, min(t, g * max(1, CHUNK_ELEMENTS // (g * d))), d), dtype)


def quantize_into(x: np.ndarray, kind: QuantKind, g: int, scales: np.ndarray, q: np.ndarray) -> None:
    """x [B, T, D] -> scales [B, ng, D] and q (int8 | e4m3 bits | packed int4 bytes).

    Pass 1 finds all scales at once (vectorized over the block); pass 2 quantizes
    in cache-sized chunks.
    """
    b_total, t, d = x.shape
    scales[...] = scales_from_absmax(_absmax_groups(x, g), kind.qmax, scales.dtype)
    inv_all = _inverse(scales)
    buf = _scratch(b_total, t, d, g, FP32)
    small = _scratch(b_total, t, d, g, np.int8) if kind.name == "int4" else None
    for rs, ts, gs in _chunks(b_total, t, d, g):
        xc = x[rs, ts]
        n, tn = xc.shape[:2]
        inv = inv_all[rs, gs]
        xf = buf[:n, :tn]
        widen(xc, xf)
        for view, vgs in _group_views(xf, g):
            np.multiply(view, inv[:, vgs, None, :], out=view)
        qc = q[rs, ts]
        if kind.name == "fp8":
            np.copyto(qc.view(E4M3), xf, casting="unsafe")
            continue
        np.rint(xf, out=xf)
        if kind.name == "int8":
            np.copyto(qc, xf, casting="unsafe")  # integral values within +-QMAX: the cast is exact
            continue
        s8 = small[:n, :tn]
        np.copyto(s8, xf, casting="unsafe")
        lo = np.bitwise_and(s8[..., 0::2], np.int8(0x0F))
        hi = np.left_shift(s8[..., 1::2], np.int8(4))
        np.bitwise_or(lo, hi, out=qc.view(np.int8))


def dequantize_into(q: np.ndarray, kind: QuantKind, g: int, scales: np.ndarray, out: np.ndarray) -> None:
    """Inverse of :func:`quantize_into`; writes into ``out`` [B, T, D] (C-contiguous)."""
    b_total, t, d = out.shape
    s32 = _to_f32(scales)
    fmax = finite_max(out.dtype)
    # |q| <= the largest a payload can hold (128, 448, 8) and rounding is monotonic: only a scale with
    # that times the scale past fmax can decode past it
    clamp = bool((np.float32(Q_STORED_MAX[kind.name]) * np.abs(s32) > fmax).any())
    buf = _scratch(b_total, t, d, g, FP32)
    for rs, ts, gs in _chunks(b_total, t, d, g):
        qc = q[rs, ts]
        n, tn = qc.shape[:2]
        xf = buf[:n, :tn]
        if kind.name == "int8":
            np.copyto(xf, qc, casting="unsafe")
        elif kind.name == "fp8":
            np.copyto(xf, qc.view(E4M3), casting="unsafe")
        else:
            packed = qc.view(np.int8)
            np.right_shift(np.left_shift(packed, np.int8(4)), np.int8(4), out=xf[..., 0::2], casting="unsafe")
            np.right_shift(packed, np.int8(4), out=xf[..., 1::2], casting="unsafe")
        sc = s32[rs, gs]
        for view, vgs in _group_views(xf, g):
            np.multiply(view, sc[:, vgs, None, :], out=view)
        if clamp:
            np.clip(xf, -fmax, fmax, out=xf)
        narrow(xf, out[rs, ts])


def fp8_e4m3_bits_reference(x: np.ndarray) -> np.ndarray:
    """Bit-level float32 -> e4m3fn (RNE) on values already clipped to [-448, 448].

    A NumPy port of the CUDA device function ``f32_to_e4m3`` (cuda_sources.py),
    tested against ml_dtypes so that the kernel's algorithm is checked on a CPU.
    """
    u = np.ascontiguousarray(x, FP32).view(np.uint32)
    sign = ((u >> 24) & 0x80).astype(np.uint8)
    mag = u & np.uint32(0x7FFFFFFF)
    a = mag.view(FP32)
    sub = np.rint(a * np.float32(512.0)).astype(np.uint32)  # e4m3 subnormal step is 2**-9
    rounded = (mag + np.uint32(0x7FFFF) + ((mag >> 20) & 1)) >> 20
    normal = rounded - np.uint32(120 << 3)  # rebias the exponent 127 -> 7
    code = np.where(a < np.float32(2.0 ** -6), sub, normal)
    return (code.astype(np.uint8) | sign).astype(np.uint8)


__all__ = ["E4M3", "QUANT_KINDS", "QuantKind", "dequantize_into", "quantize_into"]
