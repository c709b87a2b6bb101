"""Opening the engine: the index and the region table rebuilt from what recovery finds on flash.

Regions found open at the crash get the summary they never got (they are sealed); the live
blocks go into a fresh index sized for them; the first seq handed out lies above every seq
that may still be on flash.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from .errors import DeviceError
from .index import PINNED_BIT, SEQ_DELTA_MAX, BlockIndex
from .raid0 import StripedArray
from .recovery import LiveSet, RegionScan, scan_regions, select_live, write_summary
from .regions import RegionState, RegionTable

log = logging.getLogger("kvtier.daemon.engine")

SEQ_RESTART_GAP = 1 << 20  # seqs skipped at restart, so no seq of an unacknowledged, torn write is ever reused
INDEX_LOAD_AT_OPEN = 0.75  # the rebuilt index starts this full


@dataclass(frozen=True)
class RebuiltState:
    index: BlockIndex
    next_seq: int
    recovered_blocks: int
    recovery_seconds: float
    unsealed_regions: list[int] = field(default_factory=list)  # found open; their summary could not be written


def rebuild(array: StripedArray, table: RegionTable, region_size_bytes: int, generation: int, seq_floor: int,
            track_hits: bool) -> RebuiltState:
    """Scan every region, seal the ones found open, restore the region table (in seal order)
    and load the live blocks into a new index."""
    t0 = time.monotonic()
    scans = scan_regions(array, table.region_count, region_size_bytes, generation, seq_floor)
    live = select_live(scans)
    now = time.time()
    unsealed = []
    for scan in sorted((s for s in scans if s.kind != RegionState.FREE), key=lambda s: s.base_seq):
        if scan.kind == RegionState.OPEN and not _seal_recovered(array, scan, generation):
            unsealed.append(scan.region)
        table.restore_sealed(scan.region, scan.base_seq, scan.last_seq, scan.data_end, now)
    index = _load_live(live, table, region_size_bytes, track_hits)
    # above every seq that may still be on flash -- this generation's, an erased one's (the
    # floor), and any region header's span, of any generation: a reused region's new blocks
    # then always outrank, and its recovery walk stops at, whatever the region held before
    on_flash_max = max([seq_floor, live.max_seq] + [scan.seq_bound for scan in scans])
    return RebuiltState(index, on_flash_max + SEQ_RESTART_GAP, len(live.k0), time.monotonic() - t0, unsealed)


def _seal_recovered(array: StripedArray, scan: RegionScan, generation: int) -> bool:
    """A region that was open at the crash: write the summary it never got. A device that refuses
    the write (a full filesystem under a sparse device file) does not stop the start: the region
    is served as found (read only, like a sealed one) and sealed at the next start; False then."""
    try:
        write_summary(array, scan.image, scan.region, generation, scan.entries, scan.base_seq, scan.data_end)
    except DeviceError as exc:
        log.warning("event=recovered_region_unsealed region=%d error=%s (its blocks are served; its summary is "
                    "written at the next start)", scan.region, exc)
        return False
    finally:
        scan.image = None
    return True


def _load_live(live: LiveSet, table: RegionTable, region_size_bytes: int, track_hits: bool) -> BlockIndex:
    # computed in place, one temporary column at a time: this is recovery's memory peak
    delta = table.base_seq[live.region]
    np.subtract(live.seq, delta, out=delta)
    assert np.all(delta <= SEQ_DELTA_MAX), "a region's seq span exceeds the index's delta field"
    meta = delta.astype(np.uint32)
    del delta
    np.bitwise_or(meta, np.uint32(PINNED_BIT), out=meta, where=live.pinned)
    addr = live.region.astype(np.uint64)
    addr *= np.uint64(region_size_bytes)
    addr += live.offset
    index = BlockIndex(capacity=int(len(live.k0) / INDEX_LOAD_AT_OPEN) + 1, track_hits=track_hits)
    index.insert_many(live.k0, live.k1, addr, live.length, meta)
    del addr, meta
    regions = len(table.live_blocks)
    table.live_blocks += np.bincount(live.region, minlength=regions).astype(table.live_blocks.dtype)
    table.live_bytes += np.bincount(live.region, live.length, minlength=regions).astype(table.live_bytes.dtype)
    table.pinned_bytes += np.bincount(live.region[live.pinned], live.length[live.pinned],
                                      minlength=regions).astype(table.pinned_bytes.dtype)
    for region, records in live.meta_records.items():
        table.meta_records[region] = list(records)
    return index
