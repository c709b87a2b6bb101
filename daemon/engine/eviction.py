"""Region eviction policies (pure bookkeeping, no I/O).

A policy orders the *sealed* regions for reclaim. The engine tells it when a
region is sealed (``track``), read (``touch``) and reclaimed or freed
(``remove``); ``candidates()`` yields regions, first to evict first.

* FIFO: the order regions were sealed in; reads do not matter.
* LRU:  the order of the last read (or seal) of any block in the region.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Protocol

EVICTION_POLICIES = ("fifo", "lru")


class EvictionPolicy(Protocol):
    name: str

    def track(self, region: int) -> None: ...

    def touch(self, region: int) -> None: ...

    def remove(self, region: int) -> None: ...

    def candidates(self) -> Iterator[int]: ...

    def __len__(self) -> int: ...


class FifoPolicy:
    name = "fifo"

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def track(self, region: int) -> None:
        assert region not in self._order, f"region {region} tracked twice"
        self._order[region] = None

    def touch(self, region: int) -> None:
        pass

    def remove(self, region: int) -> None:
        self._order.pop(region, None)

    def candidates(self) -> Iterator[int]:
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._order)


class LruPolicy(FifoPolicy):
    name = "lru"

    def touch(self, region: int) -> None:
        if region in self._order:
            self._order.move_to_end(region)


def make_policy(name: str) -> EvictionPolicy:
    if name == "fifo":
        return FifoPolicy()
    if name == "lru":
        return LruPolicy()
    raise ValueError(f"unknown eviction policy {name!r}; expected one of {EVICTION_POLICIES}")
