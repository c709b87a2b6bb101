"""What can go wrong talking to the upstream. Each is a miss for the caller, counted by its kind."""
from __future__ import annotations

import enum


class FailureKind(enum.Enum):
    """The kinds counted in ``UpstreamStatistics.failures`` (and the metric's ``kind`` label)."""

    TIMEOUT = "timeout"  # no answer within --upstream-timeout-ms (connect, pool wait or reply)
    UNAVAILABLE = "unavailable"  # connection refused or lost, no member to ask
    AUTH = "auth"  # the upstream refused our token
    PROTOCOL = "protocol"  # an error reply, or bytes that break the protocol
    CORRUPT = "corrupt"  # a block that failed verification (header or payload CRC, key, namespace)


class UpstreamError(Exception):
    """Base: the upstream could not answer this request."""

    kind = FailureKind.UNAVAILABLE


class UpstreamTimeout(UpstreamError):
    kind = FailureKind.TIMEOUT


class UpstreamUnavailable(UpstreamError):
    kind = FailureKind.UNAVAILABLE


class UpstreamAuthError(UpstreamError):
    kind = FailureKind.AUTH


class UpstreamProtocolError(UpstreamError):
    """An ERROR reply (``code`` is its ErrorCode) or a protocol violation by the upstream."""

    kind = FailureKind.PROTOCOL

    def __init__(self, code, message: str):
        super().__init__(f"{getattr(code, 'name', code)}: {message}")
        self.code = code
