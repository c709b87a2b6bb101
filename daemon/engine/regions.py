"""The region table: state and accounting of every region (pure, no I/O).

Regions cycle FREE -> OPEN -> SEALED -> (reclaimed) OPEN ... . At most one
region is OPEN: it takes all appends. The table keeps, per region, the seq
base (the index stores ``seq - base_seq``), live and pinned byte counts (for
the reclaim decision) and the last access time; the eviction policy orders
the sealed ones.
"""
from __future__ import annotations

from collections import deque
from enum import IntEnum

import numpy as np

from .eviction import EvictionPolicy, make_policy

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

    # -- lifecycle -------------------------------------------------------
    def take_free(self) -> int | None:
        return self._free.popleft() if self._free else None

    def open(self, region: int, base_seq: int, now_s: float) -> None:
        assert self.state[region] != RegionState.OPEN, f"region {region} is already open"
        assert self.live_blocks[region] == 0, f"region {region} opened with {self.live_blocks[region]} live blocks"
        self.state[region] = RegionState.OPEN
        self.base_seq[region] = self.last_seq[region] = base_seq
        self.data_end[region] = 0
        self.pinned_bytes[region] = self.live_bytes[region] = 0
        self.last_access_s[region] = now_s
        self.meta_records.pop(region, None)

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
        """A reclaimed region leaves the policy; the caller opens it next."""
        self.policy.remove(region)
        self.state[region] = RegionState.FREE
        self.live_blocks[region] = self.live_bytes[region] = self.pinned_bytes[region] = 0
        self.meta_records.pop(region, None)

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
    def victims(self) -> list[int]:
        """Every sealed region that may be reclaimed, in policy order (first to evict first)."""
        limit = self.region_capacity_bytes * RECLAIM_PINNED_FRACTION_MAX
        return [region for region in self.policy.candidates()
                if self.state[region] == RegionState.SEALED and self.pinned_bytes[region] <= limit]

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def sealed_count(self) -> int:
        return int(np.count_nonzero(self.state == RegionState.SEALED))
