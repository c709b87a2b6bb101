"""What the data server knows about one connection, and what its current request holds."""
from __future__ import annotations

from dataclasses import dataclass


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
