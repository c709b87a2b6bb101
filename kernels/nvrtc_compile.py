"""Compile CUDA sources with NVRTC directly, without a GPU or a driver.

CuPy's own ``compile_using_nvrtc`` asks the runtime for the current device's
compute capability first, which fails with ``cudaErrorInsufficientDriver`` on a
machine without a driver. ``cupy.cuda.nvrtc`` (the NVRTC bindings; NVRTC is a
plain library, shipped as nvidia-cuda-nvrtc-cu12) needs no driver, so CI
compiles every kernel to PTX here and a syntax or type error fails the build.
"""
from __future__ import annotations

from dataclasses import dataclass

CHECK_ARCH = "compute_80"  # Ampere: the oldest GPU generation kvtier targets (bf16 native)


class KernelCompileError(RuntimeError):
    """NVRTC rejected a source; the message carries NVRTC's log."""


@dataclass(frozen=True)
class CompiledPtx:
    ptx: str
    kernel_names: tuple[str, ...]


def compile_to_ptx(source: str, kernel_names: list[str], *, arch: str = CHECK_ARCH,
                   filename: str = "kvtier_kernels.cu") -> CompiledPtx:
    """PTX of ``source``; KernelCompileError with the NVRTC log on failure, or when a kernel is missing."""
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(source, filename, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [f"-arch={arch}", "-std=c++17"])
        except nvrtc.NVRTCError as exc:
            raise KernelCompileError(f"{filename}: {exc}\n{nvrtc.getProgramLog(prog)}") from exc
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    text = ptx.decode() if isinstance(ptx, bytes) else ptx
    missing = [n for n in kernel_names if f".entry {n}(" not in text]
    if missing:
        raise KernelCompileError(f"{filename}: kernels missing from the PTX: {missing}")
    return CompiledPtx(text, tuple(kernel_names))
