"""CuPy kernels against the NumPy reference: identical payload bytes, identical decoded bytes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cuda_reason import cuda_skip_reason
from kvtier.kernels import get_codec


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_skip_reason() is not None, reason=str(cuda_skip_reason()))]

SHAPES = [(2, 2, 4, 64, 128), (3, 17, 64), (1, 1, 8), (5, 300, 96)]


def _host(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape, dtype=np.float32)
    x[..., rng.choice(shape[-1], 2, replace=False)] *= 20
    return x


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("tdtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name", ["raw", "int8", "fp8", "int4", "int8+lz4"])
def test_torch_cuda_matches_reference(name, tdtype, shape):
    if name.endswith("+lz4"):
        pytest.importorskip("lz4")
    x = torch.from_numpy(_host(shape, np.float32, 1)).to(tdtype)
    codec = get_codec(name, group_tokens=None if name.startswith("raw") else 16)
    ref = codec.encode(x)
    got = codec.encode(x.cuda())
    assert got == ref
    out_cpu = torch.empty_like(x)
    codec.decode(ref, out_cpu)
    out_gpu = torch.empty_like(x, device="cuda")
    codec.decode(ref, out_gpu)
    torch.cuda.synchronize()
    assert torch.equal(out_gpu.cpu().view(torch.uint8), out_cpu.view(torch.uint8))


@pytest.mark.parametrize("name", ["int8", "fp8", "int4"])
def test_cupy_arrays(name):
    import cupy

    x = _host((4, 32, 64), np.float32, 2).astype(np.float16)
    codec = get_codec(name)
    assert codec.encode(cupy.asarray(x)) == codec.encode(x)
    out = cupy.empty(x.shape, cupy.float16)
    codec.decode(codec.encode(x), out)
    ref = np.empty_like(x)
    codec.decode(codec.encode(x), ref)
    assert out.get().tobytes() == ref.tobytes()


def test_gpu_rejects_nan_and_bad_out():
    x = torch.ones(4, 8, dtype=torch.float16, device="cuda")
    x[1, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        get_codec("int8").encode(x)
    data = get_codec("int8").encode(torch.ones(4, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="out dtype"):
        get_codec("int8").decode(data, torch.empty(4, 8, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="C-contiguous"):
        get_codec("int8").decode(data, torch.empty(8, 4, dtype=torch.float16, device="cuda").t())


def test_kernels_run_on_torchs_current_stream():
    import cupy

    from kvtier.kernels.quant_cupy import torch_stream_of

    side = torch.cuda.Stream()
    x = torch.from_numpy(_host((2, 64, 128), np.float32, 3)).to(torch.float16).cuda()
    with torch.cuda.stream(side):
        with torch_stream_of(x):
            assert cupy.cuda.get_current_stream().ptr == side.cuda_stream
        codec = get_codec("int8", group_tokens=16)
        data = codec.encode(x)
        out = torch.empty_like(x)
        codec.decode(data, out)
    side.synchronize()
    ref = torch.empty_like(x.cpu())
    codec.decode(data, ref)
    assert torch.equal(out.cpu().view(torch.uint8), ref.view(torch.uint8))
