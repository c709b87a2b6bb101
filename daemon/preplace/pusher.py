"""PrePlacer: the region's worker that keeps its hot prefixes soft-pinned at its edges.

Every ``interval_s`` one round runs::

    data server --observe()--> ChainObserver --drain--> PrefixPopularity --top--> ranked prefixes
    ranked prefixes + block sizes from the engine's index --plan_within_budget--> per edge:
        LOOKUP (which blocks it lacks) -> PUT them (read from this engine, verified) -> PIN with a TTL

Each edge is pushed on its own connection (:class:`.edge_link.EdgeLink`); an edge that is
down, refuses the token or fails mid-push is counted and skipped, the others get theirs.
The budget is per edge and counts the soft pins the pusher still holds there
(:class:`.ledger.EdgeLedger`), so a prefix that left the top frees its room when its TTL
runs out. :meth:`PrePlacer.place` is the same push for one given prefix on chosen edges
(the admin API's /v1/preplace), outside the budget. Rounds and placements run one at a
time.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from kvtier.daemon.preplace.budget import Candidate, PlannedPrefix, held_leading, plan_within_budget
from kvtier.daemon.preplace.edge_link import EdgeLink, EdgePushError
from kvtier.daemon.preplace.edges import Edge, choose, edge_directory
from kvtier.daemon.preplace.ledger import EdgeLedger
from kvtier.daemon.preplace.observations import ChainObserver
from kvtier.daemon.preplace.popularity import KEY_BYTES, PrefixPopularity
from kvtier.daemon.preplace.settings import PreplaceSettings
from kvtier.daemon.preplace.statistics import PreplaceRecorder, PreplaceStatistics

log = logging.getLogger("kvtier.daemon.preplace")

TOP_PREFIXES_MAX = 1024  # prefixes a round considers: more than any edge budget holds of real prompts
READ_CHUNK_BYTES = 16 << 20  # blocks read from the engine (and held in memory) per PUT batch
STOP_TIMEOUT_S = 10.0  # stop() waits this long for a round in flight (its edge calls have deadlines)


@dataclass(frozen=True)
class EdgeOutcome:
    edge: str
    address: str
    ok: bool
    blocks_put: int = 0
    bytes_put: int = 0
    blocks_pinned: int = 0
    bytes_pinned: int = 0
    error: str | None = None


@dataclass(frozen=True)
class RoundReport:
    prefixes: int  # prefixes planned
    planned_bytes: int  # bytes of the plan before any edge's held pins were counted
    edges: tuple[EdgeOutcome, ...]


def _sizes(engine, keys: bytes) -> np.ndarray:
    rows = engine.locate_buffer(keys)
    return np.where(rows["found"], rows["length"], 0).astype(np.int64)


def _keys_of(packed: bytes) -> list[bytes]:
    return [packed[i:i + KEY_BYTES] for i in range(0, len(packed), KEY_BYTES)]


class PrePlacer:
    def __init__(self, engine, settings: PreplaceSettings, edges=None, clock: Callable[[], float] = time.monotonic):
        self._engine = engine
        self.settings = settings
        self._edges = edge_directory(settings) if edges is None else edges
        self._clock = clock
        self.observer = ChainObserver(clock)
        self._popularity = PrefixPopularity()
        self._ledgers: dict[str, EdgeLedger] = {}
        self._recorder = PreplaceRecorder()
        self._lock = threading.Lock()  # popularity and ledgers
        self._push_lock = threading.Lock()  # one round or placement at a time
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        assert self._thread is None, "PrePlacer started twice"
        self._thread = threading.Thread(target=self._run, name="kvtierd-preplace", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(STOP_TIMEOUT_S)
            if self._thread.is_alive():
                log.warning("event=preplace_stop_slow timeout_s=%.0f (a push is still running)", STOP_TIMEOUT_S)

    def _run(self) -> None:
        while not self._stopping.wait(self.settings.interval_s):
            try:
                self.push_round()
            except Exception:  # a bug or an engine failure: this round is lost, the next one runs
                log.exception("event=preplace_round_failed")

    # -- the periodic round -----------------------------------------------------------
    def edges(self) -> tuple[Edge, ...]:
        return self._edges.current()

    def push_round(self) -> RoundReport:
        """Rank, plan and push to every edge now (what the worker does every interval)."""
        with self._push_lock:
            now = self._clock()
            with self._lock:
                self._popularity.observe_many(self.observer.drain())
                top = self._popularity.top(now, TOP_PREFIXES_MAX)
            candidates = [Candidate(hot.ns_id, _keys_of(hot.keys), _sizes(self._engine, hot.keys).tolist())
                          for hot in top]
            planned_bytes = sum(p.size_bytes for p in plan_within_budget(candidates, self.settings.budget_bytes))
            outcomes = []
            plans = []
            for edge in self.edges():
                if self._stopping.is_set():
                    break  # the daemon is stopping: the other edges wait for its next start
                with self._lock:
                    held = self._ledger(edge.name).live_auto(now)
                plan = plan_within_budget(candidates, self.settings.budget_bytes, held)
                plans.append(plan)
                outcomes.append(self._push(edge, plan, self.settings.ttl_s, auto=True))
            self._recorder.round_done()
            return RoundReport(max((len(p) for p in plans), default=0), planned_bytes, tuple(outcomes))

    # -- one given prefix (the admin API) -------------------------------------------------
    def place(self, keys: Sequence[bytes], ns_id: bytes | None, wanted="all", ttl_s: float | None = None
              ) -> tuple[int, list[EdgeOutcome]]:
        """Push the leading blocks of ``keys`` this region holds to the chosen edges (names or
        addresses, or ``"all"``) and soft-pin them for ``ttl_s`` (default: the configured TTL).
        Returns (leading blocks held here, per-edge outcomes). UnknownEdge for a bad name."""
        edges = choose(self.edges(), wanted)
        self._recorder.admin_request()
        keys = [bytes(k) for k in keys]
        sizes = _sizes(self._engine, b"".join(keys)).tolist() if keys else []
        leading = held_leading(sizes) if keys else 0
        plan = [PlannedPrefix(ns_id or b"", tuple(keys[:leading]), tuple(sizes[:leading]))] if leading else []
        with self._push_lock:
            outcomes = [self._push(edge, plan, self.settings.ttl_s if ttl_s is None else ttl_s, auto=False)
                        for edge in edges]
        return leading, outcomes

    # -- pushing to one edge ------------------------------------------------------------
    def _ledger(self, name: str) -> EdgeLedger:
        ledger = self._ledgers.get(name)
        if ledger is None:
            ledger = self._ledgers[name] = EdgeLedger()
        return ledger

    def _push(self, edge: Edge, plan: list[PlannedPrefix], ttl_s: float, auto: bool) -> EdgeOutcome:
        if not plan:
            return EdgeOutcome(edge.name, edge.address, True)
        put_blocks = put_bytes = 0
        try:
            with EdgeLink(edge, self.settings.token) as link:
                pinned = pinned_bytes = 0
                for prefix in plan:
                    ns = prefix.ns_id or None
                    blocks, nbytes, leading = self._fill(link, prefix, ns)
                    put_blocks, put_bytes = put_blocks + blocks, put_bytes + nbytes
                    keys, sizes = prefix.keys[:leading], prefix.sizes[:leading]
                    if not keys:
                        continue
                    confirmed = link.soft_pin(keys, ns, ttl_s)
                    ok_keys = [k for k, ok in zip(keys, confirmed) if ok]
                    ok_sizes = [s for s, ok in zip(sizes, confirmed) if ok]
                    with self._lock:
                        self._ledger(edge.name).record(ok_keys, ok_sizes, self._clock() + ttl_s, auto)
                    pinned, pinned_bytes = pinned + len(ok_keys), pinned_bytes + sum(ok_sizes)
        except EdgePushError as exc:
            log.warning("event=preplace_edge_failed edge=%s error=%s", edge.name, exc)
            self._recorder.failed(edge.name, edge.address, str(exc), put_blocks, put_bytes)
            return EdgeOutcome(edge.name, edge.address, False, put_blocks, put_bytes, error=str(exc))
        self._recorder.pushed(edge.name, edge.address, put_blocks, put_bytes, pinned)
        log.info("event=preplaced edge=%s blocks_put=%d bytes_put=%d pinned=%d ttl_s=%g", edge.name, put_blocks,
                 put_bytes, pinned, ttl_s)
        return EdgeOutcome(edge.name, edge.address, True, put_blocks, put_bytes, pinned, pinned_bytes)

    def _fill(self, link: EdgeLink, prefix: PlannedPrefix, ns: bytes | None) -> tuple[int, int, int]:
        """PUT the blocks of ``prefix`` the edge lacks, read here in READ_CHUNK_BYTES batches, up
        to the first one this region no longer has when read (behind it the edge would hold no
        prefix): (blocks put, bytes put, how many leading keys of ``prefix`` the edge has now)."""
        present = link.present(prefix.keys, ns).tolist()
        missing = [i for i, here in enumerate(present) if not here]
        blocks_put = bytes_put = 0
        start = 0
        while start < len(missing):
            end, size = start, 0
            while end < len(missing) and (end == start or size + prefix.sizes[missing[end]] <= READ_CHUNK_BYTES):
                size += prefix.sizes[missing[end]]
                end += 1
            keys = [prefix.keys[i] for i in missing[start:end]]
            blocks = self._engine.get_many(keys)  # verified (header, key, payload CRC), None when gone
            found = next((j for j, block in enumerate(blocks) if block is None), len(blocks))
            if found:
                bytes_put += link.put(keys[:found], blocks[:found], ns)
                blocks_put += found
            if found < len(blocks):
                return blocks_put, bytes_put, missing[start + found]
            start = end
        return blocks_put, bytes_put, len(prefix.keys)

    # -- figures ------------------------------------------------------------------------
    def statistics(self) -> PreplaceStatistics:
        now = self._clock()
        with self._lock:
            popularity = self._popularity.statistics()
            soft = {name: ledger.live_bytes(now) for name, ledger in self._ledgers.items()}
        observed, dropped = self.observer.counts()
        return self._recorder.snapshot(popularity, observed, dropped, soft)
