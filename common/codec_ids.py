"""Codec ids carried in the block header (part of the block format, so shared with the daemon).

The low byte names the base codec; ``LZ4_FLAG`` marks an lz4 stage after it.
Ids are part of the on-disk format: never renumber, only add.
"""
from __future__ import annotations

BASE_CODEC_IDS: dict[str, int] = {
    "raw": 1,
    "int8": 2,
    "fp8": 3,
    "int4": 4,
    "mixed": 5,  # per-layer codecs, see kvtier.kernels.mixed
}
LZ4_FLAG = 0x100
OPAQUE_CODEC_ID = 0  # bytes that no codec produced (kvperf, raw puts from the CLI)


def codec_id(name: str) -> int:
    """``"int8+lz4"`` -> ``0x102``; ValueError for an unknown name."""
    base, _, stage = name.partition("+")
    if base not in BASE_CODEC_IDS or stage not in ("", "lz4"):
        raise ValueError(f"unknown codec {name!r}; known: {sorted(BASE_CODEC_IDS)} with optional '+lz4'")
    return BASE_CODEC_IDS[base] | (LZ4_FLAG if stage else 0)


def codec_name(cid: int) -> str:
    """Inverse of :func:`codec_id`; ``"opaque"`` for id 0."""
    if cid == OPAQUE_CODEC_ID:
        return "opaque"
    base = cid & 0xFF
    for name, value in BASE_CODEC_IDS.items():
        if value == base and cid & ~(0xFF | LZ4_FLAG) == 0:
            return name + ("+lz4" if cid & LZ4_FLAG else "")
    raise ValueError(f"unknown codec id {cid:#x}")
