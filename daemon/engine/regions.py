"""The region table: state and accounting of every region (pure, no I/O).

Regions cycle FREE -> OPEN -> SEALED -> (reclaimed) FREE -> OPEN ... . At most one
region is OPEN: it takes all appends. The FREE regions are the clean-region pool the region
manager's worker keeps filled; a region a reclaim freed still holds its old contents on flash
until it is opened again (``stale_on_flash``), and counts as live for the records that must
outlive what it holds. A region whose reclaim failed on device errors is *retired*: it leaves
the policy, is never reused and still serves what it holds. The table keeps, per region, the seq
base (the index stores ``seq - base_seq``), live and pinned byte counts (for
the reclaim decision) and the last access time; the eviction policy orders
the sealed ones.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from enum import IntEnum

import numpy as np

from .eviction import EvictionPolicy, make_policy

VICTIM_QUEUE_REGIONS = 64  # regions of the policy's order taken per snapshot (see RegionTable.next_victim)
RECLAIM_PINNED_FRACTION_MAX = 0.5  # a region whose pinned bytes exceed this share of its room is not reclaimed:
#                                    moving them would free too little (and all-pinned regions would cycle forever)


class RegionState(IntEnum):
    """A region's state in the table -- and, in recovery and fsck, as found on flash."""

    FREE = 0
    OPEN = 1
    SEALED = 2


