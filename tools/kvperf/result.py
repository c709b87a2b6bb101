"""What a clone sends back to the parent, and what a job adds up to."""
from __future__ import annotations

from dataclasses import dataclass, field

from .stats import OpArrays, OpLog

VERIFY_MESSAGES_MAX = 10  # first few verify errors are kept verbatim; the rest are counted


class ConnectError(RuntimeError):
    """A target could not be reached or refused us (exit status 2)."""


@dataclass
class CloneLog:
    """Mutable, filled by one clone's single event loop."""

    read: OpLog = field(default_factory=OpLog)
    write: OpLog = field(default_factory=OpLog)
    lookup: OpLog = field(default_factory=OpLog)
    misses: int = 0
    verify_errors: int = 0
    verify_messages: list[str] = field(default_factory=list)
    laid_out_blocks: int = 0
    verified_blocks: int = 0
    lookup_keys: int = 0
    lookup_found: int = 0
    # prefix workload
    requests: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    request_lat_ns: list[int] = field(default_factory=list)
    direct_blocks: int = 0
    direct_fallbacks: int = 0

    def verify_error(self, message: str) -> None:
        self.verify_errors += 1
        if len(self.verify_messages) < VERIFY_MESSAGES_MAX:
            self.verify_messages.append(message)

    def finish(self, runtime_ns: int) -> "CloneResult":
        return CloneResult(
            read=self.read.arrays(), write=self.write.arrays(), lookup=self.lookup.arrays(),
            runtime_ns=runtime_ns, counters={k: getattr(self, k) for k in COUNTERS},
            verify_messages=tuple(self.verify_messages),
            request_lat_ns=tuple(self.request_lat_ns),
        )


COUNTERS = ("misses", "verify_errors", "laid_out_blocks", "verified_blocks", "lookup_keys", "lookup_found",
            "requests", "blocks", "hit_blocks", "direct_blocks", "direct_fallbacks")


@dataclass(frozen=True)
class CloneResult:
    read: OpArrays
    write: OpArrays
    lookup: OpArrays
    runtime_ns: int
    counters: dict
    verify_messages: tuple[str, ...]
    request_lat_ns: tuple[int, ...]


@dataclass(frozen=True)
class JobResult:
    """A job's clones merged (fio's group_reporting)."""

    read: OpArrays
    write: OpArrays
    lookup: OpArrays
    runtime_ns: int
    counters: dict
    verify_messages: tuple[str, ...]
    request_lat_ns: tuple[int, ...]
    clones: int
    ttft: dict | None = None  # the ttft workload's own report

    @staticmethod
    def merge(parts: list[CloneResult]) -> "JobResult":
        counters = {k: sum(p.counters[k] for p in parts) for k in COUNTERS}
        messages: list[str] = []
        for p in parts:
            messages.extend(p.verify_messages)
        return JobResult(
            read=OpArrays.merge([p.read for p in parts]),
            write=OpArrays.merge([p.write for p in parts]),
            lookup=OpArrays.merge([p.lookup for p in parts]),
            runtime_ns=max((p.runtime_ns for p in parts), default=0),
            counters=counters,
            verify_messages=tuple(messages[:VERIFY_MESSAGES_MAX]),
            request_lat_ns=tuple(x for p in parts for x in p.request_lat_ns),
            clones=len(parts),
        )
