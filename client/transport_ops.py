"""The client transport's operations: each client call as a sans-IO generator
of request frames, shared by the blocking and the asyncio clients.

Each op is a generator that yields a list of request messages (request ids
are filled in by the driver), receives the list of replies in the same order,
and finally returns the op's result. The driver does the I/O: it pipelines a
yielded list on one connection and sends the replies back in. Splitting a
batch into frames that fit the limits, and asking again for GET items the
daemon deferred, happen here once for both clients; the protocol package
(:mod:`kvtier.wire`) encodes and checks single frames and does neither.
"""
from __future__ import annotations

from typing import Generator, Sequence

from kvtier.wire import connection as p
from kvtier.wire.frames import ORIGIN_UPSTREAM
from kvtier.wire.writers import check_key
from kvtier.common.blockformat import BlockFormatError, verify_block

Op = Generator[list, list, object]


def _chunks(seq: Sequence, size: int):
    for start in range(0, len(seq), size):
        yield seq[start:start + size]


def op_lookup(keys: Sequence[bytes], ns_id, want_locations: bool, limits: p.Limits,
              origins: list | None = None) -> Op:
    """``(leading, locations or None)``; one pipelined round trip (keys are
    checked when the frames are encoded). ``origins`` (a list; the daemon lists
    ``upstream`` in HELLO): filled with one bool per leading key, True where only
    the daemon's upstream holds it."""
    keys = keys if isinstance(keys, list) else list(keys)
    if origins is not None:
        origins.clear()
    if not keys:
        return 0, ([] if want_locations else None)
    replies = yield [p.Lookup(0, tuple(c), want_locations, ns_id, want_origin=origins is not None)
                     for c in _chunks(keys, limits.batch_count_max)]
    leading, locations, complete = 0, [], True
    for chunk_reply, chunk in zip(replies, _chunks(keys, limits.batch_count_max)):
        if complete:
            leading += chunk_reply.leading
            complete = chunk_reply.leading == len(chunk)
            if origins is not None:
                origins.extend(origin == ORIGIN_UPSTREAM for origin in chunk_reply.origins)
        if want_locations:
            locations.extend(chunk_reply.locations)
    return leading, (locations if want_locations else None)


def op_get_many(keys: Sequence[bytes], ns_id, limits: p.Limits, verify: bool = True, copy: bool = True,
                reader_verifies: bool = False, origins: list | None = None) -> Op:
    """Verified blocks (bytes, or read-only memoryviews without ``copy``) or
    None per key, and how many came back corrupt; DEFERRED items are asked
    again. ``reader_verifies`` (the daemon offers it in HELLO): the daemon may
    leave payload CRCs to us -- so only when we ``verify``. A block that fails
    is asked for once more without it (the daemon then checks it and drops a
    copy corrupt on flash, so the key reads as a miss and a re-put can replace
    it); a block that fails again is a miss. ``origins`` (a list; the daemon lists ``upstream``
    in HELLO): filled with one bool per key, True where the daemon fetched the block from its
    upstream for this request."""
    keys = [check_key(k) for k in keys]
    want_origin = origins is not None
    if want_origin:
        origins[:] = [False] * len(keys)
    results: list = [None] * len(keys)
    pending = list(range(len(keys)))
    retry: list[int] = []
    reader_verifies = reader_verifies and verify
    retried = False
    corrupt = 0
    while pending:
        chunks = list(_chunks(pending, limits.batch_count_max))
        replies = yield [p.Get(0, tuple(keys[i] for i in c), ns_id, reader_verifies, want_origin=want_origin) for c in chunks]
        pending = []
        for chunk, reply in zip(chunks, replies):
            if want_origin:
                for i, origin in zip(chunk, reply.origins):
                    origins[i] = origin == ORIGIN_UPSTREAM
            for i, block in zip(chunk, reply.blocks):
                if block is p.DEFERRED:
                    pending.append(i)
                elif block is not None:
                    if verify and not verify_ok(block, keys[i]):
                        corrupt += 1
                        retry.append(i)
                        continue
                    if copy:
                        results[i] = block if type(block) is bytes else bytes(block)
                    else:
                        results[i] = block if type(block) is bytes else block.toreadonly()
        if not pending and retry and not retried:
            pending, retry, reader_verifies, retried = retry, [], False, True
    return results, corrupt


