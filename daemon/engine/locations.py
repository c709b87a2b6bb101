"""Where a block lives in the striped logical space, for callers that read it directly."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BlockLocation:
    """Where a block lives in the striped logical space (for direct reads)."""

    logical_offset: int
    length: int
    seq: int
    sealed: bool


# One row per key of ``Engine.locate_buffer``: the fields of :class:`BlockLocation` plus ``found``
# (a row with found=False is all zeros). Fixed little-endian layout, so it can go on the wire as is.
LOCATION_DTYPE = np.dtype([("logical_offset", "<u8"), ("seq", "<u8"), ("length", "<u4"),
                           ("found", "?"), ("sealed", "?"), ("_pad", "V2")])
assert LOCATION_DTYPE.itemsize == 24, LOCATION_DTYPE.itemsize
