"""Pull-through: what this daemon lacks, asked of its upstream, served, and stored here behind.

The request handler asks this after its engine answered::

    LOOKUP  local leading run ──> blocks waiting in the store queue ──> the upstream, for the rest
            leading = all three;  origins: 0 (here) for the first two, 1 (upstream) for the third
    GET     misses ──> the store queue ──> the upstream (one GET per owner) ──> verified blocks
            served with origin 1 and offered to the store queue (write-behind, bounded)

Where the upstream keeps replicas (an ``etcd://`` region), each key is asked of its owners in
rendezvous order (:class:`~.rank_walk.RankWalk`): the next owner gets what the one before could
not answer, lacked, or sent corrupt. One timeout covers the request; each rank may spend an
equal share of what is left (half, then the rest, for two replicas), so a hung first owner
leaves its replicas time to answer.

Every upstream failure is a miss here, counted by kind (:class:`~.errors.FailureKind`); an
upstream that timed out or could not be reached is not asked again for ``DOWN_BACKOFF_S``, so
a dead or slow upstream costs at most one timeout per backoff, not one per request. Keys the
upstream said it lacks (each of their owners did) go to the :class:`~.negative_cache.NegativeCache`.
A block that fails verification (header CRC, payload CRC, key, namespace) is neither served nor
stored.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict
from typing import Callable, Sequence

from kvtier.wire import connection as p
from kvtier.wire.frames import ORIGIN_LOCAL, ORIGIN_UPSTREAM

from .errors import FailureKind, UpstreamError
from .negative_cache import NegativeCache
from .rank_walk import Answer, RankWalk, lookup_answers
from .statistics import UpstreamRecorder, UpstreamStatistics
from .store_queue import StoreQueue
from .targets import UpstreamTarget

log = logging.getLogger("kvtier.daemon.upstream")

DOWN_BACKOFF_S = 0.5  # after a timeout or a refused connection, requests skip that upstream member this long
FAILURE_LOG_INTERVAL_S = 10.0  # one log line per failure kind and member at most this often (all are counted)
_BACKOFF_KINDS = (FailureKind.TIMEOUT, FailureKind.UNAVAILABLE, FailureKind.AUTH)


def _size(block) -> int:
    """Payload bytes a GET reply item takes (a miss or a DEFERRED item: none)."""
    return 0 if block is None or block is p.DEFERRED else memoryview(block).nbytes


class PullThrough:
    """The upstream side of one daemon's LOOKUP and GET; thread-safe."""

    def __init__(self, target: UpstreamTarget, engine, clock: Callable[[], float] = time.monotonic,
                 negative: NegativeCache | None = None, store: StoreQueue | None = None):
        self.target = target
        self._engine = engine  # put_many behind; lookup / get_many again for what the store queue just stored
        self._clock = clock
        self.negative = negative if negative is not None else NegativeCache()
        self.store = store if store is not None else StoreQueue(engine.put_many)
        self.stats = UpstreamRecorder(target.text)
        self._lock = threading.Lock()
        self._down_until: dict[str, float] = {}
        self._logged_at: dict[tuple[str, FailureKind], float] = {}

    # -- LOOKUP -----------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes], ns_id: bytes | None, local: int) -> tuple[int, bytes]:
        """``(leading, origins)`` of a chain whose first ``local`` keys this daemon holds."""
        keys = list(keys)
        queued = 0
        for block in self.store.pending(keys[local:]):
            if block is None:
                break
            queued += 1
        here = local + queued
        if here < len(keys):  # stored by the queue since the handler looked: the engine holds them now
            here += self._engine.lookup(keys[here:])
        found = self._lookup_upstream(keys[here:], ns_id) if here < len(keys) else 0
        leading = here + found
        self.stats.add(prefix_blocks_local=here, prefix_blocks_upstream=found, prefix_blocks_missed=len(keys) - leading)
        return leading, bytes([ORIGIN_LOCAL]) * here + bytes([ORIGIN_UPSTREAM]) * found

    def _lookup_upstream(self, keys: list[bytes], ns_id: bytes | None) -> int:
        if self.negative.absent(ns_id, keys[:1], self._clock())[0]:
            self.stats.add(negative_hits=1)
            return 0

        def ask(client, idx: list[int], deadline: float) -> list[Answer] | None:
            present = self._ask(client, deadline, lambda t: client.lookup([keys[i] for i in idx], ns_id, timeout_s=t))
            return None if present is None else lookup_answers(len(idx), present)
        walk = self._walk(keys, ask)
        if not walk.open:
            return len(keys)
        if walk.open[0] in walk.absent():  # only answers say the upstream lacks a key: a failure is no news
            self.negative.add(ns_id, [keys[walk.open[0]]], self._clock())
        return walk.open[0]

    # -- GET --------------------------------------------------------------------
    def fill(self, msg: p.Get, reply: p.GetReply, payload_bytes_max: int) -> p.GetReply:
        """``reply`` (the engine's answer to ``msg``) with its misses filled from the store queue
        and the upstream, and the origins the request asked for. Blocks past
        ``payload_bytes_max`` are answered DEFERRED (they are stored behind all the same)."""
        blocks = list(reply.blocks)
        origins = bytearray(len(blocks))
        misses = [i for i, block in enumerate(blocks) if block is None]
        if misses:
            keys = [bytes(msg.keys[i]) for i in misses]
            queued = self.store.pending(keys)
            for i, block in zip(misses, queued):
                blocks[i] = block
            self.stats.add(blocks_pending_hits=sum(block is not None for block in queued))
            ask = [i for i in misses if blocks[i] is None]
            if ask:
                ask = self._stored_since(msg, ask, blocks)
            absent = self.negative.absent(msg.ns_id, [msg.keys[i] for i in ask], self._clock())
            self.stats.add(negative_hits=sum(absent))
            ask = [i for i, known_absent in zip(ask, absent) if not known_absent]
            if ask:
                self._fetch(msg, ask, blocks, origins)
        room = payload_bytes_max - sum(_size(b) for b in reply.blocks)
        for i in misses:
            size = _size(blocks[i])
            if size > room:  # over the reply's payload limit: the client asks again (queued here by then)
                blocks[i], origins[i] = p.DEFERRED, ORIGIN_LOCAL
            else:
                room -= size
        return p.GetReply(reply.request_id, tuple(blocks), origins=bytes(origins) if msg.want_origin else None)

    def _stored_since(self, msg: p.Get, ask: list[int], blocks: list) -> list[int]:
        """``ask`` less the keys the store queue put into the engine since the handler read it
        (read now, verified by the engine); the rest still need the upstream. An index probe
        for the batch; only what it finds is read."""
        found = [i for i, where in zip(ask, self._engine.locate_many([msg.keys[i] for i in ask])) if where is not None]
        for i, block in zip(found, self._engine.get_many([msg.keys[i] for i in found]) if found else ()):
            blocks[i] = block
        return [i for i in ask if blocks[i] is None]

    def _fetch(self, msg: p.Get, ask: list[int], blocks: list, origins: bytearray) -> None:
        keys = [bytes(msg.keys[i]) for i in ask]
        self.stats.add(blocks_asked=len(keys))
        fetched: list[tuple[bytes, memoryview]] = []

        def get(client, idx: list[int], deadline: float) -> list[Answer] | None:
            got = self._ask(client, deadline, lambda t: client.get_many([keys[j] for j in idx], msg.ns_id, timeout_s=t))
            if got is None:
                return None
            if got.corrupt:
                self.stats.failed(FailureKind.CORRUPT, got.corrupt)
                log.warning("event=upstream_block_corrupt upstream=%s blocks=%d first_key=%s (not served, not stored)",
                            client.address, got.corrupt, got.corrupt_keys[0].hex())
            answers = []
            for j, block in zip(idx, got.blocks):
                i = ask[j]
                if block is None:
                    answers.append(Answer.UNKNOWN if keys[j] in got.corrupt_keys else Answer.LACKED)
                    continue
                if block is p.DEFERRED:
                    blocks[i] = p.DEFERRED
                else:
                    blocks[i], origins[i] = block, ORIGIN_UPSTREAM
                    fetched.append((keys[j], block))
                answers.append(Answer.FOUND)
            return answers
        absent = [keys[j] for j in self._walk(keys, get).absent()]
        if absent:
            self.negative.add(msg.ns_id, absent, self._clock())
        self.stats.add(blocks_fetched=len(fetched), bytes_fetched=sum(b.nbytes for _, b in fetched),
                       blocks_missed=len(absent))
        if fetched:
            self.store.offer(fetched)

    # -- owners, rank by rank -----------------------------------------------------
    def _walk(self, keys: list[bytes], ask: Callable[[object, list[int], float], list[Answer] | None]) -> RankWalk:
        """``keys`` asked of their owners rank by rank, ``ask(client, positions, deadline)`` per
        owner, until every key is found or every rank was asked. One timeout for the request,
        whatever the owners; each rank may spend an equal share of what is left of it."""
        ranks = self.target.owners_by_rank(keys)
        walk = RankWalk(len(keys), len(ranks))
        deadline = time.monotonic() + self.target.timeout_s
        for owners in ranks:
            now = time.monotonic()
            rank_deadline = now + max(0.0, deadline - now) / (walk.ranks - walk.rank)
            for client, idx in walk.asks(owners).items():
                walk.answered(idx, ask(client, idx, rank_deadline))
            walk.end_rank()
            if walk.done:
                break
        self.stats.add(fallbacks=walk.fallbacks, fallback_hits=walk.fallback_hits)
        return walk

    # -- calls, failures, backoff -------------------------------------------------
    def _ask(self, client, deadline: float, call: Callable[[float], object]):
        """``call(seconds left until deadline)``'s result, or None when the upstream member failed
        (counted, logged, backed off) or no time is left."""
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            self.stats.failed(FailureKind.TIMEOUT)
            return None
        now = self._clock()
        with self._lock:
            if now < self._down_until.get(client.address, 0.0):
                skipped = True
            else:
                skipped = False
        if skipped:
            self.stats.add(skipped_down=1)
            return None
        self.stats.add(requests=1)
        started = time.perf_counter()
        try:
            return call(left_s)
        except UpstreamError as exc:
            self._failed(client.address, exc)
            return None
        finally:
            self.stats.fetched_in(time.perf_counter() - started)

    def _failed(self, address: str, exc: UpstreamError) -> None:
        self.stats.failed(exc.kind)
        now = self._clock()
        with self._lock:
            if exc.kind in _BACKOFF_KINDS:
                self._down_until[address] = now + DOWN_BACKOFF_S
            last = self._logged_at.get((address, exc.kind))
            quiet = last is not None and now - last < FAILURE_LOG_INTERVAL_S
            if not quiet:
                self._logged_at[(address, exc.kind)] = now
        if quiet:
            return
        if exc.kind is FailureKind.AUTH:
            log.error("event=upstream_auth_failed upstream=%s error=%s (check --upstream-token-file; "
                      "requests are served as misses)", address, exc)
        else:
            log.warning("event=upstream_failed upstream=%s kind=%s error=%s (served as a miss)", address,
                        exc.kind.value, exc)

    # -- lifecycle ---------------------------------------------------------------
    def statistics(self) -> UpstreamStatistics:
        return self.stats.snapshot(len(self.negative), asdict(self.store.statistics()))

    def close(self) -> None:
        """Store what the queue holds (bounded), then close the upstream connections."""
        self.store.close()
        self.target.close()
