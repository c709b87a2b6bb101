"""One authenticated connection to the upstream daemon, every call bounded by a deadline.

The driver is :class:`kvtier.wire.channel.Channel`; this gives each blocking send and receive
what is left of the caller's deadline and names every failure in the upstream's terms. A channel
that failed in any way (a timeout mid-reply included) is closed, never reused.
"""
from __future__ import annotations

import socket
import time

from kvtier.wire import connection as p
from kvtier.wire.channel import Channel as WireChannel

from .errors import UpstreamAuthError, UpstreamProtocolError, UpstreamTimeout, UpstreamUnavailable


def remaining_s(deadline: float) -> float:
    """Seconds left until ``deadline`` (a ``time.monotonic()`` value); UpstreamTimeout when none."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise UpstreamTimeout("the upstream did not answer within the timeout")
    return left


class Channel(WireChannel):
    """A connection that has said HELLO (with the upstream token) and holds the upstream's HELLO document."""

    def __init__(self, host: str, port: int, token: str | None, client_name: str, deadline: float):
        remaining_s(deadline)
        try:
            super().__init__(host, port, 0, token, client_name, deadline)
        except p.RemoteError as exc:
            if exc.code == p.ErrorCode.AUTH:
                raise UpstreamAuthError(f"the upstream {host}:{port} refused our token: {exc}") from None
            raise UpstreamProtocolError(exc.code, exc.message) from None
        except p.ProtocolError as exc:
            raise UpstreamProtocolError(exc.code, f"the upstream broke the protocol: {exc}") from None
        except p.ConnectionLost:
            raise UpstreamUnavailable(f"the upstream {host}:{port} closed the connection") from None
        except socket.timeout:
            raise UpstreamTimeout(f"connecting to the upstream {host}:{port} timed out") from None
        except OSError as exc:
            raise UpstreamUnavailable(f"cannot connect to the upstream {host}:{port}: {exc}") from None

    @property
    def features(self) -> tuple[str, ...]:
        return tuple(self.info.get("features", ()))

    def exchange(self, messages: list, deadline: float) -> list:
        """Pipeline ``messages`` and return their replies in order, all before ``deadline``.
        An ERROR reply raises UpstreamProtocolError (with its code) once every reply is read."""
        try:
            return super().exchange(messages, deadline=deadline)
        except p.RemoteError as exc:
            raise UpstreamProtocolError(exc.code, exc.message) from None
        except socket.timeout:
            raise UpstreamTimeout("the upstream did not answer within the timeout") from None
        except p.ConnectionLost:
            raise UpstreamUnavailable("the upstream closed the connection") from None
        except p.ProtocolError as exc:
            if self.conn.peer_closed:
                raise UpstreamUnavailable("the upstream closed the connection mid-reply") from None
            raise UpstreamProtocolError(exc.code, f"the upstream broke the protocol: {exc}") from None
        except OSError as exc:
            raise UpstreamUnavailable(f"the upstream connection failed: {exc}") from None