def op_get_into(keys: Sequence[bytes], ns_id, limits: p.Limits, plan, reader_verifies: bool = False) -> Op:
    """:func:`op_get_many` whose replies land where ``plan`` (a
    :class:`~.scatter_plan.ScatterPlan`) says: per key a
    :class:`~.scatter_plan.LandedBlock` (verified where it landed), a verified block
    that landed apart (another size than planned), or None; and the corrupt count.
    A corrupt block is asked for once more without ``reader_verifies``."""
    from .scatter_plan import verify_landed

    keys = [check_key(k) for k in keys]
    results: list = [None] * len(keys)
    pending, retry = list(range(len(keys))), []
    retried, corrupt = False, 0
    while pending:
        chunks = list(_chunks(pending, limits.batch_count_max))
        plan.expect(chunks)
        replies = yield [p.Get(0, tuple(keys[i] for i in c), ns_id, reader_verifies) for c in chunks]
        pending = []
        for chunk, reply in zip(chunks, replies):
            for i, block in zip(chunk, reply.blocks):
                if block is p.DEFERRED:
                    pending.append(i)
                elif block is not None:
                    got = verify_landed(block if isinstance(block, tuple) else (block,), keys[i], plan.head_nbytes,
                                        plan.payload_crc(i))  # None where it landed apart
                    if got is None:
                        corrupt += 1
                        retry.append(i)
                    else:
                        results[i] = got
        if not pending and retry and not retried:
            pending, retry, reader_verifies, retried = retry, [], False, True
    return results, corrupt


def verify_ok(block, key: bytes) -> bool:
    try:
        verify_block(block, expected_key=key)
        return True
    except BlockFormatError:
        return False


PUT_FRAME_BYTES_TARGET = 16 << 20  # the daemon receives a PUT payload up to this into a pooled arena; a larger
# one takes a transient buffer from a smaller budget (BUSY when spent). Frames are pipelined, so
# splitting adds no round trip.


def op_put_many(items: Sequence[tuple[bytes, object]], durable: bool, ns_id, limits: p.Limits,
                skip_deleted: bool = False) -> Op:
    """Stored sequence numbers, one per item; frames split by count and bytes (at
    PUT_FRAME_BYTES_TARGET, a larger block alone in its frame). ``skip_deleted``: FLAG_SKIP_DELETED."""
    frames, keys, blocks, size = [], [], [], 0
    frame_bytes = min(limits.payload_bytes_max, PUT_FRAME_BYTES_TARGET)
    for key, block in items:
        view = block if isinstance(block, p.BlockParts) else memoryview(block).cast("B")
        if view.nbytes > limits.payload_bytes_max:
            raise ValueError(f"a block of {view.nbytes} bytes is over the frame payload limit {limits.payload_bytes_max}")
        if keys and (len(keys) == limits.batch_count_max or size + view.nbytes > frame_bytes):
            frames.append(p.Put(0, tuple(keys), tuple(blocks), durable, ns_id, skip_deleted))
            keys, blocks, size = [], [], 0
        keys.append(check_key(key))
        blocks.append(view)
        size += view.nbytes
    if keys:
        frames.append(p.Put(0, tuple(keys), tuple(blocks), durable, ns_id, skip_deleted))
    if not frames:
        return []
    replies = yield frames
    return [seq for reply in replies for seq in reply.seqs]


def op_bools(kind, keys: Sequence[bytes], ns_id, limits: p.Limits) -> Op:
    """DELETE / PIN / UNPIN of a batch: one bool per key."""
    keys = [check_key(k) for k in keys]
    if not keys:
        return []
    replies = yield [kind(0, tuple(c), ns_id) for c in _chunks(keys, limits.batch_count_max)]
    return [r for reply in replies for r in reply.results]


def op_single(message) -> Op:
    """FLUSH, STATS, PING, HELLO: one frame, one reply."""
    (reply,) = yield [message]
    return reply
