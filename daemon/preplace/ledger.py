"""What the region believes it holds soft-pinned at one edge. Pure: the clock is passed in.

Each key the edge confirmed pinned is kept with its size, when its soft pin runs out and
whether the periodic pusher placed it (``auto``) or an operator did (/v1/preplace). The
pusher's budget counts the live ``auto`` bytes, so what it keeps pinned at an edge never
exceeds ``preplace_bytes``; the metrics read the live bytes of both kinds. An edge that
restarts forgets its soft pins before the ledger does: the figure is the region's view.
Past LEDGER_KEYS_MAX keys, the ones that run out soonest are forgotten first.
"""
from __future__ import annotations

import heapq
from typing import Iterable

LEDGER_KEYS_MAX = 1 << 20  # keys tracked per edge (a 1 TiB edge of 1 MiB blocks); ~100 MiB at worst


class EdgeLedger:
    def __init__(self, keys_max: int = LEDGER_KEYS_MAX):
        self._keys_max = keys_max
        self._entries: dict[bytes, tuple[int, float, bool]] = {}  # key -> (size, expires_s, auto)

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, keys: Iterable[bytes], sizes: Iterable[int], expires_s: float, auto: bool) -> None:
        """These keys are soft-pinned at the edge until ``expires_s``. A key pinned by an operator
        stays an operator's until it runs out (the pusher re-pinning it does not make it count)."""
        for key, size in zip(keys, sizes):
            old = self._entries.get(key)
            if old is None:
                self._entries[key] = (int(size), expires_s, auto)
            else:
                self._entries[key] = (int(size), max(expires_s, old[1]), auto and old[2])
        if len(self._entries) > self._keys_max:
            for key in heapq.nsmallest(len(self._entries) - self._keys_max, self._entries,
                                       key=lambda k: self._entries[k][1]):
                del self._entries[key]

    def expire(self, now_s: float) -> None:
        for key in [k for k, (_, expires, _) in self._entries.items() if expires <= now_s]:
            del self._entries[key]

    def live_auto(self, now_s: float) -> dict[bytes, int]:
        """key -> size of the pusher's own soft pins still running at ``now_s``."""
        self.expire(now_s)
        return {k: size for k, (size, _, auto) in self._entries.items() if auto}

    def live_bytes(self, now_s: float) -> tuple[int, int]:
        """(blocks, bytes) soft-pinned at ``now_s``, both kinds."""
        self.expire(now_s)
        return len(self._entries), sum(size for size, _, _ in self._entries.values())
