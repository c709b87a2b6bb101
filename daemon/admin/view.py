"""What the admin API and the metrics collector read from the daemon, in one place.

:class:`AdminStateView` wraps the daemon's ``DaemonState`` (``kvtier.daemon.state``)
and gives the admin routes and the Prometheus collector a small, fixed surface:
the engine, the data server's ``statistics()``, the current token (it changes on
SIGHUP, so it is read per request), the ready flag, the start time and the
redacted effective config. Nothing here caches: every call reads the live state.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from kvtier.common.addresses import format_address


def _as_dict(obj: Any) -> dict:
    """A statistics snapshot (frozen dataclass, mapping, or None) as a plain dict."""
    if obj is None:
        return {}
    if callable(getattr(obj, "as_dict", None)):
        return dict(obj.as_dict())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, dict):
        return dict(obj)
    if hasattr(obj, "_asdict"):
        return dict(obj._asdict())
    raise TypeError(f"cannot read a statistics snapshot of type {type(obj).__name__}")


class AdminStateView:
    """Read-only access to a :class:`kvtier.daemon.state.DaemonState` for the admin thread."""

    def __init__(self, state) -> None:
        self._state = state
        self.internal_errors = 0  # admin requests that raised an unexpected exception (500)

    def count_internal_error(self, reason: str) -> None:
        self.internal_errors += 1

    @property
    def engine(self):
        return self._state.engine

    def token(self) -> str | None:
        """The token clients must present now (None: loopback clients only)."""
        return self._state.token

    def check_token(self, presented: str) -> bool:
        """Constant-time comparison with the current token (the daemon's own check)."""
        return self._state.check_token(presented)

    def ready(self) -> bool:
        """True once devices are open and the index is recovered."""
        return bool(self._state.ready)

    def start_time_unix_s(self) -> float:
        return float(self._state.start_time_s)

    def uptime_s(self) -> float:
        return max(0.0, time.time() - self.start_time_unix_s())

    def addresses(self) -> dict:
        """The bound ``HOST:PORT`` of the data port and the admin API (None before binding)."""
        def fmt(addr):
            return None if addr is None else format_address(*addr[:2])
        return {"data": fmt(self._state.data_address), "admin": fmt(self._state.admin_address)}

    def engine_statistics(self) -> dict:
        return _as_dict(self.engine.statistics())

    def server_statistics(self) -> dict:
        """The data server's snapshot; empty before the data server exists."""
        server = self._state.data_server
        if server is None:
            return {}
        return dict(_as_dict(server.statistics()), buffers=_as_dict(server.reply_arena_statistics()))

    def devices(self) -> dict:
        """The stripe set: each device's id (from its superblock) and local path, in
        stripe order - what a client needs to build a direct-read device map."""
        geometry = self.engine.geometry
        paths = self._state.config.engine_config().device_paths
        return {
            "stripe_size_bytes": geometry.stripe_size_bytes,
            "data_offset_bytes": geometry.data_offset_bytes,
            "device_data_bytes": geometry.device_data_bytes,
            "devices": [{"index": i, "device_id": dev, "path": path}
                        for i, (dev, path) in enumerate(zip(geometry.device_ids, paths))],
        }

    def cluster_statistics(self) -> dict:
        """The cluster membership's snapshot (``--cluster``); empty for a standalone node."""
        member = getattr(self._state, "cluster", None)  # set by the entry point once registered
        return {} if member is None else _as_dict(member.statistics())

    def kv_events(self):
        """The daemon's :class:`kvtier.daemon.events.service.KVEvents`, or None (off)."""
        return getattr(self._state, "kv_events", None)

    def kv_events_statistics(self) -> dict:
        """The KV-events publisher's snapshot; empty without --kv-events-endpoint."""
        events = self.kv_events()
        return {} if events is None else _as_dict(events.statistics())

    def preplacer(self):
        """The daemon's :class:`kvtier.daemon.preplace.pusher.PrePlacer`, or None (no --preplace-edges)."""
        return getattr(self._state, "preplacer", None)

    def preplace_statistics(self) -> dict:
        """Pre-placement's snapshot; empty without --preplace-edges."""
        placer = self.preplacer()
        return {} if placer is None else _as_dict(placer.statistics())

    def nixl_statistics(self) -> dict:
        """The NIXL service's snapshot; empty without --nixl or before a client started its agent."""
        nixl = getattr(self._state, "nixl", None)
        return {} if nixl is None else nixl.statistics()

    def upstream_statistics(self) -> dict:
        """The pull-through's snapshot (``--upstream``); empty without an upstream."""
        upstream = getattr(self._state, "upstream", None)
        return {} if upstream is None else _as_dict(upstream.statistics())

    def redacted_config(self) -> dict:
        return _as_dict(self._state.config.redacted())
