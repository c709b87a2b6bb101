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
    recovery_seconds: float
    index_bytes: int
