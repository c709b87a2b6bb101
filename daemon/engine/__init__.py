"""kvtier's block engine: a log-structured, content-addressed flash cache on a
striped O_DIRECT array (after CacheLib Navy's block cache).

Modules, one job each:

* :mod:`.devices`          file / block / memory / fault-injecting devices
* :mod:`.raid0`            striping (``kvtier.common.stripe``) and parallel device I/O
* :mod:`.buffers`          pool of aligned read buffers
* :mod:`.reader`           verified block reads
* :mod:`.superblock`       per-device identity and geometry (format)
* :mod:`.store`            format and open-time validation of the devices
* :mod:`.regionfmt`        region header, summary entries and trailer (format)
* :mod:`.openregion`       the open region's DRAM image
* :mod:`.regions`          region table and accounting
* :mod:`.eviction`         FIFO / LRU region policies
* :mod:`.reinsertion`      which hot blocks a reclaim moves instead of dropping
* :mod:`.index`            compact key -> location hash table (NumPy)
* :mod:`.blockmap`         the index and the region table kept in step: a block's seq, dropping blocks
* :mod:`.block_events`     the listener hook told of blocks stored, removed, all cleared
* :mod:`.seqs`             sequence numbers
* :mod:`.allocator`        the open region, its spare image, seal
* :mod:`.region_manager`   reclaim, eviction and reinsertion over the region pool
* :mod:`.durability`       what is written and synced, in which order
* :mod:`.get_driver`       every GET: DRAM images, flash reads, retries
* :mod:`.pins_and_deletes` deletes and pins with their durable records
* :mod:`.soft_pins`        pins with a TTL, in memory only
* :mod:`.take_back`        what a failed request appended, taken back (all or nothing)
* :mod:`.no_space`         the one-line text of a NoSpaceError from reclaim
* :mod:`.recovery`         finding every region's entries on flash, picking the live blocks
* :mod:`.rebuild`          the index and region table rebuilt at open
* :mod:`.fsck`             offline check (and repair) of a stopped store
* :mod:`.config`           EngineConfig
* :mod:`.statistics`       EngineStatistics, EngineCounters
* :mod:`.locations`        BlockLocation, LOCATION_DTYPE
* :mod:`.errors`           EngineError, NoSpaceError, GeometryError, DeviceError
* :mod:`.engine`           the facade
"""
from .config import EngineConfig
from .engine import Engine
from .errors import (BadArgumentError, BlockTooLargeError, DeviceError, EngineBugError, EngineError, EngineFailedError,
                     GeometryError, NoSpaceError, WaitTimeoutError)
from .locations import LOCATION_DTYPE, BlockLocation
from .statistics import EngineStatistics

__all__ = ["BlockTooLargeError", "Engine", "EngineConfig", "EngineStatistics", "BlockLocation", "LOCATION_DTYPE",
           "EngineError", "EngineFailedError", "EngineBugError", "BadArgumentError", "WaitTimeoutError", "NoSpaceError", "GeometryError", "DeviceError"]
