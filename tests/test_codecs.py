"""Codecs on the host: round trips, quality bounds, the byte format's checks."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from kvtier.kernels import MixedPrecisionPolicy, codec_for_id, get_codec
from kvtier.kernels.hostcast import narrow, widen
from kvtier.kernels.lz4stage import MODE_SHUFFLE2_LZ4, MODE_STORED, frame_mode
from kvtier.kernels.quant_ref import E4M3, fp8_e4m3_bits_reference, scales_from_absmax

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32)]
QUALITY_BOUND = {"int8": 0.01, "fp8": 0.05, "int4": 0.15}  # relative L2 error, issue 4
OUTLIER_FACTOR = 20.0


def kv_with_outliers(shape, dtype, seed=0, outliers=4):
    """Normal KV with a few channels scaled x20, as real keys have."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape, dtype=np.float32)
    channels = rng.choice(shape[-1], outliers, replace=False)
    x[..., channels] *= OUTLIER_FACTOR
    return x.astype(dtype)


def rel_l2(a, b):
    a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a32 - b32) / np.linalg.norm(b32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["int8", "fp8", "int4"])
def test_quality_bound_with_outlier_channels(name, dtype):
    x = kv_with_outliers((2, 2, 4, 256, 128), dtype)
    codec = get_codec(name)
    out = np.empty_like(x)
    codec.decode(codec.encode(x), out)
    err = rel_l2(out, x)
    print(f"{name} {dtype}: relative L2 error {err:.4%}")
    assert err <= QUALITY_BOUND[name]
    assert err > 0  # a lossy codec that is exact would mean it stored raw


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["raw", "raw+lz4"])
def test_raw_round_trip_is_exact(name, dtype):
    x = kv_with_outliers((3, 2, 17, 64), dtype)
    out = np.zeros_like(x)
    get_codec(name).decode(get_codec(name).encode(x), out)
    assert out.tobytes() == x.tobytes()


@pytest.mark.parametrize("tokens,group", [(1, 64), (17, 8), (100, 32), (257, 64), (64, 1)])
@pytest.mark.parametrize("name", ["int8", "fp8", "int4"])
def test_uneven_groups_round_trip(name, tokens, group):
    x = kv_with_outliers((3, tokens, 32), np.float16, seed=tokens)
    codec = get_codec(name, group_tokens=group)
    data = codec.encode(x)
    out = np.empty_like(x)
    codec.decode(data, out)
    assert rel_l2(out, x) <= QUALITY_BOUND[name]
    # a value equal to its group's absmax survives to within half a step
    assert np.isfinite(out.astype(np.float32)).all()


def test_long_rows_are_chunked_along_tokens():
    x = kv_with_outliers((2, 1024, 128), np.float16)  # 131072 elements per row: chunked by token groups
    codec = get_codec("int8", group_tokens=48)
    out = np.empty_like(x)
    codec.decode(codec.encode(x), out)
    assert rel_l2(out, x) <= QUALITY_BOUND["int8"]
    assert codec.encode(x[:1]) == codec.encode(x[:1].copy())


def test_zero_block_encodes_to_zero():
    x = np.zeros((2, 16, 8), np.float16)
    for name in ["int8", "fp8", "int4"]:
        out = np.ones_like(x)
        get_codec(name).decode(get_codec(name).encode(x), out)
        assert not out.any()


@pytest.mark.parametrize("name", ["raw", "int8", "fp8", "int4", "mixed", "int8+lz4"])
def test_torch_and_numpy_inputs_give_the_same_bytes(name):
    x = kv_with_outliers((2, 2, 32, 64), np.float32)
    t = torch.from_numpy(x).to(torch.bfloat16)
    as_np = t.view(torch.int16).numpy().view(BF16)
    codec = get_codec(name)
    data = codec.encode(t)
    assert data == codec.encode(as_np)
    out = torch.empty_like(t)
    assert codec.decode(data, out) is out
    ref = np.empty_like(as_np)
    codec.decode(data, ref)
    assert out.view(torch.int16).numpy().tobytes() == ref.tobytes()


def test_non_contiguous_input_is_accepted():
    x = kv_with_outliers((4, 32, 64), np.float16)
    view = x[:, :, ::2]  # strided
    codec = get_codec("int8")
    assert codec.encode(view) == codec.encode(np.ascontiguousarray(view))


