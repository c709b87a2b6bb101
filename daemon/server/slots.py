"""Connection slots: who may hold one of the data port's ``max_connections`` (pure: no sockets).

A connection takes a slot at accept, subject to ``max_connections_per_peer`` for its address.
When every slot is taken, a newcomer is let in *over* the limit (at most ``overflow_max`` at a
time; they must greet within the HELLO timeout): once its HELLO succeeds it takes the slot of
the greeted connection that has gone longest without work -- a request other than PING --
which is closed; if every greeted connection is in a request, the newcomer is refused BUSY.
So clients that keep connections open and PING inside the idle timeout cannot hoard the port:
a client with work to do gets in.

The daemon has one token, so there is no per-token limit: a per-tenant limit needs per-tenant
tokens.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

OVERFLOW_MAX = 64  # connections over max_connections waiting to greet (and take an idle one's slot)


@dataclass(eq=False)
class Slot:
    """One connection's hold on the port."""

    host: str
    last_work: float  # when its last request other than PING ended (or it opened)
    over: bool = False  # admitted past max_connections: it needs an idle slot once it greets
    greeted: bool = False
    in_request: bool = False
    evicted: bool = False  # closed to make room for a newcomer: its loop ends at the next wake
    wake: Callable[[], None] = field(default=lambda: None, repr=False)  # makes its loop see ``evicted``


class ConnectionSlots:
    def __init__(self, max_connections: int, max_per_peer: int, overflow_max: int = OVERFLOW_MAX,
                 clock: Callable[[], float] = time.monotonic):
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self._overflow_max = overflow_max
        self._clock = clock
        self._lock = threading.Lock()
        self._slots: set[Slot] = set()
        self._per_peer: dict[str, int] = {}
        self.evictions = 0

    def open(self, host: str) -> Slot | str:
        """A slot for a connection from ``host``, or why it is refused."""
        with self._lock:
            if self._per_peer.get(host, 0) >= self.max_per_peer:
                return f"too many connections from {host} (max_connections_per_peer {self.max_per_peer})"
            held = sum(not s.over for s in self._slots)
            over = held >= self.max_connections
            if over and len(self._slots) - held >= self._overflow_max:
                return (f"too many connections (max_connections {self.max_connections}, and {self._overflow_max} "
                        f"more waiting to greet)")
            slot = Slot(host, self._clock(), over=over)
            self._slots.add(slot)
            self._per_peer[host] = self._per_peer.get(host, 0) + 1
            return slot

    def greeted(self, slot: Slot) -> str | None:
        """``slot``'s HELLO succeeded: None once it holds a slot of its own (the longest idle greeted
        connection is evicted for it when it came in over the limit; the caller wakes it), or why it
        is refused."""
        with self._lock:
            slot.greeted = True
            if not slot.over:
                return None
            idle = [s for s in self._slots if s.greeted and not s.over and not s.in_request and not s.evicted]
            if not idle:
                return f"every one of the {self.max_connections} connections (max_connections) is in a request"
            victim = min(idle, key=lambda s: s.last_work)
            victim.evicted = True
            slot.over = False
            self._slots.discard(victim)  # its slot is the newcomer's now; its host count goes at close
            self.evictions += 1
        victim.wake()
        return None

    def begin(self, slot: Slot) -> bool:
        """A frame or request starts on ``slot`` (it is not evicted until :meth:`end`); False if it was
        evicted already (the request is not served)."""
        with self._lock:
            if slot.evicted:
                return False
            slot.in_request = True
            return True

    def end(self, slot: Slot, work: bool) -> None:
        """The request ended (the connection waits for the next one and may be evicted); ``work``: it was
        not a PING (PINGs keep no slot from being evicted)."""
        with self._lock:
            slot.in_request = False
            if work:
                slot.last_work = self._clock()

    def close(self, slot: Slot) -> None:
        with self._lock:
            self._slots.discard(slot)
            left = self._per_peer[slot.host] - 1
            if left:
                self._per_peer[slot.host] = left
            else:
                del self._per_peer[slot.host]

    def held(self) -> int:
        """Connections holding a slot (not those over the limit waiting to greet)."""
        with self._lock:
            return sum(not s.over for s in self._slots)
