"""Fused CPU kernels (numba) for the quantized codecs: the same bytes as quant_ref.py, fewer passes.

The NumPy reference makes several passes over a block (magnitude bits, group
max, widen, scale, round). Here each token group is read from memory once: a
first loop takes the per-channel absmax as an integer max over the sign-cleared
bits (as the reference does), then the group, now in L1/L2, is widened, scaled,
rounded and stored row by row. Every inner loop runs over the contiguous channel
axis without branches, so LLVM vectorizes it (8 lanes with AVX2), the per-group
scale computation included.

Exactness. The float arithmetic is the reference's: fp32 IEEE, multiplication
by the stored inverse scale, division only where the reference divides (the
scale and its inverse), in the same order, and no ``fastmath`` (it would allow
fused multiply-adds and other rewrites that change rounding). Conversions are
exact or round to nearest even, as the reference's are:

* fp16 <-> fp32: the CPU's F16C instructions (vcvtph2ps / vcvtps2ph, exact
  and RNE) when numba compiles for a CPU that has them (``F16C``); otherwise
  bit operations (fp16 bits << 13 read as fp32, times 2**112, is exact;
  fp32 -> fp16 rounds the bits to nearest even);
* bf16 <-> fp32 and fp32 -> e4m3: RNE on the IEEE bits; e4m3 -> fp32 exact;
* rint (half-even) of |v| < 2**22 is ``v + 1.5 * 2**23``, whose low mantissa
  bits are the two's-complement integer (int8: low 8 bits, int4: low 4).

Integer bit operations are kept to 32 bits (numba widens integer arithmetic
to 64 bits, which halves the SIMD width; ``U()`` truncates back). Tests
compare payloads and decoded arrays with the reference byte for byte, on the
F16C path and (in a subprocess compiled for a generic CPU) on the bit path.

Used when numba imports, compiled once and cached on disk (``cache=True``);
the NumPy reference runs otherwise. Single-threaded: a call runs on the
calling thread (``nogil``, so callers may encode several blocks on several
threads at once).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

try:
    import numba
    from llvmlite import ir as _ir
    from numba.core import codegen as _codegen
    from numba.core import config as _config
    from numba.core import types as _types
    from numba.extending import intrinsic as _intrinsic
except ImportError:  # pragma: no cover - numba is optional
    numba = None

AVAILABLE = numba is not None
KIND_CODES = {"int8": 0, "fp8": 1, "int4": 2}
QMAX = np.array([127.0, 448.0, 7.0], np.float32)
Q_STORED_MAX = np.array([128.0, 448.0, 8.0], np.float32)  # the largest |q| a payload's bytes can hold (-128, -8)
NONFINITE = -1  # kernel result: the input has NaN or infinite values
F16, BF16, F32 = 0, 1, 2  # element codes of the input (encode) and output (decode)
OUT_MAX = np.array([np.finfo(np.float16).max, ml_dtypes.finfo(ml_dtypes.bfloat16).max, np.finfo(np.float32).max],
                   np.float32)  # the finite max of each element code's dtype
SCALE_F32_MIN = np.float32(np.finfo(np.float32).tiny)  # as quant_ref.SCALE_F32_MIN

U = np.uint32
RND = np.float32(12582912.0)  # 1.5 * 2**23: v + RND rounds v half-even to an integer, for |v| < 2**22
F16_TO_F32 = np.float32(2.0 ** 112)  # fp16 bits << 13 read as fp32, times this, is the fp16 value


def _target_has_f16c() -> bool:
    """Whether numba compiles for a CPU with F16C (its target features, which also key the disk cache)."""
    if not AVAILABLE:
        return False
    features = _config.CPU_FEATURES if _config.CPU_FEATURES is not None else _codegen.get_host_cpu_features()
    return "+f16c" in str(features).split(",")


F16C = _target_has_f16c()


def _jit(fn):
    return numba.njit(cache=True, nogil=True)(fn) if AVAILABLE else fn


def _inline(fn):
    """A small helper inlined into its callers by numba (so LLVM sees one loop body to vectorize)."""
    return numba.njit(inline="always")(fn) if AVAILABLE else fn


if AVAILABLE:
    def _int_arg(builder, value, from_type, bits):
        """An integer argument truncated or zero-extended to ``bits`` bits."""
        if from_type.bitwidth > bits:
            return builder.trunc(value, _ir.IntType(bits))
        if from_type.bitwidth < bits:
            return builder.zext(value, _ir.IntType(bits))
        return value

    @_intrinsic
    def f32_from_bits(typingctx, u):
        """The fp32 whose bit pattern is the low 32 bits of the integer ``u``."""
        if isinstance(u, _types.Integer):
            def codegen(context, builder, signature, args):
                return builder.bitcast(_int_arg(builder, args[0], u, 32), _ir.FloatType())
            return _types.float32(u), codegen
        return None

    @_intrinsic
    def bits_from_f32(typingctx, v):
        """The bit pattern (uint32) of the fp32 ``v``."""
        if isinstance(v, _types.Float) and v.bitwidth == 32:
            def codegen(context, builder, signature, args):
                return builder.bitcast(args[0], _ir.IntType(32))
            return _types.uint32(v), codegen
        return None

    @_intrinsic
    def _f16_to_f32_hw(typingctx, h):
        """fp16 bits (low 16 bits of ``h``) -> fp32: LLVM's fpext from half (vcvtph2ps with F16C)."""
        if isinstance(h, _types.Integer):
            def codegen(context, builder, signature, args):
                half = builder.bitcast(_int_arg(builder, args[0], h, 16), _ir.HalfType())
                return builder.fpext(half, _ir.FloatType())
            return _types.float32(h), codegen
        return None

    @_intrinsic
    def _f32_to_f16_hw(typingctx, v):
        """fp32 -> fp16 bits, RNE: LLVM's fptrunc to half (vcvtps2ph with F16C)."""
        if isinstance(v, _types.Float) and v.bitwidth == 32:
            def codegen(context, builder, signature, args):
                return builder.bitcast(builder.fptrunc(args[0], _ir.HalfType()), _ir.IntType(16))
            return _types.uint16(v), codegen
        return None
