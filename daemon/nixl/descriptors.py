"""Where a NIXL_GET may write and a NIXL_PUT may read (pure, no I/O): a client's declared regions
and its descriptors.

A client declares the regions it registered with its NIXL agent (NIXL_METADATA);
every descriptor of a NIXL_GET must lie inside one of them, not overlap another
descriptor of the same request, and hold the block it is for. All of it is
checked before any transfer is posted, so a refused request writes nothing::

    regions      [=========== region 0 ===========]      [==== region 1 ====]
    descriptors     [d0 ][  d1  ]   [d2]                     [ d3    ]
    blocks          [b0]  [ b1  ]   (miss)                   [ b3 ]        len(b) <= capacity(d)
"""
from __future__ import annotations

import bisect
from typing import Sequence


class DescriptorError(ValueError):
    """A NIXL_GET descriptor the daemon refuses to write to; the message names it."""


class ClientRegions:
    """A client's registered destination regions, sorted and checked not to overlap."""

    def __init__(self, regions: Sequence[tuple[int, int]]):
        ordered = sorted((int(a), int(n)) for a, n in regions)
        for index, (address, length) in enumerate(ordered):
            if length <= 0 or address <= 0:
                raise DescriptorError(f"region of {length} bytes at {address:#x} is empty or at address 0")
            if index and ordered[index - 1][0] + ordered[index - 1][1] > address:
                raise DescriptorError(f"regions at {ordered[index - 1][0]:#x} and {address:#x} overlap")
        self._starts = [a for a, _ in ordered]
        self._regions = ordered

    def __len__(self) -> int:
        return len(self._regions)

    @property
    def total_bytes(self) -> int:
        return sum(n for _, n in self._regions)

    def contains(self, address: int, length: int) -> bool:
        """Whether ``[address, address + length)`` lies inside one region."""
        i = bisect.bisect_right(self._starts, address) - 1
        if i < 0:
            return False
        start, size = self._regions[i]
        return address + length <= start + size


def check_descriptors(regions: ClientRegions, descriptors: Sequence[tuple[int, int]], what: str = "descriptor",
                      overlap_ok: bool = False) -> None:
    """Every descriptor (or scatter extent: ``what``) inside a region, none empty, none overlapping
    another unless ``overlap_ok`` (the extents a NIXL_PUT reads from) (DescriptorError)."""
    for index, (address, capacity) in enumerate(descriptors):
        if capacity <= 0:
            raise DescriptorError(f"{what} {index}: capacity of {capacity} bytes")
        if not regions.contains(address, capacity):
            raise DescriptorError(f"{what} {index}: {capacity} bytes at {address:#x} are outside every region "
                                  f"this connection declared ({len(regions)} regions)")
    if overlap_ok:
        return
    ordered = sorted(range(len(descriptors)), key=lambda i: descriptors[i][0])
    for before, after in zip(ordered, ordered[1:]):
        if descriptors[before][0] + descriptors[before][1] > descriptors[after][0]:
            raise DescriptorError(f"{what}s {before} and {after} overlap")


def check_fits(descriptors: Sequence[tuple[int, int]], lengths: Sequence[int]) -> None:
    """Each block (``lengths[i]`` bytes; 0 for a miss) fits its descriptor (DescriptorError)."""
    for index, ((address, capacity), length) in enumerate(zip(descriptors, lengths)):
        if length > capacity:
            raise DescriptorError(f"descriptor {index}: {capacity} bytes at {address:#x} cannot hold its block of "
                                  f"{length} bytes (wrong length)")
