"""CUDA C sources of the codec and paged-copy kernels (compiled by NVRTC, run by CuPy).

No CUDA headers are included: fp16 conversions use the PTX ``cvt`` instructions,
bf16 and e4m3 use bit arithmetic. That keeps the sources compilable by NVRTC on
a machine with no driver and no CUDA toolkit headers (see nvrtc_compile.py), and
makes every rounding explicit so the results match quant_ref.py bit for bit:

* scale = smallest stored value >= absmax / QMAX (IEEE division, RNE, then one
  step up if short; the check in double, where it is exact);
* inv = 1 / scale (IEEE), v = x * inv (``__fmul_rn``: no contraction);
* int8/int4: ``rintf`` (half-even); fp8: ``f32_to_e4m3`` (RNE, input <= 448);
* an fp32 scale is at least 2**-126 unless 0 (``KV_SCALE_F32_MIN``: its inverse is finite);
* decode: ``mul_rn_hostnan(q, scale)`` (``__fmul_rn``; a NaN product is the one an x86 CPU's
  multiply gives), clamped to the output dtype's finite range (NaN passes), then RNE to it;
* NaN: e4m3 0x7F / 0xFF decode to the quiet NaN of their sign (as ml_dtypes); fp16 <-> fp32
  conversions of NaN keep sign and payload, quieted (as F16C's vcvtph2ps / vcvtps2ph), not
  the canonical NaN the PTX instructions may give.

The two PTX fp16 conversions are one fragment (``F16_CVT_PTX``) that sees no NaN, so a
test can build the rest of the source as host C++ with its own fp16 conversions.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

KV_DTYPES = {"f16": "unsigned short", "bf16": "unsigned short", "f32": "float"}
QUANT_KINDS = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}
PAGED_WORDS = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long", 16: "uint4"}
KV_DTYPE_MAX = {"f16": float(np.finfo(np.float16).max), "bf16": float(ml_dtypes.finfo(ml_dtypes.bfloat16).max),
                "f32": float(np.finfo(np.float32).max)}  # as quant_ref.finite_max
SCALE_F32_MIN = float(np.finfo(np.float32).tiny)  # as quant_ref.SCALE_F32_MIN


def _float_literal(value: float) -> str:
    """An exact C float literal (hexadecimal)."""
    return value.hex() + "f"


_CLAMP = r"""
/* decoded values within the dtype's finite range; NaN passes (as np.clip) */
__device__ __forceinline__ float clamp_{dt}(float f) {{
    return f > {MAX} ? {MAX} : (f < -{MAX} ? -{MAX} : f);
}}
"""

F16_CVT_PTX = r"""
/* fp16 <-> fp32 of non-NaN values (exact / RNE); the callers below handle NaN themselves */
__device__ __forceinline__ float f16_to_f32_cvt(unsigned short h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ unsigned short f32_to_f16_cvt(float f) {
    unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
"""

_COMMON = r"""
/* fp16 NaN -> fp32 NaN of the same sign and payload, quieted (as vcvtph2ps) */
__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    unsigned int u = h;
    if ((u & 0x7C00u) == 0x7C00u && (u & 0x3FFu) != 0u)
        return __uint_as_float(((u & 0x8000u) << 16) | 0x7FC00000u | ((u & 0x3FFu) << 13));
    return f16_to_f32_cvt(h);
}
/* fp32 NaN -> fp16 NaN of the same sign, top payload bits kept, quieted (as vcvtps2ph) */
__device__ __forceinline__ unsigned short f32_to_f16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return (unsigned short)(((u >> 16) & 0x8000u) | 0x7E00u | ((u >> 13) & 0x3FFu));
    return f32_to_f16_cvt(f);
}
/* a * b, IEEE RNE, not contracted; a NaN product is the one an x86 multiply (the host decoders) gives:
   the first NaN operand, quieted, else (0 * inf) the default NaN 0xFFC00000. A GPU's own NaN is canonical. */
