"""Every CUDA kernel source compiles with NVRTC, on a machine without a GPU or driver."""
from __future__ import annotations

import pytest

pytest.importorskip("cupy")

from kvtier.kernels.cuda_sources import codec_kernel_names, codec_source, paged_kernel_names, paged_source  # noqa: E402
from kvtier.kernels.nvrtc_compile import KernelCompileError, compile_to_ptx  # noqa: E402


def test_codec_kernels_compile():
    ptx = compile_to_ptx(codec_source(), codec_kernel_names())
    assert len(ptx.kernel_names) == 18  # {quant, dequant} x {int8, fp8, int4} x {f16, bf16, f32}


def test_paged_kernels_compile():
    ptx = compile_to_ptx(paged_source(), paged_kernel_names())
    assert len(ptx.kernel_names) == 10  # {gather, scatter} x 1/2/4/8/16-byte words


def test_compile_error_carries_the_nvrtc_log():
    bad = 'extern "C" __global__ void k(float* x) { x[0] = not_declared; }'
    with pytest.raises(KernelCompileError, match='identifier "not_declared" is undefined'):
        compile_to_ptx(bad, ["k"])


def test_missing_kernel_is_reported():
    src = 'extern "C" __global__ void present(float* x) { x[0] = 1.0f; }'
    with pytest.raises(KernelCompileError, match=r"missing from the PTX: \['absent'\]"):
        compile_to_ptx(src, ["present", "absent"])


def test_every_kernel_the_drivers_launch_exists():
    from kvtier.kernels import quant_cupy
    from kvtier.kernels.cuda_sources import PAGED_WORDS

    names = set(codec_kernel_names())
    for dt in quant_cupy.DT_CODES.values():
        for kind in ("int8", "fp8", "int4"):
            assert {f"kv_quant_{kind}_{dt}", f"kv_dequant_{kind}_{dt}"} <= names
    paged = set(paged_kernel_names())
    assert {f"kv_paged_{op}_w{w}" for w in PAGED_WORDS for op in ("gather", "scatter")} == paged


def test_sources_include_no_headers():
    # NVRTC without a CUDA toolkit has no cuda_fp16.h: the kernels must not need one
    assert "#include" not in codec_source() and "#include" not in paged_source()