def test_scales_never_fall_short_of_absmax():
    rng = np.random.default_rng(3)
    absmax = (10.0 ** rng.uniform(-9, 4, 200_000)).astype(np.float32)
    for qmax in (127.0, 448.0, 7.0):
        for sdt in (np.float16, np.float32):
            s = scales_from_absmax(absmax, qmax, np.dtype(sdt))
            assert (s.astype(np.float64) * qmax >= absmax.astype(np.float64)).all()
            # and it is the smallest such value: one step down falls short (where that step exists)
            uint = np.uint16 if np.dtype(sdt).itemsize == 2 else np.uint32
            below = s.copy()
            positive = s.view(uint) > 0
            below.view(uint)[positive] -= uint(1)
            assert (below.astype(np.float64)[positive] * qmax < absmax.astype(np.float64)[positive]).all()


def test_fp8_bit_algorithm_matches_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
    finite = np.sort(np.unique(codes[np.isfinite(codes)]))
    mids = (finite[:-1] + finite[1:]) / 2  # ties: round-half-even decides
    rng = np.random.default_rng(4)
    spread = np.sign(rng.standard_normal(100_000)) * 10.0 ** rng.uniform(-5, np.log10(448), 100_000)
    x = np.concatenate([finite, mids, np.nextafter(mids, 0), np.nextafter(mids, 1000), spread]).astype(np.float32)
    x = np.clip(x, -448, 448)
    assert (fp8_e4m3_bits_reference(x) == x.astype(E4M3).view(np.uint8)).all()


def test_hostcast_torch_and_numpy_paths_agree():
    bits = np.arange(1 << 16, dtype=np.uint16)
    h = bits.view(np.float16)
    h = h[np.isfinite(h)]
    a, b = np.empty(h.shape, np.float32), np.empty(h.shape, np.float32)
    widen(h, a, use_torch=True)
    widen(h, b, use_torch=False)
    assert a.tobytes() == b.tobytes()
    rng = np.random.default_rng(5)
    f = np.concatenate([a, (a[:-1] + a[1:]) / 2, rng.standard_normal(10_000).astype(np.float32) * 1e-6])
    f = f[np.abs(f) < 65504]
    h1, h2 = np.empty(f.shape, np.float16), np.empty(f.shape, np.float16)
    narrow(f, h1, use_torch=True)
    narrow(f, h2, use_torch=False)
    assert h1.tobytes() == h2.tobytes()
    bf = np.empty(f.shape, BF16)
    narrow(f, bf)
    assert bf.tobytes() == f.astype(BF16).tobytes()


# ---- bad input: each raises ValueError naming the problem ----

def test_unknown_codec_name():
    with pytest.raises(ValueError, match="unknown codec 'int3'"):
        get_codec("int3")
    with pytest.raises(ValueError, match="unknown codec"):
        get_codec("int8+zstd")
    with pytest.raises(ValueError, match="takes no group_tokens"):
        get_codec("raw", group_tokens=8)
    with pytest.raises(ValueError, match="group_tokens 0"):
        get_codec("int8", group_tokens=0)


@pytest.mark.parametrize("name", ["raw", "int8", "fp8", "int4", "int8+lz4"])
def test_wrong_out_shape_and_dtype(name):
    x = kv_with_outliers((2, 16, 8), np.float16)
    codec = get_codec(name)
    data = codec.encode(x)
    with pytest.raises(ValueError, match="out shape"):
        codec.decode(data, np.empty((2, 8, 16), np.float16))
    with pytest.raises(ValueError, match="out dtype"):
        codec.decode(data, np.empty((2, 16, 8), np.float32))
    with pytest.raises(ValueError, match="read-only"):
        ro = np.empty_like(x)
        ro.flags.writeable = False
        codec.decode(data, ro)
    strided = np.zeros((2, 16, 16), np.float16)[:, :, ::2]
    if name == "raw":  # a raw payload is copied straight into a strided destination (an engine's KV slice)
        codec.decode(data, strided)
        np.testing.assert_array_equal(strided, x)
    else:
        with pytest.raises(ValueError, match="C-contiguous"):
            codec.decode(data, strided)


@pytest.mark.parametrize("name", ["raw", "int8", "fp8", "int4", "mixed", "int8+lz4", "raw+lz4"])
def test_every_truncation_is_rejected(name):
    x = kv_with_outliers((2, 2, 8, 8), np.float16)
    codec = get_codec(name)
    data = codec.encode(x)
    out = np.empty_like(x)
    for n in range(len(data)):
        with pytest.raises(ValueError):
            codec.decode(data[:n], out)
    with pytest.raises(ValueError, match="trailing|truncated|corrupt"):
        codec.decode(data + b"\0", out)


def test_payload_of_another_codec_is_rejected():
    x = kv_with_outliers((2, 16, 8), np.float16)
    with pytest.raises(ValueError, match="not int8"):
        get_codec("int8").decode(get_codec("fp8").encode(x), np.empty_like(x))
    with pytest.raises(ValueError, match="magic"):
        get_codec("raw").decode(b"\0" * 64, np.empty_like(x))


