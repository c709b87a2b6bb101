"""Quantized codecs at the edges of the input dtypes' ranges: decoded values stay finite and within the bound.

The per-element bound of the quantized codecs: ``|x' - x| <= scale / 2`` for int8 and int4 (a rounding
to the integer grid), ``|x' - x| <= scale * E4M3_STEP_MAX / 2`` for fp8 (half the e4m3 step at 448), with
``scale`` the stored scale of the value's (group, channel); plus half a step of the output dtype at ``x'``
(the fp32 product is rounded to it). Both backends (numba, NumPy reference) are run.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kvtier.kernels import get_codec
from kvtier.kernels.codec import HOST_BACKEND
from kvtier.kernels.cuda_sources import codec_source

BF16 = np.dtype(ml_dtypes.bfloat16)
FP16 = np.dtype(np.float16)
FP32 = np.dtype(np.float32)
KINDS = ["int8", "fp8", "int4"]
E4M3_STEP_MAX = 32.0  # e4m3fn values are 32 apart between 256 and 448
FP32_TINY = float(np.finfo(np.float32).tiny)


def _backends():
    from kvtier.kernels import quant_numba

    return [True, False] if quant_numba.AVAILABLE else [False]


def _round_trip(name, x, fused):
    codec = get_codec(name, group_tokens=4)
    HOST_BACKEND.fused = fused
    try:
        data = codec.encode(x)
        out = np.empty_like(x)
        codec.decode(data, out)
    finally:
        from kvtier.kernels import quant_numba

        HOST_BACKEND.fused = quant_numba.AVAILABLE
    scales, _ = codec.parse(data).views(data)
    return out, np.asarray(scales, np.float64)


def host_decode(fused: bool, codec, data: bytes, out: np.ndarray) -> np.ndarray:
    """``codec.decode(data, out)`` by the fused (numba) host decoder or the NumPy one."""
    from kvtier.kernels import quant_numba

    HOST_BACKEND.fused = fused
    try:
        codec.decode(data, out)
    finally:
        HOST_BACKEND.fused = quant_numba.AVAILABLE
    return out


def _per_element_bound(name, scales, out):
    """``[B, T, D]`` bound of each element from the ``[B, ng, D]`` scales (group_tokens 4)."""
    step = E4M3_STEP_MAX if name == "fp8" else 1.0
    info = ml_dtypes.finfo(out.dtype)
    out_rounding = np.abs(out.astype(np.float64)) * float(info.eps) / 2 + float(info.smallest_subnormal) / 2
    return np.repeat(scales, 4, axis=1)[:, : out.shape[1]] * step / 2 + out_rounding


def _check(name, x, fused):
    out, scales = _round_trip(name, x, fused)
    assert np.isfinite(out.astype(np.float64)).all(), f"{name} decoded non-finite values: {out.ravel()[:8]}"
    err = np.abs(out.astype(np.float64) - x.astype(np.float64))
    bound = _per_element_bound(name, scales, out)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), f"{name}: error {err[worst]} over the bound {bound[worst]} at {worst}"


def _largest_values(dtype):
    big = float(ml_dtypes.finfo(dtype).max)
    x = np.ones((2, 8, 8), np.float32)
    x[0, :, :4] = big
    x[1, :, 4:] = -big
    x[1, 3, 0] = -float(np.nextafter(np.float32(big), np.float32(0))) if dtype == FP32 else 1.0
    x[0, :4, 6] = 65472.0  # the fp16 value below the largest: its scale rounds up past the range too
    return x.astype(dtype)


def _tiny_values(dtype):
    """Channels whose absmax / QMAX is below 2**-126: 1 / scale would overflow fp32."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 8, 8)).astype(np.float32)
    x[0, :, 1] *= 1e-38
    x[0, :, 2] *= 1e-40  # fp32 subnormals (bf16 too)
    x[1, :, 3] = 0.0
    x[1, 0, 3] = FP32_TINY
    x[1, :4, 5] = 0.0  # zeros inside a tiny channel: 0 * inf would be NaN
    x[1, 4:, 5] *= 1e-39
    return x.astype(dtype)


@pytest.mark.parametrize("fused", _backends())
@pytest.mark.parametrize("dtype", [FP16, BF16, FP32], ids=str)
@pytest.mark.parametrize("name", KINDS)
def test_largest_finite_values_decode_finite(name, dtype, fused):
    _check(name, _largest_values(dtype), fused)


