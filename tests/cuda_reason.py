"""Why CUDA tests cannot run here, or None when they can (shared by the GPU-marked tests)."""


def cuda_skip_reason() -> str | None:
    try:
        import cupy
    except ImportError:
        return "cupy is not installed"
    if not cupy.cuda.is_available():
        return "no CUDA device (cupy.cuda.is_available() is False)"
    import torch
    if not torch.cuda.is_available():
        return "torch has no CUDA"
    return None