def test_bad_inputs_to_encode():
    with pytest.raises(ValueError, match="head_dim 7 must be even"):
        get_codec("int4").encode(np.zeros((4, 7), np.float16))
    with pytest.raises(ValueError, match=r"\[..., tokens, head_dim\]"):
        get_codec("int8").encode(np.zeros(8, np.float16))
    with pytest.raises(ValueError, match="no elements"):
        get_codec("int8").encode(np.zeros((0, 8), np.float16))
    with pytest.raises(ValueError, match="unsupported KV dtype int32"):
        get_codec("raw").encode(np.zeros((4, 8), np.int32))
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        get_codec("int8").encode(torch.zeros(4, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="unsupported array type list"):
        get_codec("int8").encode([[1.0]])
    bad = np.ones((4, 8), np.float16)
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match="NaN or infinite"):
        get_codec("int8").encode(bad)


# ---- lz4 stage ----

def test_lz4_stores_when_it_does_not_pay():
    x = np.random.default_rng(6).standard_normal((8, 64, 64)).astype(np.float16)
    data = get_codec("int8+lz4").encode(x)
    assert frame_mode(data) == MODE_STORED
    assert len(data) == len(get_codec("int8").encode(x)) + 16


def test_lz4_pays_on_padded_blocks_and_smooth_fp16():
    x = np.random.default_rng(7).standard_normal((8, 64, 64)).astype(np.float16)
    x[:, 40:] = 0  # a padded block: the last 24 tokens unused
    for name in ["raw", "int8", "int4"]:
        plain, packed = get_codec(name).encode(x), get_codec(name + "+lz4").encode(x)
        assert len(packed) < 0.8 * len(plain), name
        out = np.empty_like(x)
        get_codec(name + "+lz4").decode(packed, out)
    smooth = (np.random.default_rng(8).standard_normal((8, 64, 64)) * 0.01 + 1.0).astype(np.float16)
    packed = get_codec("raw+lz4").encode(smooth)
    assert frame_mode(packed) == MODE_SHUFFLE2_LZ4
    out = np.empty_like(smooth)
    get_codec("raw+lz4").decode(packed, out)
    assert out.tobytes() == smooth.tobytes()


def test_lz4_corrupt_body():
    x = np.zeros((8, 64, 64), np.float16)
    data = bytearray(get_codec("raw+lz4").encode(x))
    data[20:30] = b"\xff" * 10
    with pytest.raises(ValueError):
        get_codec("raw+lz4").decode(bytes(data), np.empty_like(x))


# ---- mixed precision ----

def test_mixed_policy_keeps_first_and_last_layers_raw_for_long_sequences():
    policy = MixedPrecisionPolicy(raw_layers=(0, -1), min_tokens=8192, base="int4")
    assert policy.layer_codecs(4, 8191) == ("int4",) * 4
    assert policy.layer_codecs(4, 8192) == ("raw", "int4", "int4", "raw")
    with pytest.raises(ValueError, match=r"raw_layers \[5\] out of range"):
        MixedPrecisionPolicy(raw_layers=(5,)).layer_codecs(4, 10_000)
    with pytest.raises(ValueError, match="base 'int5'"):
        MixedPrecisionPolicy(base="int5")


def test_mixed_codec_round_trip_per_layer():
    x = kv_with_outliers((4, 2, 2, 32, 16), np.float16)
    codec = get_codec("mixed", policy=MixedPrecisionPolicy(min_tokens=1000))
    data = codec.encode(x, seq_tokens=5000)
    assert [n for n, _ in codec.layer_payloads(data)] == ["raw", "int8", "int8", "raw"]
    out = np.empty_like(x)
    codec.decode(data, out)
    assert out[0].tobytes() == x[0].tobytes() and out[3].tobytes() == x[3].tobytes()
    assert 0 < rel_l2(out[1:3], x[1:3]) <= QUALITY_BOUND["int8"]
    assert codec_for_id(codec.codec_id).decode(data, np.empty_like(x)).tobytes() == out.tobytes()
    with pytest.raises(ValueError, match="does not have 4 layers"):
        codec.decode(data, np.empty((3, 2, 2, 32, 16), np.float16))
    with pytest.raises(ValueError, match=r"needs \[layers"):
        codec.encode(np.zeros((4, 8), np.float16))


