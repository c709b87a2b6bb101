"""UpstreamClient: the daemon's own blocking client of another kvtierd (its upstream).

Built on :mod:`kvtier.wire` only (the daemon never imports ``kvtier.client``). A small pool
of authenticated connections (its own token, ``--upstream-token-file``); every call has a
deadline (``timeout_s``) that covers waiting for a pooled connection, connecting, HELLO,
sending and every receive, so no call outlives it::

    up = UpstreamClient("region:7410", token, timeout_s=0.5)
    got = up.get_many(keys, ns_id)        # UpstreamBlocks: verified blocks, None per miss
    up.lookup(keys, ns_id); up.put_many(blocks, ns_id); up.pin(keys, ns_id)

Failures raise an :class:`~.errors.UpstreamError` whose ``kind`` says what happened; the
caller decides that it is a miss. A pooled connection the upstream closed while it idled
is replaced before use, and a call whose pooled connection failed mid-call is repeated
once on a fresh one while time is left (every op here repeats safely: GET, LOOKUP and PIN
only read or set flags, a re-put of a present key is a no-op).
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from kvtier.common.addresses import DATA_PORT_DEFAULT, format_address, parse_address
from kvtier.common.blockformat import BlockFormatError, decode_header, verify_block
from kvtier.wire import connection as p
from kvtier.wire.events import PIN_TTL_MS_MAX

from .channel import Channel, remaining_s
from .errors import UpstreamError, UpstreamTimeout, UpstreamUnavailable

UPSTREAM_POOL_SIZE = 8  # connections to one upstream: requests beyond wait (within their deadline)
CLIENT_NAME = "kvtierd-upstream"
PUT_FRAME_BYTES_MAX = 16 << 20  # the upstream receives a PUT payload up to this into a pooled arena


@dataclass(frozen=True)
class UpstreamBlocks:
    """One GET's answer: per key a verified block (a read-only view), None (a miss or a corrupt
    block) or ``p.DEFERRED`` (the upstream left it for a later request); ``corrupt`` counts
    the blocks that failed verification (their keys are None)."""

    blocks: tuple
    corrupt: int
    corrupt_keys: tuple[bytes, ...] = ()


def verified(block, key: bytes, ns_id: bytes | None) -> bool:
    """Header CRC, length, payload CRC, key and (where the request named one) namespace."""
    try:
        header = verify_block(block, expected_key=key)
    except BlockFormatError:
        return False
    return ns_id is None or header.ns_id == bytes(ns_id)


class UpstreamClient:
    """Pooled, authenticated, deadline-bounded client of one upstream daemon; thread-safe."""

    def __init__(self, address: str, token: str | None, timeout_s: float, pool_size: int = UPSTREAM_POOL_SIZE,
                 client_name: str = CLIENT_NAME):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if pool_size < 1:
            raise ValueError(f"pool_size must be at least 1, got {pool_size}")
        self._host, self._port = parse_address(address, what="upstream address", default_port=DATA_PORT_DEFAULT)
        self.address = format_address(self._host, self._port)
        self._token, self.timeout_s, self._name = token, timeout_s, client_name
        self._idle: queue.LifoQueue[Channel] = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(pool_size)
        self._lock = threading.Lock()
        self._connections_made = 0
        self._features: tuple[str, ...] = ()
        self._closed = False

    # -- the API ---------------------------------------------------------------
    def get_many(self, keys: Sequence[bytes], ns_id: bytes | None = None,
                 timeout_s: float | None = None) -> UpstreamBlocks:
        """One GET frame of ``keys`` (at most the frame's key limit); every block is verified.
        Where the upstream let us check payload CRCs ourselves (``get_reader_verifies``), a
        block that fails is asked for once more without that, while time is left: the
        upstream then checks it too and drops a copy corrupt on its flash (as the block
        clients do). A block that fails again is a miss."""
        keys = [bytes(k) for k in keys]
        if not keys:
            return UpstreamBlocks((), 0)
        deadline = self._deadline(timeout_s)
        blocks, corrupt, flagged = self._get_verified(keys, ns_id, deadline, reader_verifies=True)
        if corrupt and flagged:
            try:
                again, still, _ = self._get_verified([keys[i] for i in corrupt], ns_id, deadline,
                                                     reader_verifies=False)
            except UpstreamError:  # out of time or the upstream failed: the first answer stands
                again, still = [None] * len(corrupt), list(range(len(corrupt)))
            for i, block in zip(corrupt, again):
                blocks[i] = block
            corrupt = [corrupt[j] for j in still]
        return UpstreamBlocks(tuple(blocks), len(corrupt), tuple(keys[i] for i in corrupt))

    def _get_verified(self, keys: list[bytes], ns_id: bytes | None, deadline: float,
                      reader_verifies: bool) -> tuple[list, list[int], bool]:
        """(blocks, indexes of the corrupt ones, whether the upstream was told we verify)."""
        told: list[bool] = []

        def message(ch: Channel) -> p.Get:
            told.append(reader_verifies and p.FEATURE_GET_READER_VERIFIES in ch.features)
            return p.Get(0, tuple(keys), ns_id, told[-1])
        reply = self._call(message, deadline=deadline)
        blocks, corrupt = [], []
        for i, (key, block) in enumerate(zip(keys, reply.blocks)):
            if block is None or block is p.DEFERRED:
                blocks.append(block)
            elif verified(block, key, ns_id):
                blocks.append(block.toreadonly())
            else:
                blocks.append(None)
                corrupt.append(i)
        return blocks, corrupt, told[-1]

    def lookup(self, keys: Sequence[bytes], ns_id: bytes | None = None, timeout_s: float | None = None) -> int:
        """How many leading keys of the chain the upstream holds."""
        keys = [bytes(k) for k in keys]
        if not keys:
            return 0
        return self._call(lambda ch: p.Lookup(0, tuple(keys), False, ns_id), timeout_s).leading

    def put_many(self, blocks: Sequence, ns_id: bytes | None = None, durable: bool = False,
                 timeout_s: float | None = None) -> list[int]:
        """Store whole blocks (header + payload, keys from their headers) at the upstream, or at
        an edge when the region pushes to it; one frame per PUT_FRAME_BYTES_MAX."""
        views = [memoryview(b).cast("B") for b in blocks]
        keys = [decode_header(v).key for v in views]
        seqs: list[int] = []
        start = 0
        while start < len(views):
            end, size = start, 0
            while end < len(views) and (end == start or size + views[end].nbytes <= PUT_FRAME_BYTES_MAX):
                size += views[end].nbytes
                end += 1
            put = p.Put(0, tuple(keys[start:end]), tuple(views[start:end]), durable, ns_id)
            seqs.extend(self._call(lambda ch, put=put: put, timeout_s).seqs)
            start = end
        return seqs

    def pin(self, keys: Sequence[bytes], ns_id: bytes | None = None, ttl_s: float | None = None,
            timeout_s: float | None = None) -> list[bool]:
        """Pin ``keys`` there: hard (durable until UNPIN), or with ``ttl_s`` a soft pin that expires
        by itself (the daemon lists ``pin_ttl`` in HELLO). Per key, whether it was present."""
        keys = [bytes(k) for k in keys]
        if not keys:
            return []
        ttl_ms = None if ttl_s is None else min(PIN_TTL_MS_MAX, max(1, round(ttl_s * 1000)))
        return list(self._call(lambda ch: p.Pin(0, tuple(keys), ns_id, ttl_ms), timeout_s).results)

    def features(self, timeout_s: float | None = None) -> tuple[str, ...]:
        """The upstream's HELLO features (connects if no connection has yet)."""
        if not self._features:
            self._call(lambda ch: p.Ping(0, b"features"), timeout_s)
        return self._features

    @property
    def connections_made(self) -> int:
        with self._lock:
            return self._connections_made

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return

    # -- plumbing ----------------------------------------------------------------
    def _deadline(self, timeout_s: float | None) -> float:
        return time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)

    def _call(self, make_message, timeout_s: float | None = None, deadline: float | None = None):
        """One request on a pooled (or new) connection, within the deadline; once more on a
        fresh connection if a pooled one failed mid-call and time is left."""
        if self._closed:
            raise UpstreamUnavailable("the upstream client is closed")
        deadline = self._deadline(timeout_s) if deadline is None else deadline
        if not self._slots.acquire(timeout=remaining_s(deadline)):
            raise UpstreamTimeout(f"every connection to the upstream {self.address} stayed busy for the timeout")
        try:
            ch, fresh = self._pooled_or_new(deadline)
            try:
                return self._exchange(ch, make_message, deadline)
            except UpstreamTimeout:
                raise
            except UpstreamUnavailable:
                if fresh:
                    raise
            ch = self._connect(deadline)  # the pooled one had gone stale under us: one more try
            return self._exchange(ch, make_message, deadline)
        finally:
            self._slots.release()

    def _exchange(self, ch: Channel, make_message, deadline: float):
        try:
            (reply,) = ch.exchange([make_message(ch)], deadline)
        except BaseException:  # a failed channel is never reused (it may be mid-reply)
            ch.close()
            raise
        self._idle.put(ch)
        return reply

    def _pooled_or_new(self, deadline: float) -> tuple[Channel, bool]:
        while True:
            try:
                ch = self._idle.get_nowait()
            except queue.Empty:
                return self._connect(deadline), True
            if ch.idle_and_open():
                return ch, False
            ch.close()

    def _connect(self, deadline: float) -> Channel:
        ch = Channel(self._host, self._port, self._token, self._name, deadline)
        with self._lock:
            self._connections_made += 1
            self._features = ch.features
        return ch