else:  # pragma: no cover - the kernels are only called when numba is present
    def f32_from_bits(u):
        return np.uint32(u).view(np.float32)

    def bits_from_f32(v):
        return np.float32(v).view(np.uint32)

    _f16_to_f32_hw = _f32_to_f16_hw = None


@_inline
def f16_to_f32_bits(h):
    """fp16 bits -> fp32, exact, by bit operations; inf stays inf, NaN becomes a quiet NaN (as vcvtph2ps)."""
    h = U(h)
    sign = U(U(h & U(0x8000)) << U(16))
    v = f32_from_bits(U(U(U(h & U(0x7FFF)) << U(13)) | sign)) * F16_TO_F32
    special = f32_from_bits(U(sign | U(0x7F800000) | U(U(h & U(0x3FF)) << U(13))
                              | (U(0x400000) if U(h & U(0x3FF)) != U(0) else U(0))))
    return special if U(h & U(0x7C00)) == U(0x7C00) else v


@_inline
def f32_to_f16_bits(v):
    """fp32 -> fp16 bits, round to nearest even, by bit operations (as vcvtps2ph: overflow -> inf, NaN quiet)."""
    u = bits_from_f32(v)
    a = U(u & U(0x7FFFFFFF))
    sub = U(bits_from_f32(f32_from_bits(a) * np.float32(16777216.0) + RND) & U(0x7FF))  # |v| in steps of 2**-24
    a2 = U(a - U(0x38000000))  # rebias the exponent 127 -> 15
    nor = U(U(a2 + U(0xFFF) + U(U(a2 >> U(13)) & U(1))) >> U(13))
    code = sub if a < U(0x38800000) else nor
    code = U(0x7C00) if a >= U(0x47800000) else code
    code = U(U(0x7E00) | U(U(a >> U(13)) & U(0x3FF))) if a > U(0x7F800000) else code
    return np.uint16(code | U(U(u >> U(16)) & U(0x8000)))


