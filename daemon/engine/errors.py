"""The engine's exception tree.

Expected outcomes (a miss, a present key) are return values; these are for
caller errors and for conditions the caller must act on.

    EngineError            base: a request the engine cannot serve
    +-- NoSpaceError       every region is pinned; nothing can be evicted
    |   +-- PinLimitError  a PIN past the pinned-bytes limit (pinned_fraction_max)
    +-- GeometryError      devices do not match the store's superblocks
    +-- DeviceError        a device read/write/sync failed (names the device)
    +-- EngineFailedError  the engine failed closed after an unexpected exception (Engine.fail)
"""
from __future__ import annotations


class EngineError(Exception):
    """A request the engine cannot serve; the message names the problem."""


class NoSpaceError(EngineError):
    """Every region is pinned (or holds too many pinned bytes to reclaim)."""


class PinLimitError(NoSpaceError):
    """A PIN that would take the pinned bytes past ``pinned_fraction_max`` of the capacity."""


class GeometryError(EngineError):
    """The configured devices do not match the store on them."""


class BlockTooLargeError(EngineError):
    """A block larger than a region can hold."""


class DeviceError(EngineError):
    """A device I/O failed; the message names the device and the operation."""


class EngineFailedError(EngineError):
    """The engine failed closed (an unexpected exception earlier); it serves nothing more."""
