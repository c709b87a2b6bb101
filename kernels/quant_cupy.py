"""Codecs on CUDA arrays: the kernels of cuda_sources.py driven from CuPy.

Same payload bytes as the NumPy reference (quant_ref.py); tested under the
``gpu`` marker and checked at scale by perf/gpu_check.py. Inputs are CuPy
arrays or CUDA torch tensors, viewed without copies (arrays.device_view).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import numpy as np

from .arrays import BF16, FP16, FP32, is_torch_tensor, device_view, dtype_code
from .codec import QuantLayout, check_block_shape, check_length, check_out
from .cuda_sources import codec_kernel_names, codec_source
from .payload import PayloadHeader
from .quant_ref import num_groups

THREADS_PER_BLOCK = 256  # a common occupancy sweet spot; the kernels use no shared memory
DT_CODES = {FP16: "f16", BF16: "bf16", FP32: "f32"}


@functools.lru_cache(maxsize=1)
def _module() -> Any:
    import cupy

    return cupy.RawModule(code=codec_source(), options=("-std=c++17",), name_expressions=None)


def kernel(name: str) -> Any:
    assert name in codec_kernel_names(), name
    return _module().get_function(name)


def _launch(name: str, threads: int, args: tuple) -> None:
    blocks = (threads + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK
    kernel(name)((blocks,), (THREADS_PER_BLOCK,), args)


@contextlib.contextmanager
def torch_stream_of(*arrays: Any) -> Iterator[None]:
    """CuPy's work in the body runs on the CUDA stream torch uses for the first torch
    tensor among ``arrays`` (its current stream on that device), so it is ordered with
    the engine's own kernels; with no torch tensor, on CuPy's current stream."""
    tensor = next((a for a in arrays if is_torch_tensor(a) and a.is_cuda), None)
    if tensor is None:
        yield
        return
    import cupy
    import torch

    device = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    with cupy.cuda.Device(device), cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream, device):
        yield


def _contiguous_in(x: Any) -> tuple[Any, np.dtype]:
    import cupy

    v = device_view(x)
    return cupy.ascontiguousarray(v.array), v.kv_dtype


def _device_out(out: Any) -> tuple[Any, np.dtype]:
    v = device_view(out)
    if not v.array.flags.c_contiguous:
        raise ValueError("out must be C-contiguous")
    return v.array, v.kv_dtype


def _encode_raw_device(x: Any) -> bytes:
    arr, kv_dtype = _contiguous_in(x)
    check_block_shape(tuple(arr.shape))
    header = PayloadHeader(1, dtype_code(kv_dtype), tuple(int(n) for n in arr.shape))
    return header.pack() + arr.get().tobytes()


def _decode_raw_device(header: PayloadHeader, data: bytes | memoryview, out: Any) -> Any:
    import cupy

    arr, kv_dtype = _device_out(out)
    check_out(header, kv_dtype, tuple(arr.shape))
    check_length(len(data), header.size_bytes + arr.nbytes, "raw")
    host = np.frombuffer(data, np.uint8, arr.nbytes, header.size_bytes)
    arr.view(cupy.uint8).reshape(-1)[...] = cupy.asarray(host)
    return out


def _encode_quant_device(codec: Any, x: Any) -> bytes:
    """One fused kernel: per (row, group, channel) absmax then quantize; one D2H copy of the result."""
    import cupy

    arr, kv_dtype = _contiguous_in(x)
    lay: QuantLayout = codec.layout(tuple(int(n) for n in arr.shape), kv_dtype)
    dev = cupy.empty(lay.scale_bytes + lay.value_bytes, cupy.uint8)
    g = lay.header.group_tokens
    per_thread = 2 if codec.name == "int4" else 1
    threads = lay.b * num_groups(lay.t, g) * (lay.d // per_thread)
    _launch(f"kv_quant_{codec.name}_{DT_CODES[kv_dtype]}", threads,
            (arr, dev[: lay.scale_bytes], dev[lay.scale_bytes:], np.int64(lay.b), np.int32(lay.t),
             np.int32(lay.d), np.int32(g)))
    scales = dev[: lay.scale_bytes].view(cupy.uint16 if lay.scale_dtype == FP16 else cupy.uint32)
    exp_mask = 0x7C00 if lay.scale_dtype == FP16 else 0x7F800000
    if bool(((scales & exp_mask) == exp_mask).any()):
        raise ValueError("input has NaN or infinite values; quantized codecs need finite data")
    host = bytearray(lay.total_bytes)
    host[: lay.header.size_bytes] = lay.header.pack()
    dev.get(out=np.frombuffer(host, np.uint8, dev.size, lay.header.size_bytes))
    return bytes(host)


def _decode_quant_device(codec: Any, lay: QuantLayout, data: bytes | memoryview, out: Any) -> Any:
    import cupy

    arr, kv_dtype = _device_out(out)
    check_out(lay.header, kv_dtype, tuple(arr.shape))
    body = cupy.asarray(np.frombuffer(data, np.uint8, lay.scale_bytes + lay.value_bytes, lay.header.size_bytes))
    per_thread = 2 if codec.name == "int4" else 1
    threads = lay.b * lay.t * (lay.d // per_thread)
    _launch(f"kv_dequant_{codec.name}_{DT_CODES[kv_dtype]}", threads,
            (body[lay.scale_bytes:], body[: lay.scale_bytes], arr, np.int64(lay.b), np.int32(lay.t),
             np.int32(lay.d), np.int32(lay.header.group_tokens)))
    return out


def encode_raw_device(x: Any) -> bytes:
    with torch_stream_of(x):
        return _encode_raw_device(x)


def decode_raw_device(header: PayloadHeader, data: bytes | memoryview, out: Any) -> Any:
    with torch_stream_of(out):
        return _decode_raw_device(header, data, out)


def encode_quant_device(codec: Any, x: Any) -> bytes:
    with torch_stream_of(x):
        return _encode_quant_device(codec, x)


def decode_quant_device(codec: Any, lay: QuantLayout, data: bytes | memoryview, out: Any) -> Any:
    with torch_stream_of(out):
        return _decode_quant_device(codec, lay, data, out)
