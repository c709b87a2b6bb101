"""kvtier's block engine: a log-structured, content-addressed flash cache on a
striped O_DIRECT array (after CacheLib Navy's block cache).

Modules, one job each:

* :mod:`.devices`     file / block / memory / fault-injecting devices
* :mod:`.raid0`       striping (``kvtier.common.stripe``) and parallel device I/O
* :mod:`.buffers`     pool of aligned read buffers
* :mod:`.reader`      verified block reads
* :mod:`.superblock`  per-device identity and geometry (format)
* :mod:`.store`       format and open-time validation of the devices
* :mod:`.regionfmt`   region header, summary entries and trailer (format)
* :mod:`.openregion`  the open region's DRAM image
* :mod:`.regions`     region table and accounting
* :mod:`.eviction`    FIFO / LRU region policies
* :mod:`.reinsertion` which hot blocks a reclaim moves instead of dropping
* :mod:`.index`       compact key -> location hash table (NumPy)
* :mod:`.recovery`    rebuilding the index from flash
* :mod:`.fsck`        offline check (and repair) of a stopped store
* :mod:`.config`      EngineConfig, EngineStatistics, BlockLocation
* :mod:`.errors`      EngineError, NoSpaceError, GeometryError, DeviceError
* :mod:`.engine`      the facade
"""
from .config import LOCATION_DTYPE, BlockLocation, EngineConfig, EngineStatistics
from .engine import Engine
from .errors import BlockTooLargeError, DeviceError, EngineError, GeometryError, NoSpaceError

__all__ = ["BlockTooLargeError", "Engine", "EngineConfig", "EngineStatistics", "BlockLocation", "LOCATION_DTYPE", "EngineError", "NoSpaceError",
           "GeometryError", "DeviceError"]