@pytest.mark.parametrize("name", ["raw", "int8", "fp8", "int4"])
def test_encode_into_a_reused_buffer(name):
    codec = get_codec(name)
    x = kv_with_outliers((2, 2, 32, 16), np.float16)
    buf = bytearray(codec.encoded_size(x) + 100)
    n = codec.encode_into(x, buf)
    assert n == codec.encoded_size(x) and bytes(buf[:n]) == codec.encode(x)
    with pytest.raises(ValueError, match="output buffer has 10 bytes"):
        codec.encode_into(x, bytearray(10))
    with pytest.raises(ValueError, match="read-only"):
        codec.encode_into(x, bytes(n))


# ---- the fused CPU backend (numba) writes the reference's bytes ----

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["int8", "fp8", "int4"])
def test_fused_backend_matches_numpy_reference(name, dtype):
    from kvtier.kernels import quant_numba
    from kvtier.kernels.codec import HOST_BACKEND

    if not quant_numba.AVAILABLE:
        pytest.skip("numba is not installed: the NumPy reference is the only CPU backend")
    rng = np.random.default_rng(11)
    cases = [kv_with_outliers((3, 2, 70, 64), dtype, seed=1),                       # uneven last group
             (rng.standard_normal((2, 33, 16)) * 1e-6).astype(dtype),               # fp16 subnormal range
             np.clip(rng.standard_normal((2, 40, 8)) * 3e4, -65504, 65504).astype(dtype),  # near the fp16 top
             np.zeros((1, 5, 4), dtype)]
    codec = get_codec(name, group_tokens=32)
    assert HOST_BACKEND.fused
    for x in cases:
        fused = codec.encode(x)
        out_fused = np.empty_like(x)
        codec.decode(fused, out_fused)
        HOST_BACKEND.fused = False
        try:
            ref = codec.encode(x)
            out_ref = np.empty_like(x)
            codec.decode(ref, out_ref)
        finally:
            HOST_BACKEND.fused = True
        assert fused == ref
        assert out_fused.tobytes() == out_ref.tobytes()
    for special in (np.inf, -np.inf, np.nan):
        bad = kv_with_outliers((2, 40, 8), dtype)
        bad[1, 17, 3] = special
        with pytest.raises(ValueError, match="NaN or infinite"):
            codec.encode(bad)


def test_reference_backend_rejects_nan_too():
    from kvtier.kernels.codec import HOST_BACKEND

    bad = np.ones((4, 8), np.float16)
    bad[2, 3] = np.inf
    HOST_BACKEND.fused = False
    try:
        with pytest.raises(ValueError, match="NaN or infinite"):
            get_codec("int4").encode(bad)
    finally:
        HOST_BACKEND.fused = quant_numba_available()


def quant_numba_available():
    from kvtier.kernels import quant_numba

    return quant_numba.AVAILABLE


def _fused_and_reference(codec, x):
    """(payload, decoded) from the fused backend, then from the NumPy reference."""
    from kvtier.kernels.codec import HOST_BACKEND

    results = []
    for fused in (True, False):
        HOST_BACKEND.fused = fused
        try:
            payload = codec.encode(x)
            out = np.empty_like(x)
            codec.decode(payload, out)
        finally:
            HOST_BACKEND.fused = quant_numba_available()
        results.append((payload, out))
    return results


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["int8", "fp8", "int4"])
def test_fused_backend_matches_reference_on_extreme_inputs(name, dtype):
    """Every finite bit pattern of the input dtype, and tiny values whose 1 / scale overflows fp32."""
    if not quant_numba_available():
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(3)
    if dtype.itemsize == 2:
        bits = np.arange(1 << 16, dtype=np.uint16)
        finite = bits[(bits & 0x7FFF) < (0x7C00 if dtype == np.float16 else 0x7F80)]
        x = rng.permutation(finite)[: finite.size // 64 * 64].view(dtype).reshape(-1, 16, 4)
    else:
        u = rng.integers(0, 0x7F800000, 1 << 16, dtype=np.uint32) | (rng.integers(0, 2, 1 << 16, dtype=np.uint32) << 31)
        x = u.view(np.float32).reshape(-1, 16, 4)
    tiny = (rng.standard_normal((4, 50, 24)) * 1e-38).astype(dtype)
    for block in (x, tiny):
        for g in (1, 7, 32):
            with np.errstate(all="ignore"):
                (fz, out_f), (rf, out_r) = _fused_and_reference(get_codec(name, group_tokens=g), block)
            assert fz == rf
            assert out_f.tobytes() == out_r.tobytes()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["int8", "fp8", "int4"])
