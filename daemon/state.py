"""DaemonState: the one place the running daemon's state lives.

The admin API, the data server and the signal handlers all read it from here:
the engine, the effective config (frozen; ``config.redacted()`` for display),
the data server (``data_server.statistics()`` is a frozen snapshot), the
current auth token (reloadable on SIGHUP), the ready flag and the start time.
"""
from __future__ import annotations

import threading
import time

from kvtier.common.tokens import TokenFileError, read_token_file, token_matches
from kvtier.daemon.config import ConfigError, DaemonConfig

def read_token(path: str) -> str:
    """The token in ``path``; ConfigError names the problem."""
    try:
        return read_token_file(path)
    except TokenFileError as exc:
        raise ConfigError(str(exc)) from None


class DaemonState:
    """Shared, thread-safe view of the running daemon."""

    def __init__(self, config: DaemonConfig, engine, data_server=None):
        self.engine = engine
        self.data_server = data_server
        self.start_time_s = time.time()
        self.data_address: tuple[str, int] | None = None
        self.admin_address: tuple[str, int] | None = None
        self.kv_events = None  # a kvtier.daemon.events.service.KVEvents with --kv-events-endpoint
        self.upstream = None  # a kvtier.daemon.upstream.PullThrough with --upstream
        self.preplacer = None  # a kvtier.daemon.preplace.pusher.PrePlacer with --preplace-edges
        self.nixl = None  # a kvtier.daemon.nixl.service.NixlService with --nixl auto|on (NIXL installed)
        self._lock = threading.Lock()
        self._config = config
        self._token = read_token(config.token_file) if config.token_file else None
        self._ready = threading.Event()

    @property
    def config(self) -> DaemonConfig:
        with self._lock:
            return self._config

    def set_config(self, config: DaemonConfig) -> None:
        """Swap in a reloaded config and re-read its token file (SIGHUP)."""
        token = read_token(config.token_file) if config.token_file else None
        with self._lock:
            self._config, self._token = config, token

    @property
    def token(self) -> str | None:
        with self._lock:
            return self._token

    def check_token(self, presented: str | None) -> bool:
        """True when no token is configured or ``presented`` matches it."""
        return token_matches(presented, self.token)

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def set_ready(self, ready: bool = True) -> None:
        (self._ready.set if ready else self._ready.clear)()

    @property
    def uptime_s(self) -> float:
        return time.time() - self.start_time_s
