"""fp16/bf16 <-> fp32 conversion of host arrays, exact IEEE (round-to-nearest-even).

NumPy's float16 casts are scalar loops; torch's CPU casts are
vectorized (F16C) and produce the same bits, so torch is used when importable and
NumPy otherwise. bf16 goes through integer bit operations (exact, vectorized).
The quantized codecs spend most of their CPU time here.
"""
from __future__ import annotations

import warnings

import numpy as np

from .arrays import BF16, FP16, FP32

TORCH_SERIAL_ELEMENTS = 1 << 15  # torch copies up to 32768 elements on the calling thread; its pool stalls on busy hosts

try:  # optional: a storage node has no torch
    import torch as _torch
except ImportError:  # pragma: no cover - exercised on torch-less installs
    _torch = None


def _torch_copy(src: np.ndarray, dst: np.ndarray) -> None:
    """dst[:] = src (1-D, converting), in pieces small enough for torch to stay on this thread."""
    if src.flags.writeable:
        ts = _torch.from_numpy(src)
    else:  # a payload view; torch only reads it here, so its "not writable" warning is noise
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            ts = _torch.from_numpy(src)
    td = _torch.from_numpy(dst)
    for i in range(0, src.size, TORCH_SERIAL_ELEMENTS):
        td[i:i + TORCH_SERIAL_ELEMENTS].copy_(ts[i:i + TORCH_SERIAL_ELEMENTS])


def widen(src: np.ndarray, dst: np.ndarray, *, use_torch: bool = True) -> None:
    """dst (fp32) = src (fp16, bf16 or fp32), same shape, both C-contiguous."""
    if src.dtype == BF16:
        np.left_shift(src.view(np.uint16), 16, out=dst.view(np.uint32), dtype=np.uint32)
    elif src.dtype == FP16 and use_torch and _torch is not None and src.flags.c_contiguous and dst.flags.c_contiguous:
        _torch_copy(src.reshape(-1), dst.reshape(-1))
    else:
        np.copyto(dst, src, casting="unsafe")


def narrow(src: np.ndarray, dst: np.ndarray, *, use_torch: bool = True) -> None:
    """dst (fp16, bf16 or fp32) = RNE(src fp32); src must be finite for bf16."""
    if dst.dtype == BF16:
        u = src.view(np.uint32)
        lsb = np.bitwise_and(np.right_shift(u, 16), np.uint32(1))
        lsb += np.uint32(0x7FFF)
        lsb += u
        np.right_shift(lsb, 16, out=dst.view(np.uint16), casting="unsafe")
    elif dst.dtype == FP16 and use_torch and _torch is not None and src.flags.c_contiguous and dst.flags.c_contiguous:
        _torch_copy(src.reshape(-1), dst.reshape(-1))
    else:
        np.copyto(dst, src, casting="unsafe")


assert FP32.itemsize == 4

