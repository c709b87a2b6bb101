"""A store as a pipeline: chunk i of the blocks is gathered while the chunks before it are on the wire.

::

    gather c0 ─> PUT c0 ───────────>
                 gather c1 ─> PUT c1 ───────────>
                              gather c2 ─> PUT c2 ...     (at most ``in_flight`` PUTs at once)

Each chunk is gathered into send buffers in the calling thread, PUT on ``executor`` (each PUT takes a
connection of its own, so the daemon receives one chunk while it writes another) and its buffers are
given back as soon as its PUT ends: a store holds ``in_flight + 1`` chunks of send buffers, not the whole
request. The store returns once every chunk's PUT has ended; the first error is raised then, after the
others (and no chunk is gathered after a PUT failed).
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Executor, Future
from typing import Callable, TypeVar

Built = TypeVar("Built")

STORE_CHUNK_BYTES = 32 << 20  # the blocks one PUT of a pipelined store carries (at least one block)


def chunk_bounds(blocks: int, block_bytes: int, chunk_bytes: int = STORE_CHUNK_BYTES) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` covering ``range(blocks)`` in chunks of about ``chunk_bytes``."""
    per_chunk = max(1, chunk_bytes // max(1, block_bytes))
    return [(start, min(blocks, start + per_chunk)) for start in range(0, blocks, per_chunk)]


def run_pipelined(bounds: list[tuple[int, int]], build: Callable[[int, int], Built],
                  send: Callable[[int, int, Built], int], release: Callable[[Built], None],
                  executor: Executor, in_flight: int) -> int:
    """Gather (``build``) each chunk here and ``send`` it on ``executor``, at most ``in_flight``
    at once; ``release`` gives a chunk's buffers back once its send ended. Returns the sum of
    what the sends returned."""
    if in_flight < 1:
        raise ValueError(f"in_flight must be at least 1, got {in_flight}")
    pending: deque[Future] = deque()
    total, error = 0, None

    def send_then_release(start: int, end: int, built: Built) -> int:
        try:
            return send(start, end, built)
        finally:
            release(built)

    def settle(future: Future) -> None:
        nonlocal total, error
        try:
            total += future.result()
        except BaseException as exc:  # noqa: BLE001 -- kept and raised once every PUT has ended
            error = error or exc

    try:
        for start, end in bounds:
            while pending and (len(pending) >= in_flight or pending[0].done()):
                settle(pending.popleft())
            if error is not None:
                break
            built = build(start, end)
            try:
                pending.append(executor.submit(send_then_release, start, end, built))
            except BaseException:
                release(built)
                raise
    finally:
        while pending:
            settle(pending.popleft())
    if error is not None:
        raise error
    return total
