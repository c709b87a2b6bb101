"""Which unpinned blocks of a region being reclaimed are moved to the new
region instead of dropped (after CacheLib Navy's ReinsertionPolicy; pure, no I/O).

Pinned blocks are always moved (an engine rule, not a policy choice). For the
others, the engine keeps a saturating read count per block (reset when a block
is written or moved) and asks the policy which to keep:

* ``NoReinsertion``: none (plain FIFO / LRU region eviction).
* ``HitsReinsertion(hits_min)``: blocks read at least ``hits_min`` times since
  they were written or last moved, hottest first, then in region order, up to a
  byte budget -- so a reclaim always frees most of a region, and a block stays
  only while it keeps being read.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from .index import HITS_MAX
HOT_REINSERT_FRACTION_MAX = 0.25  # hot blocks moved per reclaim: at most this share of a region's room
#                                   (pinned blocks may take up to half): a reclaim frees at least a quarter


class ReinsertionPolicy(Protocol):
    def select(self, hits: np.ndarray, cost_bytes: np.ndarray, budget_bytes: int) -> np.ndarray:
        """A boolean mask over the candidate blocks (in region order): the ones to move.
        ``cost_bytes``: room each one takes in the new region; their sum stays within ``budget_bytes``."""
        ...


class NoReinsertion:
    def select(self, hits: np.ndarray, cost_bytes: np.ndarray, budget_bytes: int) -> np.ndarray:
        return np.zeros(len(hits), bool)


class HitsReinsertion:
    def __init__(self, hits_min: int):
        if not 1 <= hits_min <= HITS_MAX:
            raise ValueError(f"hits_min must be in 1..{HITS_MAX}, got {hits_min}")
        self.hits_min = hits_min

    def select(self, hits: np.ndarray, cost_bytes: np.ndarray, budget_bytes: int) -> np.ndarray:
        chosen = np.zeros(len(hits), bool)
        candidates = np.flatnonzero(hits >= self.hits_min)
        order = candidates[np.argsort(-hits[candidates].astype(np.int64), kind="stable")]  # hottest first
        fits = np.cumsum(cost_bytes[order].astype(np.int64)) <= budget_bytes
        chosen[order[fits]] = True  # a prefix: the first block over budget ends the selection
        return chosen


def make_reinsertion(hits_min: int) -> ReinsertionPolicy:
    """``hits_min`` 0: no reinsertion of unpinned blocks; n >= 1: HitsReinsertion(n)."""
    return NoReinsertion() if hits_min == 0 else HitsReinsertion(hits_min)
