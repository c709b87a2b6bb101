"""Request arenas shared by every connection of the data server, within one budget.

A PUT's payload is received into a page-aligned arena (the engine copies the
blocks out), and a GET's blocks are read straight into one and sent from it
(see :mod:`.get_reply`). Arenas are lent per request: a connection borrows
one and gives it back once the reply is sent, so idle connections hold none
and the daemon never keeps more than ``budget_bytes`` of them, however many
connections are open. When every arena the budget allows is lent out, a
request gets a buffer of its own (a PUT's payload is received into it, a
GET's blocks are read into it as into an arena), freed once sent. Those
buffers, and those for requests larger than an arena, are *transient* and
have a daemon-wide budget of their own: a request that finds it spent waits
(on a condition, up to ``transient_wait_s``) for others to give room back,
and is refused with BUSY only then -- instead of many large frames on many
connections exhausting the daemon's memory. :mod:`.request_buffers` lends
them to requests.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from kvtier.common.aligned import aligned_buffer

GET_ARENA_BYTES_MAX = (16 << 20) + (64 << 10)  # one arena: a GET reply or PUT payload of 8 blocks of 2 MiB
# (each block read with its aligned range: up to 8 KiB more); a larger one gets a buffer of its own, freed
# once handled (transient)
GET_ARENAS_BYTES_MAX = 32 * GET_ARENA_BYTES_MAX  # all arenas of the daemon together: 32 requests in flight
# in arenas, however many connections are open
TRANSIENT_BYTES_MAX = 1 << 30  # request buffers outside the arenas, all connections together
TRANSIENT_IDLE_BYTES_MAX = 128 << 20  # transient buffers kept for reuse once given back (four 32 MiB replies):
# a fresh one costs a page fault per page on every request
TRANSIENT_WAIT_S = 2.0  # a request waits this long for transient room before BUSY: a few large replies' worth


@dataclass(frozen=True)
class ReplyArenaStatistics:
    arena_bytes: int
    budget_bytes: int
    created: int  # arenas allocated so far (kept for reuse): never more than budget_bytes / arena_bytes
    lent: int  # arenas borrowed by a request right now
    refused: int  # requests that found the budget spent (they got a buffer of their own)
    transient_bytes: int  # request buffers outside the arenas right now
    transient_budget_bytes: int
    transient_refused: int  # requests refused with BUSY: the transient budget stayed spent for transient_wait_s
    transient_waits: int  # requests that found the budget spent and waited for room


class ReplyArenas:
    """A free list of page-aligned arenas of ``arena_bytes``, at most ``budget_bytes`` in all."""

    def __init__(self, arena_bytes: int = GET_ARENA_BYTES_MAX, budget_bytes: int = GET_ARENAS_BYTES_MAX,
                 transient_budget_bytes: int = TRANSIENT_BYTES_MAX, transient_wait_s: float = TRANSIENT_WAIT_S):
        if arena_bytes <= 0 or budget_bytes < 0 or transient_budget_bytes < 0:
            raise ValueError(f"arena_bytes must be positive, the budgets not negative, got {arena_bytes}, "
                             f"{budget_bytes}, {transient_budget_bytes}")
        self.arena_bytes, self.budget_bytes = arena_bytes, budget_bytes
        self.transient_budget_bytes, self.transient_wait_s = transient_budget_bytes, transient_wait_s
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # notified whenever transient room is given back
        self._free: list[memoryview] = []
        self._idle_transient: list[memoryview] = []  # given-back transient buffers, most recent last
        self._created = self._lent = self._refused = 0
        self._transient = self._transient_refused = self._transient_waits = 0

    def reserve_transient(self, nbytes: int) -> bool:
        """Room for a request buffer of ``nbytes`` outside the arenas, waiting up to
        ``transient_wait_s`` for other requests to give some back (False: still spent)."""
        fits = lambda: self._transient + nbytes <= self.transient_budget_bytes  # noqa: E731
        with self._room:
            if not fits():
                self._transient_waits += 1
                if not self._room.wait_for(fits, self.transient_wait_s):
                    self._transient_refused += 1
                    return False
            self._transient += nbytes
            return True

    def release_transient(self, nbytes: int) -> None:
        with self._room:
            assert 0 <= nbytes <= self._transient, (nbytes, self._transient)
            self._transient -= nbytes
            self._room.notify_all()

    def transient_buffer(self, nbytes: int) -> memoryview:
        """A page-aligned buffer of at least ``nbytes`` for room already reserved: a given-back one
        that fits (its pages faulted in already), else a new one rounded up to a MiB."""
        with self._lock:
            fits = [i for i, buf in enumerate(self._idle_transient) if nbytes <= buf.nbytes < 2 * nbytes]
            if fits:
                return self._idle_transient.pop(fits[-1])
        return aligned_buffer(-(-nbytes // (1 << 20)) << 20, huge=True)

    def give_transient_buffer(self, buf: memoryview) -> None:
        """Keep a transient buffer for the next request (the oldest go past TRANSIENT_IDLE_BYTES_MAX)."""
        with self._lock:
            self._idle_transient.append(buf)
            while sum(b.nbytes for b in self._idle_transient) > TRANSIENT_IDLE_BYTES_MAX:
                self._idle_transient.pop(0)

    def acquire(self) -> memoryview | None:
        """An arena for one request, or None when the budget is spent."""
        with self._lock:
            if self._free:
                arena = self._free.pop()  # LIFO: the most recently used one has its pages faulted in
            elif (self._created + 1) * self.arena_bytes <= self.budget_bytes:
                arena = aligned_buffer(self.arena_bytes, huge=True)  # address space; pages come on first use
                self._created += 1
            else:
                self._refused += 1
                return None
            self._lent += 1
            return arena

    def release(self, arena: memoryview) -> None:
        """Give back an arena whose reply was sent."""
        assert arena.nbytes == self.arena_bytes, f"released a {arena.nbytes}-byte buffer that is not an arena"
        with self._lock:
            assert self._lent > 0, "released more arenas than were lent"
            assert all(a is not arena for a in self._free), "arena released twice"
            self._lent -= 1
            self._free.append(arena)

    def statistics(self) -> ReplyArenaStatistics:
        with self._lock:
            return ReplyArenaStatistics(self.arena_bytes, self.budget_bytes, self._created, self._lent, self._refused,
                                        self._transient, self.transient_budget_bytes, self._transient_refused,
                                        self._transient_waits)
