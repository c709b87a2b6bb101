"""kvtierd's upstream (``--upstream HOST:PORT|etcd://HOST:PORT/PREFIX``): an edge daemon that
answers what it lacks from a regional one, like a CDN's origin pull, and keeps it.

- :mod:`.errors`          what can fail, by kind (each is a miss for the edge's client)
- :mod:`.channel`         one authenticated connection, every call bounded by a deadline
- :mod:`.client`          UpstreamClient: pooled get / lookup / put / pin against one daemon
- :mod:`.targets`         whom to ask: one address, or the region's etcd members by rendezvous
- :mod:`.rank_walk`       which keys are still open as their owners are asked in rank order (pure)
- :mod:`.negative_cache`  keys the upstream lacks, remembered briefly (pure, bounded, TTL)
- :mod:`.store_queue`     fetched blocks stored behind into the engine (bounded; drops counted)
- :mod:`.statistics`      counters and the fetch latency histogram, as a frozen snapshot
- :mod:`.pull_through`    PullThrough: the LOOKUP and GET side the request handler calls

The daemon imports none of ``kvtier.client``: the client here is built on ``kvtier.wire``.
"""
from __future__ import annotations

from .client import UPSTREAM_POOL_SIZE, UpstreamBlocks, UpstreamClient
from .errors import (FailureKind, UpstreamAuthError, UpstreamError, UpstreamProtocolError, UpstreamTimeout,
                     UpstreamUnavailable)
from .pull_through import PullThrough
from .statistics import UpstreamStatistics
from .targets import EtcdTarget, StaticTarget, UpstreamTarget, open_target

__all__ = ["FailureKind", "PullThrough", "UPSTREAM_POOL_SIZE", "UpstreamAuthError", "UpstreamBlocks",
           "UpstreamClient", "UpstreamError", "UpstreamProtocolError", "UpstreamStatistics", "UpstreamTarget",
           "UpstreamTimeout", "UpstreamUnavailable", "StaticTarget", "EtcdTarget", "open_pull_through", "open_target"]


def open_pull_through(text: str, token: str | None, timeout_s: float, engine) -> PullThrough:
    """The pull-through for ``--upstream text``, storing behind into ``engine``."""
    return PullThrough(open_target(text, token, timeout_s), engine)
