"""Fused CPU kernels (numba) for the quantized codecs: the same bytes as quant_ref.py, one pass.

The NumPy reference makes several passes over a block (magnitude bits, group
max, widen, scale, round); these loops load each token group once into a small
fp32 scratch (cache-resident), find the per-channel absmax, then quantize it, as
the CUDA kernels do. Rounding is done without bit casts: fp16/bf16 inputs widen
through exact 65536-entry tables, and fp32 -> fp16/bf16/e4m3 rounds with
``frexp`` + ``rint`` (round half to even on an exactly scaled value), which is
IEEE round-to-nearest-even. Tests compare payloads with the reference byte for
byte. Used when numba imports; the NumPy reference runs otherwise.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

try:
    import numba
except ImportError:  # pragma: no cover - numba is optional
    numba = None

AVAILABLE = numba is not None
KIND_CODES = {"int8": 0, "fp8": 1, "int4": 2}
QMAX = np.array([127.0, 448.0, 7.0], np.float32)
NONFINITE = -1  # kernel result: the input has NaN or infinite values
F16_TABLE = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
E4M3_TABLE = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def _jit(fn):
    return numba.njit(cache=True, nogil=True)(fn) if AVAILABLE else fn


@_jit
def round_to_bits(v, mant_bits, bias, max_exp_field, sign):
    """RNE of a finite float to a binary format with ``mant_bits`` stored bits; its bit pattern.

    Normal range: frexp gives v = m * 2**e, m in [0.5, 1); m * 2**(mant_bits+1)
    is exact and rint rounds it half-even. Subnormals: rint(|v| / smallest step).
    Overflow gives the all-ones exponent (inf).
    """
    a = abs(np.float64(v))
    neg = v < 0
    min_normal_exp = 1 - bias  # exponent of the smallest normal, 2**(1-bias)
    if a == 0.0:
        return sign if neg else 0
    m, e = math.frexp(a)  # a = m * 2**e
    if e - 1 < min_normal_exp:
        code = int(np.rint(a * math.ldexp(1.0, bias - 1 + mant_bits)))  # step 2**(1-bias-mant_bits)
    else:
        r = int(np.rint(m * (1 << (mant_bits + 1))))
        if r == 1 << (mant_bits + 1):
            r = 1 << mant_bits
            e += 1
        exp_field = e - 1 + bias
        if exp_field >= max_exp_field:
            code = max_exp_field << mant_bits
        else:
            code = (exp_field << mant_bits) | (r - (1 << mant_bits))
    return (code | sign) if neg else code


@_jit
def to_f16_bits(v):
    return round_to_bits(v, 10, 15, 31, 0x8000)


@_jit
def to_bf16_bits(v):
    return round_to_bits(v, 7, 127, 255, 0x8000)


@_jit
def to_e4m3_bits(v):
    """e4m3fn for |v| <= 448 (the codec never exceeds it; 0x7F is NaN in e4m3fn)."""
    return round_to_bits(v, 3, 7, 16, 0x80)


RND = np.float32(12582912.0)  # 1.5 * 2**23: (v + RND) - RND is rint(v), half-even, for |v| < 2**22


@_jit
def rint32(v):
    return (v + RND) - RND


@_jit
def e4m3_row(vals, bits, out, base):
    """out[base + d] = e4m3 bits of vals[d] (|vals| <= 448); ``bits`` is the uint32 view of ``vals``."""
    for d in range(vals.shape[0]):
        u = bits[d]
        mag = u & np.uint32(0x7FFFFFFF)
        a = abs(vals[d])
        sub = np.uint32(rint32(a * np.float32(512.0)))
        nor = ((mag + np.uint32(0x7FFFF) + ((mag >> np.uint32(20)) & np.uint32(1))) >> np.uint32(20)) - np.uint32(960)
        code = sub if a < np.float32(0.015625) else nor
        out[base + d] = np.uint8(code | ((u >> np.uint32(24)) & np.uint32(0x80)))


@_jit
def f16_row(vals, bits, out):
    """out[d] = fp16 bits of vals[d], RNE (as cvt.rn.f16.f32; overflow -> inf)."""
    for d in range(vals.shape[0]):
        u = bits[d]
        a = u & np.uint32(0x7FFFFFFF)
        sub = np.uint32(rint32(abs(vals[d]) * np.float32(16777216.0)))
        a2 = a - np.uint32(0x38000000)
        nor = (a2 + np.uint32(0xFFF) + ((a2 >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13)
        code = sub if a < np.uint32(0x38800000) else nor
        code = np.uint32(0x7C00) if a >= np.uint32(0x47800000) else code
        out[d] = np.uint16(code | ((u >> np.uint32(16)) & np.uint32(0x8000)))


@_jit
def bf16_row(bits, out):
    for d in range(bits.shape[0]):
        u = bits[d]
        out[d] = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@_jit
def _quant_group(buf, n, kind, qmax, scale16, f16_table, r, gi, t0, scales16, scales32, q, amax, inv, row):
    """Scales and values of one token group held in buf[:n, :] (fp32)."""
    d_total = buf.shape[1]
    amax[:] = 0
    for t in range(n):
        bt = buf[t]
        for d in range(d_total):
            amax[d] = np.maximum(amax[d], abs(bt[d]))  # propagates NaN
    for d in range(d_total):
        a = amax[d]
        if not np.isfinite(a):
            return NONFINITE
        s = np.float32(a / qmax)
        if scale16:
            h = to_f16_bits(s)
            if np.float64(f16_table[h]) * np.float64(qmax) < np.float64(a):
                h += 1
            scales16[r, gi, d] = h
            s = f16_table[h]
        else:
            if np.float64(s) * np.float64(qmax) < np.float64(a):
                s = np.nextafter(s, np.float32(np.inf))
            scales32[r, gi, d] = s
        inv[d] = np.float32(1.0) / s if s != np.float32(0.0) else np.float32(0.0)
    row_bits = row.view(np.uint32)
    for t in range(n):
        bt = buf[t]
        qt = q[r, t0 + t]
        if kind == 2:
            for p in range(d_total // 2):
                lo = np.int32(rint32(bt[2 * p] * inv[2 * p]))
                hi = np.int32(rint32(bt[2 * p + 1] * inv[2 * p + 1]))
                qt[p] = np.uint8((lo & 0x0F) | ((hi & 0x0F) << 4))
        elif kind == 1:
            for d in range(d_total):
                row[d] = bt[d] * inv[d]
            e4m3_row(row, row_bits, qt, 0)
        else:
            for d in range(d_total):
                qt[d] = np.uint8(np.int32(rint32(bt[d] * inv[d])) & 0xFF)
    return 0


@_jit
def quantize16(xbits, is_bf16, kind, g, scale16, f16_table, scales16, scales32, q):
    """fp16/bf16 input as uint16 bits [B, T, D], widened exactly with bit operations."""
    b_total, t_total, d_total = xbits.shape
    qmax = QMAX[kind]
    buf = np.empty((g, d_total), np.float32)
    bufu = buf.view(np.uint32)
    amax, inv, row = np.empty(d_total, np.float32), np.empty(d_total, np.float32), np.empty(d_total, np.float32)
    for r in range(b_total):
        for gi in range((t_total + g - 1) // g):
            t0 = gi * g
            n = min(t_total, t0 + g) - t0
            for t in range(n):
                xr = xbits[r, t0 + t]
                bu = bufu[t]
                if is_bf16:
                    for d in range(d_total):
                        bu[d] = np.uint32(xr[d]) << np.uint32(16)
                else:
                    bf = buf[t]
                    special = np.uint32(0)  # becomes 1 if an exponent is all ones (inf/NaN)
                    for d in range(d_total):
                        h = np.uint32(xr[d])
                        special |= ((h & np.uint32(0x7C00)) + np.uint32(0x400)) >> np.uint32(15)
                        bu[d] = ((h & np.uint32(0x7FFF)) << np.uint32(13)) | ((h & np.uint32(0x8000)) << np.uint32(16))
                    if special:
                        return NONFINITE
                    for d in range(d_total):  # exact: a power-of-two scaling of an fp16 value
                        bf[d] *= np.float32(5.192296858534828e33)  # 2**112
            if _quant_group(buf, n, kind, qmax, scale16, f16_table, r, gi, t0, scales16, scales32, q,
                            amax, inv, row) < 0:
                return NONFINITE
    return 0


@_jit
def quantize32(x, kind, g, f16_table, scales16, scales32, q):
    """fp32 input [B, T, D] (fp32 scales)."""
    b_total, t_total, d_total = x.shape
    qmax = QMAX[kind]
    buf = np.empty((g, d_total), np.float32)
    amax, inv, row = np.empty(d_total, np.float32), np.empty(d_total, np.float32), np.empty(d_total, np.float32)
    for r in range(b_total):
        for gi in range((t_total + g - 1) // g):
            t0 = gi * g
            n = min(t_total, t0 + g) - t0
            for t in range(n):
                buf[t, :] = x[r, t0 + t]
            if _quant_group(buf, n, kind, qmax, False, f16_table, r, gi, t0, scales16, scales32, q,
                            amax, inv, row) < 0:
                return NONFINITE
    return 0


@_jit
def dequantize(q, kind, g, scale16, f16_table, e4m3_table, scales16, scales32, out_kind, out16, out32):
    """q and scales -> out (out_kind 0: fp16 bits in out16, 1: bf16 bits in out16, 2: fp32 in out32)."""
    b_total, t_total, d_total = (out32.shape if out_kind == 2 else out16.shape)
    ys = np.empty(d_total, np.float32)
    ss = np.empty(d_total, np.float32)
    ybits = ys.view(np.uint32)
    for r in range(b_total):
        for t in range(t_total):
            gi = t // g
            if t % g == 0 or t == 0:
                for d in range(d_total):
                    ss[d] = f16_table[scales16[r, gi, d]] if scale16 else scales32[r, gi, d]
            qt = q[r, t]
            if kind == 2:
                for p in range(d_total // 2):
                    byte = np.int32(qt[p])
                    lo = byte & 0x0F
                    hi = (byte >> 4) & 0x0F
                    ys[2 * p] = np.float32(lo - 16 if lo >= 8 else lo) * ss[2 * p]
                    ys[2 * p + 1] = np.float32(hi - 16 if hi >= 8 else hi) * ss[2 * p + 1]
            elif kind == 1:
                for d in range(d_total):
                    ys[d] = e4m3_table[qt[d]] * ss[d]
            else:
                for d in range(d_total):
                    byte = np.int32(qt[d])
                    ys[d] = np.float32(byte - 256 if byte >= 128 else byte) * ss[d]
            if out_kind == 0:
                f16_row(ys, ybits, out16[r, t])
            elif out_kind == 1:
                bf16_row(ybits, out16[r, t])
            else:
                out32[r, t, :] = ys


_EMPTY16 = np.empty((1, 1, 1), np.uint16)
_EMPTY32 = np.empty((1, 1, 1), np.float32)


def _scale_arrays(scales: np.ndarray) -> tuple[bool, np.ndarray, np.ndarray]:
    if scales.dtype == np.float16:
        return True, scales.view(np.uint16), _EMPTY32
    return False, _EMPTY16, scales


def quantize_into(x: np.ndarray, kind_name: str, g: int, scales: np.ndarray, q: np.ndarray) -> None:
    """Drop-in for quant_ref.quantize_into (x C-contiguous [B, T, D])."""
    scale16, s16, s32 = _scale_arrays(scales)
    kind = KIND_CODES[kind_name]
    if x.dtype.itemsize == 2:
        rc = quantize16(x.view(np.uint16), x.dtype != np.float16, kind, g, scale16, F16_TABLE, s16, s32,
                        q.view(np.uint8))
    else:
        rc = quantize32(x, kind, g, F16_TABLE, s16, s32, q.view(np.uint8))
    if rc == NONFINITE:
        raise ValueError("input has NaN or infinite values; quantized codecs need finite data")


def dequantize_into(q: np.ndarray, kind_name: str, g: int, scales: np.ndarray, out: np.ndarray) -> None:
    """Drop-in for quant_ref.dequantize_into (out C-contiguous [B, T, D])."""
    scale16, s16, s32 = _scale_arrays(scales)
    if out.dtype == np.float32:
        out_kind, o16, o32 = 2, _EMPTY16, out
    else:
        out_kind, o16, o32 = (0 if out.dtype == np.float16 else 1), out.view(np.uint16), _EMPTY32
    dequantize(q.view(np.uint8), KIND_CODES[kind_name], g, scale16, F16_TABLE, E4M3_TABLE, s16, s32,
               out_kind, o16, o32)
