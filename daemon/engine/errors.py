"""The engine's exception tree.

Expected outcomes (a miss, a present key) are return values; these are for
caller errors and for conditions the caller must act on.

    EngineError            base: a request the engine cannot serve
    +-- NoSpaceError       every region is pinned; nothing can be evicted
    +-- GeometryError      devices do not match the store's superblocks
    +-- DeviceError        a device read/write/sync failed (names the device)
"""
from __future__ import annotations


class EngineError(Exception):
    """A request the engine cannot serve; the message names the problem."""


class NoSpaceError(EngineError):
    """Every region is pinned (or holds too many pinned bytes to reclaim)."""


class GeometryError(EngineError):
    """The configured devices do not match the store on them."""


class BlockTooLargeError(EngineError):
    """A block larger than a region can hold."""


class DeviceError(EngineError):
    """A device I/O failed; the message names the device and the operation."""
