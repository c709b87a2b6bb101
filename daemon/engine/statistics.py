"""The engine's running counters and the immutable snapshot ``Engine.statistics()`` returns."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineCounters:
    """Counts kept as the engine works; every update is made under the engine lock."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    put_bytes: int = 0
    get_bytes: int = 0
    evicted_blocks: int = 0
    evicted_regions: int = 0
    reinsertions: int = 0
    device_errors: int = 0
    alloc_failures: int = 0
    corrupt_reads: int = 0
    recovered_blocks: int = 0
    puts_received_in_place: int = 0  # of puts: blocks received straight into the open region (no copy)
    puts_skipped_deleted: int = 0  # blocks of copies (read-repair, re-replication) not stored: deleted here lately
    pins_refused: int = 0  # PIN requests refused at the pinned-bytes limit (pinned_fraction_max)
    clean_region_waits: int = 0  # writers that found the clean-region pool empty and waited for the reclaim worker
    clean_region_wait_seconds: float = 0.0  # the time they waited, summed
    reclaims: int = 0  # regions the reclaim worker returned to the pool
    rescues: int = 0  # in-place compactions at open of a store with no clean region (rescue journal)
    reclaim_errors: int = 0  # reclaims given up on a device error (the region back in the policy, or retired)
    regions_retired: int = 0  # regions never reused again (until a restart) after device errors in their reclaim
    group_commits: int = 0  # durability commits run (each one write pass and fdatasync for every caller waiting)
    durable_commit_waiters: int = 0  # callers acknowledged by those commits (durable puts, flushes, reclaims)


@dataclass(frozen=True)
class EngineStatistics:
    blocks: int
    bytes_stored: int
    regions_total: int
    regions_free: int
    regions_sealed: int
    hits: int
    misses: int
    puts: int
    put_bytes: int
    get_bytes: int
    evicted_blocks: int
    evicted_regions: int
    reinsertions: int
    device_errors: int
    alloc_failures: int
    corrupt_reads: int
    recovered_blocks: int
    puts_received_in_place: int
    puts_skipped_deleted: int
    recovery_seconds: float
    index_bytes: int
    pins_refused: int = 0
    pinned_bytes: int = 0  # hard and soft pins
    soft_pinned_bytes: int = 0
    soft_pins: int = 0  # soft pins live now (some of their blocks may be gone)
    soft_pins_expired: int = 0  # soft pins that ran out since the start
    pinned_bytes_max: int = 0  # the limit: pinned_fraction_max of the store's room for blocks
    pinned_cost_bytes: int = 0  # what pins cost: their bytes, or a whole region's room where they keep it from reclaim
    clean_region_waits: int = 0
    clean_region_wait_seconds: float = 0.0
    reclaims: int = 0
    rescues: int = 0
    reclaim_errors: int = 0
    regions_retired: int = 0
    group_commits: int = 0
    durable_commit_waiters: int = 0
    clean_regions_target: int = 0  # the pool size the reclaim worker keeps (clean_regions_target, bounded)
