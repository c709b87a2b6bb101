"""Which keys of one upstream request are still open as its owners are asked rank by rank:
pure bookkeeping, no I/O, no clock (the pull-through asks and keeps the time).

Every key is asked of its first owner (rank 0, :meth:`~.targets.UpstreamTarget.owners_by_rank`),
then of its next owner where the one before left it open, and so on. Each answer says per key
FOUND, LACKED (the owner said it does not hold it) or UNKNOWN (no word on it: the call failed or
was not made, the copy failed verification, or it comes after a LOOKUP's first miss)::

    rank 0     A: k0 FOUND   k2 LACKED        B: k1 (call failed: UNKNOWN)
    rank 1     C: k2 FOUND                    A: k1 LACKED
               open: k1     fallbacks: 2 (k1, k2)     fallback hits: 1 (k2)

A key is absent upstream only where each of its owners said LACKED: the one answer a negative
cache may keep (k1 above is not: B never answered for it).
"""
from __future__ import annotations

import enum
from typing import Hashable, Mapping, Sequence, TypeVar

Owner = TypeVar("Owner", bound=Hashable)


class Answer(enum.Enum):
    FOUND = "found"
    LACKED = "lacked"
    UNKNOWN = "unknown"


def lookup_answers(asked: int, present: int) -> list[Answer]:
    """A LOOKUP of ``asked`` keys that held a leading ``present``: the next one is lacked, the
    rest unknown (a LOOKUP stops at its first miss)."""
    assert 0 <= present <= asked, f"LOOKUP of {asked} keys answered {present}"
    return [Answer.FOUND] * present + [Answer.LACKED] * (present < asked) + [Answer.UNKNOWN] * (asked - present - 1)


class RankWalk:
    """One request's keys (positions ``0..count-1``) over ``ranks`` ranks of owners."""

    def __init__(self, count: int, ranks: int):
        assert count >= 0 and ranks >= 0, f"count {count}, ranks {ranks}"
        self.ranks = ranks
        self.rank = 0  # the rank being asked; ranks when all were
        self.open = list(range(count))  # ascending positions not found by the ranks done
        self.fallbacks = 0  # positions a rank left open for the next
        self.fallback_hits = 0  # positions found past rank 0
        self._lacked = [0] * count  # per position, owners that said they do not hold it
        self._ahead: list[int] = []  # positions the current rank leaves open

    def asks(self, owners: Mapping[Owner, Sequence[int]]) -> dict[Owner, list[int]]:
        """``owners`` (the current rank's ``{owner: positions}``) narrowed to the open positions;
        owners left with none are dropped."""
        assert self.rank < self.ranks, f"rank {self.rank} of {self.ranks}"
        still = set(self.open)
        out = {owner: [i for i in idx if i in still] for owner, idx in owners.items()}
        return {owner: idx for owner, idx in out.items() if idx}

    def answered(self, positions: Sequence[int], answers: Sequence[Answer] | None) -> None:
        """One owner's answers for ``positions`` of this rank; None: it gave none."""
        if answers is None:
            self._ahead.extend(positions)
            return
        assert len(answers) == len(positions), f"{len(answers)} answers for {len(positions)} keys"
        for i, answer in zip(positions, answers):
            if answer is Answer.FOUND:
                if self.rank:
                    self.fallback_hits += 1
                continue
            if answer is Answer.LACKED:
                self._lacked[i] += 1
            self._ahead.append(i)

    def end_rank(self) -> None:
        """Close the current rank: what it left open goes to the next (a fallback, if there is one)."""
        assert self.rank < self.ranks, f"rank {self.rank} of {self.ranks}"
        self.open, self._ahead = sorted(self._ahead), []
        self.rank += 1
        if self.rank < self.ranks:
            self.fallbacks += len(self.open)

    @property
    def done(self) -> bool:
        return not self.open or self.rank == self.ranks

    def absent(self) -> list[int]:
        """Open positions that every owner of theirs said it lacks (none before every rank was asked)."""
        if self.rank < self.ranks or not self.ranks:
            return []
        return [i for i in self.open if self._lacked[i] == self.ranks]