__device__ __forceinline__ float mul_rn_hostnan(float a, float b) {
    float p = __fmul_rn(a, b);
    if (p == p) return p;
    unsigned int ua = __float_as_uint(a), ub = __float_as_uint(b);
    if ((ua & 0x7FFFFFFFu) > 0x7F800000u) return __uint_as_float(ua | 0x00400000u);
    if ((ub & 0x7FFFFFFFu) > 0x7F800000u) return __uint_as_float(ub | 0x00400000u);
    return __uint_as_float(0xFFC00000u);
}
__device__ __forceinline__ float bf16_to_f32(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float load_f16(const unsigned short* p, long long i) { return f16_to_f32(p[i]); }
__device__ __forceinline__ float load_bf16(const unsigned short* p, long long i) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ float load_f32(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ unsigned int absbits_f16(const unsigned short* p, long long i) { return p[i] & 0x7FFFu; }
__device__ __forceinline__ unsigned int absbits_bf16(const unsigned short* p, long long i) { return p[i] & 0x7FFFu; }
__device__ __forceinline__ unsigned int absbits_f32(const float* p, long long i) { return __float_as_uint(p[i]) & 0x7FFFFFFFu; }
__device__ __forceinline__ float absval_f16(unsigned int b) { return f16_to_f32((unsigned short)b); }
__device__ __forceinline__ float absval_bf16(unsigned int b) { return bf16_to_f32((unsigned short)b); }
__device__ __forceinline__ float absval_f32(unsigned int b) { return __uint_as_float(b); }
__device__ __forceinline__ void store_f16(unsigned short* p, long long i, float f) { p[i] = f32_to_f16(f); }
__device__ __forceinline__ void store_bf16(unsigned short* p, long long i, float f) { p[i] = f32_to_bf16(f); }
__device__ __forceinline__ void store_f32(float* p, long long i, float f) { p[i] = f; }

/* scale as stored (fp16 bits for fp16 data, fp32 otherwise); returns it as float */
__device__ __forceinline__ float make_scale_f16(float amax, float qmax, unsigned short* out) {
    unsigned short h = f32_to_f16(amax / qmax);
    if ((double)f16_to_f32(h) * (double)qmax < (double)amax) h += 1;
    *out = h; return f16_to_f32(h);
}
__device__ __forceinline__ float make_scale_f32(float amax, float qmax, float* out) {
    float s = amax / qmax;
    if ((double)s * (double)qmax < (double)amax) s = __uint_as_float(__float_as_uint(s) + 1u);
    if (s != 0.0f && s < KV_SCALE_F32_MIN) s = KV_SCALE_F32_MIN;
    *out = s; return s;
}
__device__ __forceinline__ float read_scale_f16(const unsigned short* p, long long i) { return f16_to_f32(p[i]); }
__device__ __forceinline__ float read_scale_f32(const float* p, long long i) { return p[i]; }

/* float (|v| <= 448) -> e4m3fn bits, round to nearest even; mirrors quant_ref.fp8_e4m3_bits_reference */
__device__ __forceinline__ unsigned char f32_to_e4m3(float v) {
    unsigned int u = __float_as_uint(v);
    unsigned int sign = (u >> 24) & 0x80u;
    unsigned int mag = u & 0x7FFFFFFFu;
    float a = __uint_as_float(mag);
    unsigned int code;
    if (a < 0.015625f) {               /* below 2^-6: subnormal step 2^-9 */
        code = (unsigned int)rintf(a * 512.0f);
    } else {
        code = ((mag + 0x7FFFFu + ((mag >> 20) & 1u)) >> 20) - (120u << 3);
    }
    return (unsigned char)(code | sign);
}
/* e4m3fn bits -> float, exact; 0x7F / 0xFF (e4m3fn's only NaNs) -> the quiet NaN of that sign, as ml_dtypes */
__device__ __forceinline__ float e4m3_to_f32(unsigned char b) {
    if ((b & 0x7Fu) == 0x7Fu) return __uint_as_float(0x7FC00000u | ((b & 0x80u) << 24));
    unsigned int e = (b >> 3) & 15u, m = b & 7u;
    float a = (e == 0) ? (float)m * 0.001953125f : __uint_as_float(((e + 120u) << 23) | (m << 20));
    return (b & 0x80u) ? -a : a;
}
"""

_QUANT_1 = r"""
/* one thread per (row, group, channel): absmax pass, then quantize pass over the group's tokens */
extern "C" __global__ void kv_quant_{kind}_{dt}(const {T}* __restrict__ x, {S}* __restrict__ scales,
        {Q}* __restrict__ q, long long rows, int tokens, int dim, int group) {{
    long long ng = (tokens + group - 1) / group;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * ng * dim) return;
    int d = (int)(idx % dim);
    long long rg = idx / dim;
    int g = (int)(rg % ng);
    long long r = rg / ng;
    int t0 = g * group, t1 = min(tokens, t0 + group);
    long long base = r * (long long)tokens * dim + d;
    unsigned int amax_bits = 0;
    for (int t = t0; t < t1; ++t) amax_bits = max(amax_bits, absbits_{dt}(x, base + (long long)t * dim));
    float s = make_scale_{sdt}(absval_{dt}(amax_bits), {QMAX}f, &scales[idx]);
    float inv = (s != 0.0f) ? 1.0f / s : 0.0f;
    for (int t = t0; t < t1; ++t) {{
        float v = __fmul_rn(load_{dt}(x, base + (long long)t * dim), inv);
        q[base + (long long)t * dim] = {CONVERT};
    }}
}}

extern "C" __global__ void kv_dequant_{kind}_{dt}(const {Q}* __restrict__ q, const {S}* __restrict__ scales,
        {T}* __restrict__ out, long long rows, int tokens, int dim, int group) {{
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * tokens * dim) return;
    int d = (int)(idx % dim);
    long long rt = idx / dim;
    int t = (int)(rt % tokens);
    long long r = rt / tokens;
    long long ng = (tokens + group - 1) / group;
    float s = read_scale_{sdt}(scales, (r * ng + t / group) * dim + d);
    store_{dt}(out, idx, clamp_{dt}(mul_rn_hostnan({UNCONVERT}, s)));
}}
"""

_QUANT_INT4 = r"""
/* one thread per (row, group, channel pair): two scales, one packed byte per token */
extern "C" __global__ void kv_quant_int4_{dt}(const {T}* __restrict__ x, {S}* __restrict__ scales,
        unsigned char* __restrict__ q, long long rows, int tokens, int dim, int group) {{
    long long ng = (tokens + group - 1) / group;
    int pairs = dim / 2;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * ng * pairs) return;
    int p = (int)(idx % pairs);
    long long rg = idx / pairs;
    int g = (int)(rg % ng);
    long long r = rg / ng;
    int t0 = g * group, t1 = min(tokens, t0 + group);
    long long base = r * (long long)tokens * dim + 2 * p;
    unsigned int a0 = 0, a1 = 0;
    for (int t = t0; t < t1; ++t) {{
        a0 = max(a0, absbits_{dt}(x, base + (long long)t * dim));
        a1 = max(a1, absbits_{dt}(x, base + (long long)t * dim + 1));
    }}
    long long sidx = rg * dim + 2 * p;
    float s0 = make_scale_{sdt}(absval_{dt}(a0), 7.0f, &scales[sidx]);
    float s1 = make_scale_{sdt}(absval_{dt}(a1), 7.0f, &scales[sidx + 1]);
    float i0 = (s0 != 0.0f) ? 1.0f / s0 : 0.0f;
    float i1 = (s1 != 0.0f) ? 1.0f / s1 : 0.0f;
    for (int t = t0; t < t1; ++t) {{
        int lo = (int)rintf(__fmul_rn(load_{dt}(x, base + (long long)t * dim), i0));
        int hi = (int)rintf(__fmul_rn(load_{dt}(x, base + (long long)t * dim + 1), i1));
        q[(r * tokens + t) * pairs + p] = (unsigned char)((lo & 0x0F) | ((hi & 0x0F) << 4));
    }}
}}

