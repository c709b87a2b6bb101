"""The engine's exception tree.

Expected outcomes (a miss, a present key) are return values; these are for
caller errors and for conditions the caller must act on.

    EngineError            base: a request the engine cannot serve
    +-- NoSpaceError       every region is pinned; nothing can be evicted
    |   +-- PinLimitError  a PIN past the pinned-bytes limit (pinned_fraction_max)
    +-- GeometryError      devices do not match the store's superblocks
    +-- DeviceError        a device read/write/sync failed (names the device)
    +-- EngineFailedError  the engine failed closed after an unexpected exception (Engine.fail)
    |   +-- EngineBugError the call that found that exception
    +-- BadArgumentError   a caller's argument the engine cannot take (also a ValueError)
    +-- WaitTimeoutError   a wait inside the engine ran past its bound (names what it waited for)

Any other exception raised inside the engine is a bug in its state: the engine fails closed
(:meth:`Engine.fail`) and the caller gets EngineFailedError.
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


class EngineBugError(EngineFailedError):
    """The call in which an unexpected exception (a bug in engine state) failed the engine closed."""


class BadArgumentError(EngineError, ValueError):
    """An argument the engine cannot take (a key of the wrong size, a read-only buffer); nothing changed."""


class WaitTimeoutError(EngineError):
    """A wait inside the engine (for a clean region, for the PUT being received in place) ran past
    its bound; the message names what it waited for. Nothing changed: the caller may try again."""
