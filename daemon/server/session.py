"""What the data server knows about one connection, and what its current request holds."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Session:
    """One connection: its peer, its HELLO, and the buffers its current request borrowed."""

    peer: str
    greeted: bool = False  # its HELLO succeeded (with the token, when one is configured)
    authenticated: bool = False
    client_name: str = ""
    get_arena: memoryview | None = None  # borrowed from ReplyArenas for one request (its PUT payload or its
    # GET reply's blocks); given back once the reply is sent
    transient_bytes: int = 0  # this request's buffers outside the arenas (within the daemon-wide budget)
    transient_buffers: list = field(default_factory=list)  # the buffers lent for that room (GET replies)
    nixl: Any = None  # this connection's NIXL peer (kvtier.daemon.nixl.service.NixlPeer), set by NIXL_METADATA
    peer_gone: Callable[[], bool] | None = None  # whether the peer has shut down its side or closed (no blocking)
    put_reservation: Any = None  # the engine's Reservation this request's PUT payload is received into
    # (committed by the handler; aborted by the connection if the request ends any other way)