f16_to_f32 = _f16_to_f32_hw if F16C else f16_to_f32_bits
f32_to_f16 = _f32_to_f16_hw if F16C else f32_to_f16_bits


@_inline
def bf16_to_f32(h):
    return f32_from_bits(U(U(h) << U(16)))


@_inline
def f32_to_bf16(v):
    """fp32 -> bf16 bits, RNE (finite values; as hostcast.narrow)."""
    u = bits_from_f32(v)
    return np.uint16(U(U(u + U(0x7FFF) + U(U(u >> U(16)) & U(1))) >> U(16)))


@_inline
def f32_to_e4m3(v):
    """e4m3fn bits of v, RNE, for |v| <= 448 (the codec never exceeds it); inf/NaN -> 0x7F (NaN)."""
    u = bits_from_f32(v)
    mag = U(u & U(0x7FFFFFFF))
    sub = U(bits_from_f32(f32_from_bits(mag) * np.float32(512.0) + RND) & U(0xFF))  # steps of 2**-9
    nor = U(U(U(mag + U(0x7FFFF) + U(U(mag >> U(20)) & U(1))) >> U(20)) - U(960))  # rebias 127 -> 7
    code = sub if mag < U(0x3C800000) else nor  # below 2**-6, the smallest normal
    # inf/NaN (x * inf where 1 / scale overflowed, scales below 2**-128): NaN, as ml_dtypes casts them
    code = U(0x7F) if mag >= U(0x7F800000) else code
    return np.uint8(code | U(U(u >> U(24)) & U(0x80)))


@_inline
def e4m3_to_f32(b):
    """e4m3fn bits -> fp32, exact; 0x7F / 0xFF (NaN) give the quiet NaN of that sign, as ml_dtypes.

    Builds the fp32 bits directly (rebias the exponent 7 -> 127); subnormals (exponent 0)
    convert their 3-bit integer mantissa times 2**-9. No fp32 subnormal is ever an operand
    (x86 takes a slow assist for those).
    """
    b = U(b)
    m = U(b & U(0x7F))
    sub = bits_from_f32(np.float32(np.int32(m & U(7))) * np.float32(2.0 ** -9))
    bits = U(U(m << U(20)) + U(120 << 23)) if m >= U(8) else sub
    bits = U(0x7FC00000) if m == U(0x7F) else bits
    return f32_from_bits(U(bits | U(U(b & U(0x80)) << U(24))))


@_jit
def _group_scales(mbits, in_code, qmax, s16, s32, sr, inv):
    """Scales of one group (row ``sr`` of s16 or s32) and their fp32 inverses, from the max magnitude bits.

    scale = RNE(absmax / qmax) in the stored dtype, one step up if scale * qmax < absmax
    (compared in float64, where the product is exact), an fp32 scale at least SCALE_F32_MIN
    unless 0, as quant_ref.scales_from_absmax; inv = 1 / scale (0 for a zero scale).
    NONFINITE if a channel's absmax is inf or NaN.
    """
    d_total = mbits.shape[0]
    top = U(0)
    for d in range(d_total):
        top = max(top, mbits[d])
    if top >= U(0x7C00 if in_code == F16 else (0x7F80 if in_code == BF16 else 0x7F800000)):
        return NONFINITE
    qmax64 = np.float64(qmax)
    if in_code == F16:
        for d in range(d_total):
            a = f16_to_f32(mbits[d])
            h = f32_to_f16(a / qmax)
            h = np.uint16(U(h) + U(np.float64(f16_to_f32(h)) * qmax64 < np.float64(a)))  # next larger fp16
            s16[sr, d] = h
            s = f16_to_f32(h)
            inv[d] = np.float32(1.0) / s if s != np.float32(0.0) else np.float32(0.0)
    else:
        shift = U(16 if in_code == BF16 else 0)
        for d in range(d_total):
            a = f32_from_bits(U(mbits[d] << shift))
            s = a / qmax
            s = f32_from_bits(U(bits_from_f32(s) + U(np.float64(s) * qmax64 < np.float64(a))))  # next larger
            s = SCALE_F32_MIN if s < SCALE_F32_MIN and s != np.float32(0.0) else s
            s32[sr, d] = s
            inv[d] = np.float32(1.0) / s if s != np.float32(0.0) else np.float32(0.0)
    return 0


