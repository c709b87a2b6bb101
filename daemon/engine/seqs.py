"""Sequence numbers: every block, metadata record and region header takes the next one."""
from __future__ import annotations


class SeqCounter:
    """The next seq to hand out; seqs only grow (a region's blocks outrank whatever it held before)."""

    def __init__(self, next_seq: int = 1):
        self.next = next_seq

    def take(self) -> int:
        seq = self.next
        self.next += 1
        return seq