class RegionTable:
    def __init__(self, region_count: int, region_capacity_bytes: int, policy: str):
        assert region_count >= 2, region_count
        self.region_count = region_count
        self.region_capacity_bytes = region_capacity_bytes
        self.policy: EvictionPolicy = make_policy(policy)
        self.state = np.zeros(region_count, np.uint8)
        self.base_seq = np.zeros(region_count, np.uint64)
        self.last_seq = np.zeros(region_count, np.uint64)
        self.data_end = np.zeros(region_count, np.int64)
        self.live_blocks = np.zeros(region_count, np.int64)
        self.live_bytes = np.zeros(region_count, np.int64)
        self.pinned_bytes = np.zeros(region_count, np.int64)
        self.last_access_s = np.zeros(region_count, np.float64)
        # metadata records (tombstones, pins) stored in each region's summary, kept so that reclaiming
        # the region can carry forward the ones still needed: {region: [(kind, k0, k1, ns, seq, target_seq)]}
        self.meta_records: dict[int, list[tuple]] = {}
        self._free: deque[int] = deque(range(region_count))
        self._seal_in_flight: int | None = None  # tracked by the policy, not yet a victim
        self.stale_on_flash = np.zeros(region_count, bool)  # FREE, but its last use is still on flash
        self.retired: set[int] = set()
        self.reclaiming: set[int] = set()  # out of the policy while the region manager reclaims them
        self._victim_queue: list[int] = []  # a snapshot of the policy's order, consumed from the end
        self._victim_queue_taken_s = 0.0

    # -- lifecycle -------------------------------------------------------
    def take_free(self) -> int | None:
        return self._free.popleft() if self._free else None

    def take_free_region(self, region: int) -> None:
        """Take this FREE region from the pool (an in-place compaction opens it again)."""
        assert self.state[region] == RegionState.FREE, f"region {region} taken while {self.state[region]}"
        self._free.remove(region)

    def give_back_free(self, region: int) -> None:
        """A region taken from the pool but not opened: the pool's first again."""
        assert self.state[region] == RegionState.FREE, f"region {region} given back while {self.state[region]}"
        self._free.appendleft(region)

    def open(self, region: int, base_seq: int, now_s: float) -> None:
        assert self.state[region] != RegionState.OPEN, f"region {region} is already open"
        assert self.live_blocks[region] == 0, f"region {region} opened with {self.live_blocks[region]} live blocks"
        self.state[region] = RegionState.OPEN
        self.base_seq[region] = self.last_seq[region] = base_seq
        self.data_end[region] = 0
        self.pinned_bytes[region] = self.live_bytes[region] = 0
        self.last_access_s[region] = now_s
        self.meta_records.pop(region, None)
        self.stale_on_flash[region] = False

    def seal_started(self, region: int) -> None:
        """The region's image went to the sealer: the policy orders it from now (so its place, and
        reads of it meanwhile, do not depend on when the write completes); it is no victim until
        :meth:`seal`."""
        assert self.state[region] == RegionState.OPEN, f"region {region} sealed while {self.state[region]}"
        assert self._seal_in_flight is None, f"region {self._seal_in_flight} is still being sealed"
        self.policy.track(region)
        self._seal_in_flight = region

    def seal(self, region: int, last_seq: int, data_end: int) -> None:
        """The seal write completed (the policy tracks the region from :meth:`seal_started`, or now)."""
        assert self.state[region] == RegionState.OPEN, f"region {region} sealed while {self.state[region]}"
        if self._seal_in_flight == region:
            self._seal_in_flight = None
        else:
            self.policy.track(region)
        self.state[region] = RegionState.SEALED
        self.last_seq[region] = last_seq
        self.data_end[region] = data_end

    def restore_sealed(self, region: int, base_seq: int, last_seq: int, data_end: int, now_s: float) -> None:
        """Recovery: a region found sealed on flash (call in seal order)."""
        if region in self._free:
            self._free.remove(region)
        self.state[region] = RegionState.SEALED
        self.base_seq[region], self.last_seq[region], self.data_end[region] = base_seq, last_seq, data_end
        self.last_access_s[region] = now_s
        self.policy.track(region)

    def release(self, region: int) -> None:
        """A reclaimed region (out of the policy since :meth:`begin_reclaim`) joins the clean pool;
        its old contents stay on flash until it is opened again."""
        self.policy.remove(region)
        self.reclaiming.discard(region)
        assert self.live_blocks[region] == 0, f"region {region} released with {self.live_blocks[region]} live blocks"
        self.state[region] = RegionState.FREE
        self.live_blocks[region] = self.live_bytes[region] = self.pinned_bytes[region] = 0
        self.meta_records.pop(region, None)
        self.stale_on_flash[region] = True
        self._free.append(region)

    def begin_reclaim(self, region: int) -> None:
        """The region leaves the policy while the region manager reclaims it (still SEALED: reads go on)."""
        assert self.state[region] == RegionState.SEALED, f"region {region} reclaimed while {self.state[region]}"
        self.policy.remove(region)
        self.reclaiming.add(region)

    def abandon_reclaim(self, region: int) -> None:
        """A reclaim that changed nothing: the region is a candidate again (the policy's newest)."""
        self.reclaiming.discard(region)
        self.policy.track(region)

    def retire(self, region: int) -> None:
        """Never reclaimed or reused again (until a restart): a reclaim of it failed on device errors."""
        self.policy.remove(region)
        self.reclaiming.discard(region)
        self.retired.add(region)

    def live_for_records(self) -> np.ndarray:
        """Regions whose contents recovery may still read: not free, or freed but not yet rewritten."""
        return (self.state != RegionState.FREE) | self.stale_on_flash

    def discard_open(self, region: int) -> None:
        """An open region given up without a seal (it only staged copies): free again, taken first."""
        assert self.state[region] == RegionState.OPEN, f"region {region} discarded while {self.state[region]}"
        self.state[region] = RegionState.FREE
        self.live_blocks[region] = self.live_bytes[region] = self.pinned_bytes[region] = 0
        self.meta_records.pop(region, None)
        self._free.appendleft(region)

    def reset_all(self) -> None:
        for region in list(self.policy.candidates()):
            self.policy.remove(region)
        self.__init__(self.region_count, self.region_capacity_bytes, self.policy.name)

    # -- accounting ------------------------------------------------------
    def add_block(self, region: int, nbytes: int, pinned: bool) -> None:
        self.live_blocks[region] += 1
        self.live_bytes[region] += nbytes
        if pinned:
            self.pinned_bytes[region] += nbytes

    def drop_blocks(self, regions: np.ndarray, nbytes: np.ndarray, pinned: np.ndarray) -> None:
        np.subtract.at(self.live_blocks, regions, 1)
        np.subtract.at(self.live_bytes, regions, nbytes)
        np.subtract.at(self.pinned_bytes, regions, np.where(pinned, nbytes, 0))

    def set_pinned(self, region: int, nbytes: int, pinned: bool) -> None:
        self.pinned_bytes[region] += nbytes if pinned else -nbytes

    def touch(self, region: int, now_s: float) -> None:
        self.last_access_s[region] = now_s
        self.policy.touch(region)

    # -- queries ---------------------------------------------------------
    def victims(self, extra_pinned_bytes: np.ndarray | None = None) -> list[int]:
        """Every sealed region that may be reclaimed, in policy order (first to evict first).
        ``extra_pinned_bytes`` (per region) count as pinned too: soft pins, which the table does not keep."""
        limit = self.region_capacity_bytes * RECLAIM_PINNED_FRACTION_MAX
        pinned = self.pinned_bytes if extra_pinned_bytes is None else self.pinned_bytes + extra_pinned_bytes
        return [region for region in self.policy.candidates()
                if self.state[region] == RegionState.SEALED and pinned[region] <= limit]

    def pinned_cost_bytes(self, extra_pinned_bytes: np.ndarray | None = None) -> int:
        """What pins cost the cache: a region pinned past RECLAIM_PINNED_FRACTION_MAX is never
        reclaimed, so it costs its whole room; any other region costs its pinned bytes (a reclaim moves
        them and frees the rest). ``extra_pinned_bytes`` (per region) count as pinned too."""
        pinned = self.pinned_bytes if extra_pinned_bytes is None else self.pinned_bytes + extra_pinned_bytes
        stuck = pinned > self.region_capacity_bytes * RECLAIM_PINNED_FRACTION_MAX
        return int(np.where(stuck, self.region_capacity_bytes, pinned).sum())

    def next_victim(self, extra_pinned_bytes: np.ndarray | None = None) -> int | None:
        """The first sealed region in policy order that may be reclaimed, or None. The policy's order
        is snapshotted once per VICTIM_QUEUE_REGIONS victims, not copied per reclaim, so the cost of a
        reclaim does not grow with the region count; an entry is skipped where the region changed
        since the snapshot (reused: another base_seq; LRU: read since, so no longer near the front)."""
        limit = self.region_capacity_bytes * RECLAIM_PINNED_FRACTION_MAX
        pinned = self.pinned_bytes if extra_pinned_bytes is None else self.pinned_bytes + extra_pinned_bytes
        for attempt in range(2):
            if attempt or not self._victim_queue:
                order = list(itertools.islice(self.policy.candidates(), VICTIM_QUEUE_REGIONS))
                self._victim_queue = [(region, int(self.base_seq[region])) for region in reversed(order)]
                self._victim_queue_taken_s = time.time()
            while self._victim_queue:
                region, base_seq = self._victim_queue.pop()
                if self.state[region] != RegionState.SEALED or region in self.retired or \
                        region in self.reclaiming or int(self.base_seq[region]) != base_seq or pinned[region] > limit:
                    continue
                if self.policy.name == "lru" and self.last_access_s[region] > self._victim_queue_taken_s:
                    continue
                return region
        return None

    def requeue_victim(self, region: int) -> None:
        """A region :meth:`next_victim` returned but the caller did not reclaim: first again."""
        self._victim_queue.append((region, int(self.base_seq[region])))

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def sealed_count(self) -> int:
        return int(np.count_nonzero(self.state == RegionState.SEALED))
