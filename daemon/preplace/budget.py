"""Which hot prefixes fit an edge's pre-placement budget. Pure: no I/O.

The candidates come ranked (most popular first) with the size of each of their blocks
as the region's index has it (0: the region does not hold that block). A prefix is
worth only its leading blocks the region holds, so each candidate is cut at its first
absent block. Blocks already planned (an earlier candidate's) cost nothing again; the
ranked prefixes of :mod:`.popularity` share none, since a chain that continues another
is folded into it there. Candidates are taken in rank order while they fit; the first one
that does not fit whole contributes the leading blocks that do, and planning stops there::

    budget 10 blocks      A (6 blocks)  B (3 of them A's)  C (6)     D (1)
    planned               A: 6          B: 3 new, 0 cost   C: 4 fit  (stop: D is not taken)

``already_held`` (key -> size) are blocks the edge keeps pinned for us from earlier rounds:
their bytes count against the budget whether planned again or not, and planning one of
them again costs nothing more. So what is held never exceeds the budget; a held prefix
that left the top frees its room when its pin runs out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np


@dataclass(frozen=True)
class Candidate:
    ns_id: bytes
    keys: Sequence[bytes]  # the chain, in order
    sizes: Sequence[int]  # per key: the block's stored size in bytes at the region, 0 when absent


@dataclass(frozen=True)
class PlannedPrefix:
    ns_id: bytes
    keys: tuple[bytes, ...]  # the leading blocks to place (each once over the whole plan)
    sizes: tuple[int, ...]

    @property
    def size_bytes(self) -> int:
        return sum(self.sizes)


def held_leading(sizes: Sequence[int]) -> int:
    """How many leading blocks are present (size > 0)."""
    present = np.asarray(sizes, dtype=np.int64) > 0
    return int(len(present) if present.all() else np.argmin(present))


def plan_within_budget(candidates: Iterable[Candidate], budget_bytes: int,
                       already_held: Mapping[bytes, int] | None = None) -> list[PlannedPrefix]:
    """The blocks to place, per prefix in rank order, at most ``budget_bytes`` in all
    (``already_held`` included)."""
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must not be negative, got {budget_bytes}")
    held = already_held or {}
    planned: list[PlannedPrefix] = []
    chosen: set[bytes] = set()
    left = budget_bytes - sum(held.values())
    for candidate in candidates:
        if len(candidate.keys) != len(candidate.sizes):
            raise ValueError(f"{len(candidate.keys)} keys but {len(candidate.sizes)} sizes")
        keys, sizes, full = [], [], True
        for key, size in zip(candidate.keys[:held_leading(candidate.sizes)], candidate.sizes):
            if key in chosen:
                continue
            cost = 0 if key in held else size
            if cost > left:
                full = False
                break
            keys.append(key)
            sizes.append(int(size))
            chosen.add(key)
            left -= cost
        if keys:
            planned.append(PlannedPrefix(candidate.ns_id, tuple(keys), tuple(sizes)))
        if not full:
            break
    return planned
