"""Lends each request the memory its payload or its reply needs, and takes it back.

A request borrows the session's arena from the daemon-wide pool
(:class:`.arenas.ReplyArenas`) when it fits one and one is free; otherwise it
gets a buffer of its own, reserved against the daemon-wide transient budget
first. Whatever a request holds is given back by :meth:`RequestBuffers.reply_sent`
once its reply went out.
"""
from __future__ import annotations

from typing import Callable

from kvtier.daemon.engine import BlockTooLargeError
from kvtier.daemon.server.arenas import ReplyArenas, ReplyArenaStatistics
from kvtier.daemon.server.session import Session
from kvtier.wire import connection as p


class TransientBudgetSpent(Exception):
    """The daemon-wide budget for request buffers outside the arenas is spent: answered BUSY."""


class RequestBuffers:
    """The budget policy over one pool of arenas and one transient budget."""

    def __init__(self, arenas: ReplyArenas):
        self.arenas = arenas

    def statistics(self) -> ReplyArenaStatistics:
        return self.arenas.statistics()

    def payload_buffer(self, session: Session, nbytes: int) -> memoryview | None:
        """The session's arena to receive a request payload of ``nbytes`` into
        (the engine copies PUT blocks out before the reply is sent), or None:
        larger than an arena, or the pool is spent (see :meth:`admit_payload`)."""
        if nbytes > self.arenas.arena_bytes:
            return None
        return self._session_arena(session)

    def admit_payload(self, session: Session, nbytes: int) -> tuple[p.ErrorCode, str] | None:
        """For a payload that gets no arena (:meth:`payload_buffer` said None): None if a
        transient buffer of ``nbytes`` fits the daemon-wide budget (the connection then
        allocates it), else the error to refuse the frame with (its payload is skipped):
        BUSY while the budget is spent, TOO_LARGE for more than the whole budget."""
        try:
            self.reserve_transient(session, nbytes)
        except TransientBudgetSpent as exc:
            return p.ErrorCode.BUSY, str(exc)
        except BlockTooLargeError as exc:
            return p.ErrorCode.TOO_LARGE, str(exc)
        return None

    def reply_buffer(self, session: Session, nbytes: int) -> memoryview:
        """A page-aligned buffer of at least ``nbytes`` for one reply: the session's
        arena, or a transient one when ``nbytes`` is larger than an arena or every
        arena is lent (TransientBudgetSpent, BlockTooLargeError: no room for it)."""
        if nbytes <= self.arenas.arena_bytes:
            arena = self._session_arena(session)
            if arena is not None:
                return arena
        self.reserve_transient(session, nbytes)
        buffer = self.arenas.transient_buffer(nbytes)
        session.transient_buffers.append(buffer)
        return buffer

    def reserve_transient(self, session: Session, nbytes: int) -> None:
        """Room for ``nbytes`` outside the arenas for this request, waiting for it if need be."""
        if nbytes > self.arenas.transient_budget_bytes:
            raise BlockTooLargeError(f"a request buffer of {nbytes} bytes is larger than the daemon's whole budget "
                                     f"for them ({self.arenas.transient_budget_bytes} bytes)")
        if not self.arenas.reserve_transient(nbytes):
            stats = self.arenas.statistics()
            raise TransientBudgetSpent(
                f"the daemon's request buffers stayed spent for {self.arenas.transient_wait_s} s "
                f"({stats.transient_bytes} of {stats.transient_budget_bytes} bytes in use by other requests, "
                f"{nbytes} more asked): retry later")
        session.transient_bytes += nbytes

    def release_transient(self, session: Session) -> None:
        """Give back the room this request reserved outside the arenas, and its buffers there."""
        while session.transient_buffers:
            self.arenas.give_transient_buffer(session.transient_buffers.pop())
        if session.transient_bytes:
            nbytes, session.transient_bytes = session.transient_bytes, 0
            self.arenas.release_transient(nbytes)

    def reply_sent(self, session: Session) -> None:
        """The last reply went out: give back the arena it was sent from and any
        transient room (the connection reads its next request only after this)."""
        if session.get_arena is not None:
            arena, session.get_arena = session.get_arena, None
            self.arenas.release(arena)
        self.release_transient(session)

    def hand_over(self, session: Session) -> tuple[Callable[[], None], int]:
        """Take what this request holds (its arena, its transient buffers and their room) from the
        session, for a caller that must keep it out of use past the reply (a NIXL transfer still in
        flight): ``(give_back, bytes held)``; ``give_back()`` returns it all to the pool, as
        :meth:`reply_sent` would have."""
        held = Session(session.peer, get_arena=session.get_arena, transient_bytes=session.transient_bytes,
                       transient_buffers=session.transient_buffers)
        session.get_arena, session.transient_bytes, session.transient_buffers = None, 0, []
        arena_bytes = 0 if held.get_arena is None else held.get_arena.nbytes
        nbytes = arena_bytes + sum(buffer.nbytes for buffer in held.transient_buffers)
        return lambda: self.reply_sent(held), nbytes

    def _session_arena(self, session: Session) -> memoryview | None:
        """The arena this request borrowed, borrowing one if it has none (None: all lent)."""
        if session.get_arena is None:
            session.get_arena = self.arenas.acquire()
        return session.get_arena