def test_fused_decode_of_arbitrary_value_bytes_matches_reference(name, dtype):
    """Any value byte decodes as the reference decodes it (e4m3 NaN codes 0x7F/0xFF included)."""
    if not quant_numba_available():
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(4)
    codec = get_codec(name, group_tokens=16)
    x = rng.standard_normal((3, 48, 32)).astype(dtype)
    data = bytearray(codec.encode(x))
    _, values = codec.parse(bytes(data)).views(data)
    values.view(np.uint8)[...] = rng.integers(0, 256, values.shape, dtype=np.uint8)
    outs = []
    for fused in (True, False):
        from kvtier.kernels.codec import HOST_BACKEND

        HOST_BACKEND.fused = fused
        try:
            out = np.empty_like(x)
            codec.decode(bytes(data), out)
        finally:
            HOST_BACKEND.fused = quant_numba_available()
        outs.append(out.tobytes())
    assert outs[0] == outs[1]


def test_fused_bit_conversions_are_exact():
    """The bit-operation conversions (used where the CPU lacks F16C) against NumPy / ml_dtypes."""
    from kvtier.kernels import quant_numba as qn

    if not qn.AVAILABLE:
        pytest.skip("numba is not installed")
    import numba

    @numba.njit
    def run(h16, f32, b8, out_w, out_n, out_bf, out_e, out_d):
        for i in range(h16.size):
            out_w[i] = qn.f16_to_f32_bits(h16[i])
        for i in range(f32.size):
            out_n[i] = qn.f32_to_f16_bits(f32[i])
            out_bf[i] = qn.f32_to_bf16(f32[i])
        for i in range(b8.size):
            out_d[i] = qn.e4m3_to_f32(b8[i])
        for i in range(f32.size):
            out_e[i] = qn.f32_to_e4m3(np.float32(min(448.0, max(-448.0, f32[i]))))

    rng = np.random.default_rng(5)
    h16 = np.arange(1 << 16, dtype=np.uint16)  # every fp16 bit pattern
    u = np.concatenate([np.arange(0, 1 << 32, 4099, dtype=np.uint64),
                        rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64)]).astype(np.uint32)
    f32 = u.view(np.float32)
    f32 = f32[np.isfinite(f32)]
    b8 = np.arange(256, dtype=np.uint8)
    out_w, out_n = np.empty(h16.size, np.float32), np.empty(f32.size, np.uint16)
    out_bf, out_e = np.empty(f32.size, np.uint16), np.empty(f32.size, np.uint8)
    out_d = np.empty(256, np.float32)
    run(h16, f32, b8, out_w, out_n, out_bf, out_e, out_d)
    widened = h16.view(np.float16).astype(np.float32)
    nan = np.isnan(widened)
    assert np.array_equal(out_w[~nan].view(np.uint32), widened[~nan].view(np.uint32))
    assert np.isnan(out_w[nan]).all()
    with np.errstate(over="ignore"):
        assert np.array_equal(out_n, f32.astype(np.float16).view(np.uint16))
    bf = np.empty(f32.size, BF16)
    narrow(f32, bf)
    assert np.array_equal(out_bf, bf.view(np.uint16))
    assert np.array_equal(out_d.view(np.uint32), b8.view(E4M3).astype(np.float32).view(np.uint32))
    clipped = np.clip(f32, -448, 448)
    assert np.array_equal(out_e, clipped.astype(E4M3).view(np.uint8))


def test_fused_backend_without_f16c_matches_reference(tmp_path):
    """The bit-operation path, compiled for a generic CPU (no F16C) in a subprocess, writes the same bytes."""
    import os
    import subprocess
    import sys

    if not quant_numba_available():
        pytest.skip("numba is not installed")
    script = r'''
import numpy as np, ml_dtypes
from kvtier.kernels import get_codec, quant_numba
from kvtier.kernels.codec import HOST_BACKEND
assert not quant_numba.F16C
rng = np.random.default_rng(6)
bits = np.arange(1 << 16, dtype=np.uint16)
allf16 = rng.permutation(bits[(bits & 0x7C00) != 0x7C00])[:63488].view(np.float16).reshape(-1, 16, 4)
normal = rng.standard_normal((3, 2, 70, 64)).astype(np.float32)
normal[..., 5] *= 20
for dtype in (np.float16, ml_dtypes.bfloat16, np.float32):
    for name in ("int8", "fp8", "int4"):
        codec = get_codec(name, group_tokens=32)
        for x in (normal.astype(dtype), allf16.astype(dtype)):
            got = []
            for fused in (True, False):
                HOST_BACKEND.fused = fused
                data = codec.encode(x)
                out = np.empty_like(x)
                codec.decode(data, out)
                got.append((data, out.tobytes()))
            assert got[0] == got[1], (name, dtype)
print("ok")
'''
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")
