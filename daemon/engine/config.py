"""Engine configuration (frozen, validated)."""
from __future__ import annotations

from dataclasses import dataclass

from kvtier.common.aligned import ALIGNMENT_BYTES
from .eviction import EVICTION_POLICIES
from .index import HITS_MAX
from .superblock import DEVICE_COUNT_MAX

STRIPE_SIZE_DEFAULT_BYTES = 1 << 20  # RAID0 stripe unit: large enough for sequential device I/O
REGION_SIZE_DEFAULT_BYTES = 64 << 20  # unit of writing and eviction (CacheLib Navy's default is 16 MiB; KV blocks are big)
IO_THREADS_PER_DEVICE_DEFAULT = 2  # enough to keep one file/NVMe queue busy from Python
CLEAN_REGIONS_TARGET_DEFAULT = 2  # clean regions the reclaim worker keeps ready: one for writers, one it compacts into
CLEAN_REGIONS_TARGET_MAX = 1024  # a pool is empty flash: more than this is a misconfiguration
PINNED_FRACTION_MAX_DEFAULT = 0.5  # pins (hard and soft) may hold half the store: the other half keeps the cache


@dataclass(frozen=True)
class EngineConfig:
    device_paths: tuple[str, ...]
    device_size_bytes: int | None = None  # size of files created when missing
    stripe_size_bytes: int = STRIPE_SIZE_DEFAULT_BYTES
    region_size_bytes: int = REGION_SIZE_DEFAULT_BYTES
    eviction: str = "fifo"
    io_threads_per_device: int = IO_THREADS_PER_DEVICE_DEFAULT
    # unpinned blocks read at least this many times since written (or last moved) are moved, not
    # dropped, when their region is reclaimed (hottest first, a quarter of a region at most); 0: off
    reinsertion_hits_min: int = 0
    # clean regions the background reclaim worker keeps ready (at most an eighth of the store's regions,
    # at least the one it compacts pinned blocks into): a PUT waits only when they are all taken
    clean_regions_target: int = CLEAN_REGIONS_TARGET_DEFAULT
    # pinned bytes (hard and soft pins) may hold at most this fraction of the store's room for blocks;
    # a PIN past it is refused (PinLimitError), PUTs never are
    pinned_fraction_max: float = PINNED_FRACTION_MAX_DEFAULT
    # a directory on a filesystem beside the store (the daemon's data directory) for the rescue
    # journal of an in-place compaction at open (rescue.py); None: a store left with no clean region
    # is not repaired at open
    rescue_dir: str | None = None

    def __post_init__(self) -> None:
        paths = tuple(str(p) for p in self.device_paths) if not isinstance(self.device_paths, str) else None
        if not paths:
            raise ValueError("EngineConfig.device_paths must list at least one device (a sequence of paths)")
        object.__setattr__(self, "device_paths", paths)
        if len(paths) > DEVICE_COUNT_MAX:
            raise ValueError(f"EngineConfig.device_paths lists {len(paths)} devices; at most {DEVICE_COUNT_MAX}")
        if len(set(paths)) != len(paths):
            raise ValueError(f"EngineConfig.device_paths lists a device twice: {paths}")
        if self.device_size_bytes is not None and (self.device_size_bytes <= 0 or self.device_size_bytes % ALIGNMENT_BYTES):
            raise ValueError(f"EngineConfig.device_size_bytes must be a positive multiple of {ALIGNMENT_BYTES}, "
                             f"got {self.device_size_bytes}")
        if self.stripe_size_bytes <= 0 or self.stripe_size_bytes % ALIGNMENT_BYTES:
            raise ValueError(f"EngineConfig.stripe_size_bytes must be a positive multiple of {ALIGNMENT_BYTES}, "
                             f"got {self.stripe_size_bytes}")
        width = self.stripe_size_bytes * len(paths)
        if self.region_size_bytes <= 0 or self.region_size_bytes % width:
            raise ValueError(f"EngineConfig.region_size_bytes ({self.region_size_bytes}) must be a positive multiple "
                             f"of the stripe width {width} (stripe_size_bytes x {len(paths)} devices)")
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"EngineConfig.eviction must be one of {EVICTION_POLICIES}, got {self.eviction!r}")
        if not 0 <= self.reinsertion_hits_min <= HITS_MAX:
            raise ValueError(f"EngineConfig.reinsertion_hits_min must be in 0..{HITS_MAX} (0: off), "
                             f"got {self.reinsertion_hits_min}")
        if isinstance(self.pinned_fraction_max, bool) or not isinstance(self.pinned_fraction_max, (int, float)) \
                or not 0 <= self.pinned_fraction_max <= 1:
            raise ValueError(f"EngineConfig.pinned_fraction_max must be a fraction in [0, 1], "
                             f"got {self.pinned_fraction_max!r}")
        if isinstance(self.clean_regions_target, bool) or not isinstance(self.clean_regions_target, int) or \
                not 1 <= self.clean_regions_target <= CLEAN_REGIONS_TARGET_MAX:
            raise ValueError(f"EngineConfig.clean_regions_target must be an integer in 1..{CLEAN_REGIONS_TARGET_MAX}, "
                             f"got {self.clean_regions_target!r}")
        if self.io_threads_per_device < 1:
            raise ValueError(f"EngineConfig.io_threads_per_device must be >= 1, got {self.io_threads_per_device}")
