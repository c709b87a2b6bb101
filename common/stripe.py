"""RAID0 address mapping, shared by the daemon's striping and the client's
direct reader (pure, no I/O).

The logical space is cut into stripe units dealt round-robin over the
devices; each device keeps its first ``data_offset`` bytes for the superblock::

    logical:  | u0 | u1 | u2 | u3 | u4 | u5 | ...
    dev 0:    [super] u0 u2 u4 ...
    dev 1:    [super] u1 u3 u5 ...
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StripeGeometry:
    device_ids: tuple[str, ...]
    stripe_size_bytes: int
    data_offset_bytes: int
    device_data_bytes: int  # usable bytes per device after data_offset

    def __post_init__(self) -> None:
        if not self.device_ids:
            raise ValueError("a stripe set needs at least one device")
        if self.stripe_size_bytes <= 0 or self.stripe_size_bytes % 4096:
            raise ValueError(f"stripe size must be a positive multiple of 4096, got {self.stripe_size_bytes}")
        if self.device_data_bytes % self.stripe_size_bytes:
            raise ValueError("usable bytes per device must be a whole number of stripe units")

    @property
    def logical_size_bytes(self) -> int:
        return self.device_data_bytes * len(self.device_ids)

    def map_range(self, logical_offset: int, length: int) -> list[tuple[int, int, int]]:
        """``[(device_index, device_offset, length), ...]`` covering the range, in order."""
        if logical_offset < 0 or length < 0 or logical_offset + length > self.logical_size_bytes:
            raise ValueError(
                f"range {logical_offset}+{length} is outside the logical space of {self.logical_size_bytes} bytes")
        n = len(self.device_ids)
        unit = self.stripe_size_bytes
        pieces: list[tuple[int, int, int]] = []
        pos, end = logical_offset, logical_offset + length
        while pos < end:
            stripe, within = divmod(pos, unit)
            take = min(unit - within, end - pos)
            dev = stripe % n
            dev_off = self.data_offset_bytes + (stripe // n) * unit + within
            if pieces and pieces[-1][0] == dev and pieces[-1][1] + pieces[-1][2] == dev_off:
                d, o, l = pieces[-1]
                pieces[-1] = (d, o, l + take)
            else:
                pieces.append((dev, dev_off, take))
            pos += take
        return pieces