@pytest.mark.parametrize("fused", _backends())
@pytest.mark.parametrize("dtype", [BF16, FP32], ids=str)
@pytest.mark.parametrize("name", KINDS)
def test_tiny_values_with_fp32_scales_decode_finite(name, dtype, fused):
    _check(name, _tiny_values(dtype), fused)


@pytest.mark.gpu
@pytest.mark.parametrize("make", [_largest_values, _tiny_values])
@pytest.mark.parametrize("dtype", [FP16, BF16, FP32], ids=str)
@pytest.mark.parametrize("name", KINDS)
def test_cuda_kernels_match_the_reference_at_the_extremes(name, dtype, make):
    from cuda_reason import cuda_skip_reason

    if cuda_skip_reason() is not None:
        pytest.skip(str(cuda_skip_reason()))
    import torch

    x = make(dtype)
    t = torch.from_numpy(x.view(np.int16) if dtype.itemsize == 2 else x)
    t = t.view(torch.bfloat16) if dtype == BF16 else (t.view(torch.float16) if dtype == FP16 else t)
    codec = get_codec(name, group_tokens=4)
    ref = codec.encode(x)
    assert codec.encode(t.cuda()) == ref
    out_cpu, out_gpu = torch.empty_like(t), torch.empty_like(t, device="cuda")
    codec.decode(ref, out_cpu)
    codec.decode(ref, out_gpu)
    torch.cuda.synchronize()
    assert torch.equal(out_gpu.cpu().view(torch.uint8), out_cpu.view(torch.uint8))


def test_cuda_sources_clamp_decoded_values_and_floor_fp32_scales():
    """The device kernels follow the reference (they cannot run here: the CUDA C is read instead)."""
    src = codec_source()
    assert "KV_SCALE_F32_MIN" in src and "s < KV_SCALE_F32_MIN" in src
    for dt in ("f16", "bf16", "f32"):
        assert f"store_{dt}(out, idx, clamp_{dt}(" in src
        assert f"store_{dt}(out, 2 * idx, clamp_{dt}(" in src


@pytest.mark.parametrize("fused", _backends())
@pytest.mark.parametrize("name,code,value", [("int8", 0x80, -128), ("int4", 0x88, -8)])
def test_the_most_negative_stored_value_decodes_finite(name, code, value, fused):
    """A payload's bytes can hold -128 (int8) or -8 (int4), one step past QMAX: with a channel's scale
    at the top of fp16's range, that step would be past 65504 (a block written by another encoder)."""
    qmax = {"int8": 127.0, "int4": 7.0}[name]
    x = np.ones((1, 8, 8), np.float32)
    x[0, :, 0] = 512.0 * qmax if name == "int8" else 8192.0 * qmax  # scale 512 (int8) / 8192 (int4), exact in fp16
    x = x.astype(FP16)
    codec = get_codec(name, group_tokens=4)
    data = bytearray(codec.encode(x))
    scales, q = codec.parse(data).views(data)
    assert float(np.asarray(scales, np.float64)[0, 0, 0]) * (qmax + 1) > float(np.finfo(FP16).max)
    q.view(np.uint8).reshape(-1)[0] = code  # channel 0 of token 0 (and, for int4, channel 1)
    out = host_decode(fused, codec, bytes(data), np.empty_like(x))
    assert np.isfinite(out.astype(np.float64)).all(), out[0, 0, :2]
    assert float(out[0, 0, 0]) == -float(np.finfo(FP16).max)


@pytest.mark.parametrize("fused", _backends())
def test_a_negative_scale_at_the_top_of_the_range_decodes_finite(fused):
    """A payload whose channel scale is negative (no encoder of ours writes one) and large: the clamp
    is decided on the scale's magnitude, so both host decoders give the range's end, not -inf."""
    x = np.ones((1, 8, 8), np.float32).astype(FP16)
    codec = get_codec("int8", group_tokens=4)
    data = bytearray(codec.encode(x))
    scales, q = codec.parse(data).views(data)
    scales[...] = np.asarray(scales).dtype.type(1.0 / 127)
    scales.reshape(-1)[0] = -60000.0  # channel 0 of the first group: 127 * 60000 is past fp16's range
    out = host_decode(fused, codec, bytes(data), np.empty_like(x))
    assert np.isfinite(out.astype(np.float64)).all(), out[0, :4, 0]
    assert float(out[0, 0, 0]) == -float(np.finfo(FP16).max)
