"""Zero-copy views of caller arrays: NumPy, torch (CPU or CUDA) and CuPy.

Codecs work on two kinds of views:

* host: a ``numpy.ndarray`` sharing memory with the caller's array (torch CPU
  tensors through ``tensor.numpy()``; bf16 through an ``ml_dtypes.bfloat16``
  view of the int16 bits, since NumPy has no bf16 of its own);
* device: a ``cupy.ndarray`` sharing memory with the caller's CUDA array
  (``__cuda_array_interface__`` for CuPy, DLPack for torch CUDA tensors).

Only fp16, bf16 and fp32 KV data is accepted; anything else is a ``ValueError``
naming the dtype. torch and cupy are imported lazily: a storage node has neither.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
FP16 = np.dtype(np.float16)
FP32 = np.dtype(np.float32)

# dtype codes carried in the codec header (part of the payload format: never renumber)
DTYPE_CODES: dict[np.dtype, int] = {FP16: 1, BF16: 2, FP32: 3}
DTYPES_BY_CODE: dict[int, np.dtype] = {code: dt for dt, code in DTYPE_CODES.items()}


def dtype_code(dtype: np.dtype) -> int:
    """Header code of a KV dtype; ValueError for anything but fp16/bf16/fp32."""
    dt = np.dtype(dtype)
    if dt not in DTYPE_CODES:
        raise ValueError(f"unsupported KV dtype {dt}; expected float16, bfloat16 or float32")
    return DTYPE_CODES[dt]


def is_torch_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "is_cuda")


def _torch_host_view(t: Any) -> np.ndarray:
    import torch

    if t.dtype == torch.bfloat16:
        return t.detach().view(torch.int16).numpy().view(BF16)
    if t.dtype not in (torch.float16, torch.float32):
        raise ValueError(f"unsupported KV dtype {t.dtype}; expected float16, bfloat16 or float32")
    return t.detach().numpy()


def _torch_device_view(t: Any) -> Any:
    import cupy
    import torch

    if t.dtype == torch.bfloat16:
        # CuPy has no bf16 dtype: take the int16 bits, then relabel them as bf16 on the host side
        return cupy.from_dlpack(t.detach().view(torch.int16)).view(np.uint16), BF16
    if t.dtype not in (torch.float16, torch.float32):
        raise ValueError(f"unsupported KV dtype {t.dtype}; expected float16, bfloat16 or float32")
    arr = cupy.from_dlpack(t.detach())
    return arr, np.dtype(arr.dtype)


@dataclass(frozen=True)
class DeviceView:
    """A CuPy view of device memory plus the logical KV dtype (bf16 travels as uint16 bits)."""

    array: Any  # cupy.ndarray
    kv_dtype: np.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(n) for n in self.array.shape)


def is_device_array(x: Any) -> bool:
    """True for CuPy arrays and CUDA torch tensors (anything exposing CUDA memory)."""
    if is_torch_tensor(x):
        return bool(x.is_cuda)
    return hasattr(x, "__cuda_array_interface__")


def host_view(x: Any) -> np.ndarray:
    """A NumPy array sharing memory with ``x`` (NumPy array or CPU torch tensor)."""
    if isinstance(x, np.ndarray):
        arr = x
    elif is_torch_tensor(x):
        if x.is_cuda:
            raise ValueError("a CUDA tensor has no host view; use device_view")
        arr = _torch_host_view(x)
    else:
        raise ValueError(f"unsupported array type {type(x).__name__}; expected numpy, torch or cupy")
    dtype_code(arr.dtype)
    return arr


def device_view(x: Any) -> DeviceView:
    """A CuPy view sharing memory with ``x`` (CuPy array or CUDA torch tensor)."""
    import cupy

    if is_torch_tensor(x):
        arr, kv_dtype = _torch_device_view(x)
    elif isinstance(x, cupy.ndarray):
        arr, kv_dtype = x, np.dtype(x.dtype)
    elif hasattr(x, "__cuda_array_interface__"):
        arr = cupy.asarray(x)
        kv_dtype = np.dtype(arr.dtype)
    else:
        raise ValueError(f"unsupported device array type {type(x).__name__}")
    dtype_code(kv_dtype)
    return DeviceView(array=arr, kv_dtype=kv_dtype)
