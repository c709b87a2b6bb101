"""kvtier's figures in vLLM 0.33's connector stats (``KVConnectorStats``, imports vLLM).

Each worker's ``get_kv_connector_stats`` returns the counts since its last
call; vLLM sums them over the workers (``aggregate``), accumulates them over
its logging interval and logs ``reduce()`` as ``KV Transfer metrics: ...``
(``vllm/distributed/kv_transfer/kv_connector/v1/metrics.py``,
``KVConnectorLogging``). A dropped write-behind save shows here as
``saves_dropped`` / ``blocks_dropped``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

COUNTS = ("loaded_blocks", "failed_blocks", "saved_blocks", "failed_saves", "skipped_saves", "saves_done",
          "saves_failed", "saves_dropped", "blocks_dropped")


@dataclass
class KVTierConnectorStats(KVConnectorStats):
    """``data``: the counts of :data:`COUNTS` over an interval (missing ones are 0)."""

    def __post_init__(self) -> None:
        unknown = set(self.data) - set(COUNTS)
        if unknown:
            raise ValueError(f"unknown kvtier connector stats {sorted(unknown)}")
        self.data = {name: int(self.data.get(name, 0)) for name in COUNTS}

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTS, 0)

    def aggregate(self, other: KVConnectorStats) -> "KVTierConnectorStats":
        merged = {name: self.data[name] + int(other.data.get(name, 0)) for name in COUNTS}
        return KVTierConnectorStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def delta(now: dict[str, int], before: dict[str, int]) -> KVTierConnectorStats | None:
    """The counts since ``before``, or None when nothing changed."""
    diff: dict[str, Any] = {name: now.get(name, 0) - before.get(name, 0) for name in COUNTS}
    return KVTierConnectorStats(data=diff) if any(diff.values()) else None
