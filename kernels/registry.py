"""``get_codec(name)``: the codec named in a block header, ready to use."""
from __future__ import annotations

from typing import Any

from kvtier.common import codec_ids
from .codec import DEFAULT_GROUP_TOKENS, QuantCodec, RawCodec
from .lz4stage import Lz4Codec
from .mixed import MixedCodec, MixedPrecisionPolicy


def get_codec(name: str, *, group_tokens: int | None = None,
              policy: MixedPrecisionPolicy | None = None) -> Any:
    """``raw``, ``int8``, ``fp8``, ``int4``, ``mixed``, each optionally ``+lz4``.

    ``group_tokens`` sets the scale group of the quantized codecs (defaults:
    DEFAULT_GROUP_TOKENS); ``policy`` configures ``mixed``. ValueError for an
    unknown name or a parameter the codec does not take.
    """
    codec_ids.codec_id(name)  # ValueError naming the known codecs
    base_name, _, stage = name.partition("+")
    if group_tokens is not None and base_name not in DEFAULT_GROUP_TOKENS and base_name != "mixed":
        raise ValueError(f"codec {base_name!r} takes no group_tokens")
    if policy is not None and base_name != "mixed":
        raise ValueError(f"codec {base_name!r} takes no policy")
    if base_name == "raw":
        base: Any = RawCodec()
    elif base_name == "mixed":
        base = MixedCodec(policy or MixedPrecisionPolicy(), group_tokens)
    else:
        base = QuantCodec(base_name, DEFAULT_GROUP_TOKENS[base_name] if group_tokens is None else group_tokens)
    return Lz4Codec(base) if stage else base


def codec_for_id(cid: int, **params: Any) -> Any:
    """The codec for a block header's codec id (group size and policy travel in the payload)."""
    return get_codec(codec_ids.codec_name(cid), **params)