extern "C" __global__ void kv_dequant_int4_{dt}(const unsigned char* __restrict__ q, const {S}* __restrict__ scales,
        {T}* __restrict__ out, long long rows, int tokens, int dim, int group) {{
    int pairs = dim / 2;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * tokens * pairs) return;
    int p = (int)(idx % pairs);
    long long rt = idx / pairs;
    int t = (int)(rt % tokens);
    long long r = rt / tokens;
    long long ng = (tokens + group - 1) / group;
    long long sidx = (r * ng + t / group) * dim + 2 * p;
    signed char b = (signed char)q[idx];
    float lo = (float)((signed char)(b << 4) >> 4);
    float hi = (float)(b >> 4);
    store_{dt}(out, 2 * idx, clamp_{dt}(mul_rn_hostnan(lo, read_scale_{sdt}(scales, sidx))));
    store_{dt}(out, 2 * idx + 1, clamp_{dt}(mul_rn_hostnan(hi, read_scale_{sdt}(scales, sidx + 1))));
}}
"""

_PAGED = r"""
/* dst block n = [layers, 2, heads, tokens, words]; src layer l at layer_ptrs[l], strides in words */
extern "C" __global__ void kv_paged_{op}_w{W}(unsigned long long* __restrict__ layer_ptrs, {WT}* __restrict__ buf,
        const long long* __restrict__ block_ids, long long n_blocks, int layers, int heads, int tokens, int words,
        long long s_kv, long long s_blk, long long s_head, long long s_tok) {{
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long total = n_blocks * layers * 2LL * heads * tokens * words;
    if (idx >= total) return;
    long long rest = idx;
    int w = (int)(rest % words); rest /= words;
    int t = (int)(rest % tokens); rest /= tokens;
    int h = (int)(rest % heads); rest /= heads;
    int kv = (int)(rest % 2); rest /= 2;
    int l = (int)(rest % layers);
    long long n = rest / layers;
    {WT}* layer = ({WT}*)layer_ptrs[l];
    long long off = kv * s_kv + block_ids[n] * s_blk + h * s_head + t * s_tok + w;
    {BODY}
}}
"""

_CONVERT = {"int8": "(signed char)rintf(v)", "fp8": "f32_to_e4m3(v)"}
_UNCONVERT = {"int8": "(float)q[idx]", "fp8": "e4m3_to_f32(q[idx])"}
_QTYPE = {"int8": "signed char", "fp8": "unsigned char"}


def scale_code(dt: str) -> str:
    """Scale storage of a KV dtype: fp16 bits for fp16 data, fp32 otherwise (as quant_ref)."""
    return "f16" if dt == "f16" else "f32"


def codec_source() -> str:
    """All quantize/dequantize kernels: {int8, fp8, int4} x {f16, bf16, f32}."""
    parts = [f"#define KV_SCALE_F32_MIN {_float_literal(SCALE_F32_MIN)}", F16_CVT_PTX, _COMMON]
    parts += [_CLAMP.format(dt=dt, MAX=_float_literal(KV_DTYPE_MAX[dt])) for dt in KV_DTYPES]
    for dt, ctype in KV_DTYPES.items():
        sdt = scale_code(dt)
        stype = "unsigned short" if sdt == "f16" else "float"
        for kind in ("int8", "fp8"):
            parts.append(_QUANT_1.format(kind=kind, dt=dt, T=ctype, S=stype, Q=_QTYPE[kind], sdt=sdt,
                                         QMAX=QUANT_KINDS[kind], CONVERT=_CONVERT[kind],
                                         UNCONVERT=_UNCONVERT[kind]))
        parts.append(_QUANT_INT4.format(dt=dt, T=ctype, S=stype, sdt=sdt))
    return "\n".join(parts)


def paged_source() -> str:
    """Gather (paged layers -> contiguous blocks) and scatter kernels for 1/2/4/8/16-byte words."""
    parts = []
    for w, wt in PAGED_WORDS.items():
        parts.append(_PAGED.format(op="gather", W=w, WT=wt, BODY="buf[idx] = layer[off];"))
        parts.append(_PAGED.format(op="scatter", W=w, WT=wt, BODY="layer[off] = buf[idx];"))
    return "\n".join(parts)


def codec_kernel_names() -> list[str]:
    return [f"kv_{op}_{kind}_{dt}" for dt in KV_DTYPES for kind in QUANT_KINDS for op in ("quant", "dequant")]


def paged_kernel_names() -> list[str]:
    return [f"kv_paged_{op}_w{w}" for w in PAGED_WORDS for op in ("gather", "scatter")]