@_jit
def quantize(x16, x32, in_code, kind, g, t_total, s16, s32, q):
    """x [B*T, D] (fp16/bf16 bits in x16, or fp32 in x32) -> scales [B*ng, D], q [B*T, D or D/2] bytes.

    Returns 0, or NONFINITE if the input has NaN or infinite values.
    """
    rows, d_total = x32.shape if in_code == F32 else x16.shape
    b_total = rows // t_total
    ng = (t_total + g - 1) // g
    qmax = QMAX[kind]
    mbits = np.empty(d_total, np.uint32)
    inv = np.empty(d_total, np.float32)
    row = np.empty(d_total, np.float32)  # one token row, scaled (stays in L1)
    x32u = x32.view(np.uint32)
    for r in range(b_total):
        for gi in range(ng):
            t0 = r * t_total + gi * g
            t1 = r * t_total + min(t_total, (gi + 1) * g)
            mbits[:] = 0
            if in_code == F32:
                for t in range(t0, t1):
                    for d in range(d_total):
                        mbits[d] = max(mbits[d], U(x32u[t, d] & U(0x7FFFFFFF)))
            else:
                for t in range(t0, t1):
                    for d in range(d_total):
                        mbits[d] = max(mbits[d], U(U(x16[t, d]) & U(0x7FFF)))
            if _group_scales(mbits, in_code, qmax, s16, s32, r * ng + gi, inv) < 0:
                return NONFINITE
            for t in range(t0, t1):
                if in_code == F16:
                    for d in range(d_total):
                        row[d] = f16_to_f32(x16[t, d]) * inv[d]
                elif in_code == BF16:
                    for d in range(d_total):
                        row[d] = bf16_to_f32(x16[t, d]) * inv[d]
                else:
                    for d in range(d_total):
                        row[d] = x32[t, d] * inv[d]
                if kind == 0:  # int8: the low 8 bits of v + RND are rint(v) in two's complement
                    for d in range(d_total):
                        q[t, d] = np.uint8(bits_from_f32(row[d] + RND))
                elif kind == 1:
                    for d in range(d_total):
                        q[t, d] = f32_to_e4m3(row[d])
                else:  # int4: two's-complement nibbles, even channel low
                    for p in range(d_total // 2):
                        lo = U(bits_from_f32(row[2 * p] + RND) & U(0x0F))
                        hi = U(bits_from_f32(row[2 * p + 1] + RND) & U(0x0F))
                        q[t, p] = np.uint8(lo | U(hi << U(4)))
    return 0


@_jit
def dequantize(q, kind, g, t_total, s16, s32, out_code, out16, out32):
    """q [B*T, D or D/2] bytes and scales [B*ng, D] (fp16 bits in s16, or fp32 in s32) -> out [B*T, D].

    out_code F16 / BF16: bits into out16; F32: values into out32. Values are clamped to the
    output dtype's finite range (OUT_MAX), as quant_ref.dequantize_into.
    """
    rows, d_total = out32.shape if out_code == F32 else out16.shape
    b_total = rows // t_total
    ng = (t_total + g - 1) // g
    fmax = OUT_MAX[out_code]
    qmax = Q_STORED_MAX[kind]
    ss = np.empty(d_total, np.float32)
    ys = np.empty(d_total, np.float32)  # one token row (stays in L1)
    qi = q.view(np.int8)
    for r in range(b_total):
        for gi in range(ng):
            sr = r * ng + gi
            if out_code == F16:  # fp16 data has fp16 scales
                for d in range(d_total):
                    ss[d] = f16_to_f32(s16[sr, d])
            else:
                for d in range(d_total):
                    ss[d] = s32[sr, d]
            clamp = False  # |q| <= qmax, fp32 rounding is monotonic: only a scale with qmax * s past fmax
            for d in range(d_total):  # can decode past the finite range (a channel at the top of it)
                clamp = clamp or qmax * abs(ss[d]) > fmax
            t0 = r * t_total + gi * g
            t1 = r * t_total + min(t_total, (gi + 1) * g)
            for t in range(t0, t1):
                if kind == 0:
                    for d in range(d_total):
                        ys[d] = np.float32(qi[t, d]) * ss[d]
                elif kind == 1:
                    for d in range(d_total):
                        ys[d] = e4m3_to_f32(q[t, d]) * ss[d]
                else:
                    for p in range(d_total // 2):
                        byte = np.int32(qi[t, p])
                        ys[2 * p] = np.float32(np.int32(U(byte) << U(28)) >> 28) * ss[2 * p]  # low nibble
                        ys[2 * p + 1] = np.float32(byte >> 4) * ss[2 * p + 1]
                if clamp:
                    for d in range(d_total):  # clamp to the finite range (NaN passes, as np.clip)
                        y = ys[d]
                        y = fmax if y > fmax else y
                        ys[d] = -fmax if y < -fmax else y
                if out_code == F16:
                    for d in range(d_total):
                        out16[t, d] = f32_to_f16(ys[d])
                elif out_code == BF16:
                    for d in range(d_total):
                        out16[t, d] = f32_to_bf16(ys[d])
                else:
                    for d in range(d_total):
                        out32[t, d] = ys[d]


_EMPTY16 = np.empty((1, 1), np.uint16)
_EMPTY32 = np.empty((1, 1), np.float32)


def _elem_code(dtype: np.dtype) -> int:
    if dtype == np.float16:
        return F16
    return F32 if dtype == np.float32 else BF16


def _scale_arrays(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    s2 = scales.reshape(-1, scales.shape[-1])
    if scales.dtype == np.float16:
        return s2.view(np.uint16), _EMPTY32
    return _EMPTY16, s2


def quantize_into(x: np.ndarray, kind_name: str, g: int, scales: np.ndarray, q: np.ndarray) -> None:
    """Drop-in for quant_ref.quantize_into (x C-contiguous [B, T, D])."""
    b, t, d = x.shape
    s16, s32 = _scale_arrays(scales)
    code = _elem_code(x.dtype)
    x2 = x.reshape(b * t, d)
    x16, x32 = (_EMPTY16, x2) if code == F32 else (x2.view(np.uint16), _EMPTY32)
    rc = quantize(x16, x32, code, KIND_CODES[kind_name], g, t, s16, s32, q.reshape(b * t, -1).view(np.uint8))
    if rc == NONFINITE:
        raise ValueError("input has NaN or infinite values; quantized codecs need finite data")


def dequantize_into(q: np.ndarray, kind_name: str, g: int, scales: np.ndarray, out: np.ndarray) -> None:
    """Drop-in for quant_ref.dequantize_into (out C-contiguous [B, T, D])."""
    b, t, d = out.shape
    s16, s32 = _scale_arrays(scales)
    code = _elem_code(out.dtype)
    o2 = out.reshape(b * t, d)
    o16, o32 = (_EMPTY16, o2) if code == F32 else (o2.view(np.uint16), _EMPTY32)
    dequantize(q.reshape(b * t, -1).view(np.uint8), KIND_CODES[kind_name], g, t, s16, s32, code, o16, o32)
