"""The keys this node deleted lately, so that a cluster's re-replication does not copy them back
from a replica that missed the delete (pure bookkeeping, no I/O; memory only).

::

    DELETE k, delete_namespace   record(k, now)     a delete that succeeded (durable) records its keys
    PUT k                        forget(k)          a key stored again is no longer deleted here
    PUT k, FLAG_SKIP_DELETED     contains(k)        a copy (read-repair) of a key deleted here is not stored
    GET /v1/keys/deleted         page(cursor)       what ``kvtier cluster repair`` reads

Bounded twice: at most ``DELETED_KEYS_MAX`` keys (the oldest delete goes first) and for at most
``DELETED_KEY_AGE_S`` seconds. A restart starts empty. Past either bound, a replica that missed
a delete may have it copied back (a block of the right key: a cache entry kept longer than asked,
never wrong data).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Sequence

import numpy as np

from .errors import BadArgumentError

DELETED_KEYS_MAX = 1 << 17  # about 30 MiB of Python objects; 4 TiB of 32 MiB blocks
DELETED_KEY_AGE_S = 24 * 3600.0  # a replica away longer than this may get deleted blocks back


class DeletedKeys:
    def __init__(self, keys_max: int = DELETED_KEYS_MAX, age_s: float = DELETED_KEY_AGE_S,
                 clock: Callable[[], float] = time.monotonic):
        assert keys_max >= 1 and age_s > 0, f"keys_max {keys_max}, age_s {age_s}"
        self._keys_max, self._age_s, self._clock = keys_max, age_s, clock
        self._at: OrderedDict[tuple[int, int], float] = OrderedDict()  # (k0, k1) -> when, oldest first

    def __len__(self) -> int:
        return len(self._at)

    def record(self, k0: Sequence[int], k1: Sequence[int]) -> None:
        """The keys (little-endian uint64 halves, as the index holds them) deleted now."""
        now = self._clock()
        for key in zip(_ints(k0), _ints(k1)):
            self._at[key] = now
            self._at.move_to_end(key)
        while len(self._at) > self._keys_max:
            self._at.popitem(last=False)

    def contains(self, k0: int, k1: int) -> bool:
        """Whether the key was deleted here lately (and not stored since)."""
        at = self._at.get((k0, k1))
        return at is not None and at > self._clock() - self._age_s

    def forget(self, k0: Sequence[int], k1: Sequence[int]) -> None:
        if not self._at:  # the common case: nothing deleted lately
            return
        for key in zip(_ints(k0), _ints(k1)):
            self._at.pop(key, None)

    def clear(self) -> None:
        self._at.clear()

    def page(self, cursor: int, limit: int) -> tuple[bytes, int]:
        """Up to ``limit`` deleted keys from position ``cursor`` on, oldest delete first (16 bytes each,
        joined), and the next page's cursor (0 after the last). A listing, not a snapshot, as ``/v1/keys``."""
        if cursor < 0 or limit < 1:
            raise BadArgumentError(f"cursor {cursor} and limit {limit}: need cursor >= 0 and limit >= 1")
        self._expire()
        keys = list(self._at)[cursor:cursor + limit]
        after = cursor + len(keys)
        return np.array(keys, "<u8").reshape(-1, 2).tobytes(), after if keys and after < len(self._at) else 0

    def _expire(self) -> None:
        oldest = self._clock() - self._age_s
        while self._at:
            key, at = next(iter(self._at.items()))
            if at > oldest:
                return
            del self._at[key]


def _ints(halves: Sequence[int]) -> list[int]:
    return halves.tolist() if isinstance(halves, np.ndarray) else [int(h) for h in halves]
