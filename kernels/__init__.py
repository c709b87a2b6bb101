"""kvtier.kernels: KV codecs (NumPy reference, CuPy kernels) and paged gather/scatter.

    from kvtier.kernels import get_codec
    codec = get_codec("int8")            # raw | int8 | fp8 | int4 | mixed, optionally "+lz4"
    payload = codec.encode(kv_block)     # bytes; the block header carries codec.codec_id
    codec.decode(payload, out)           # fills out (same dtype and shape), returns it

Heavy imports (torch, cupy) stay lazy. The codec ids the block header carries are
part of the block format: :mod:`kvtier.common.codec_ids`.
"""
from __future__ import annotations

import importlib

from kvtier.common.codec_ids import codec_id, codec_name

# name -> submodule, loaded on first use: importing the package pulls in no kernels,
# numba or ml_dtypes.
_LAZY = {
    "MixedCodec": "mixed",
    "MixedPrecisionPolicy": "mixed",
    "codec_for_id": "registry",
    "get_codec": "registry",
}

__all__ = ["MixedCodec", "MixedPrecisionPolicy", "codec_for_id", "codec_id", "codec_name", "get_codec"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
