"""The admin HTTP API of kvtierd: FastAPI served by uvicorn in a background thread.

::

    kvtierd main thread                 admin thread (this module)
    +-------------------+  DaemonState  +------------------------------+
    | data server       | ------------> | uvicorn  ->  FastAPI app     |
    | engine            |               |   /healthz /readyz /metrics  |
    +-------------------+               |   /v1/stats /v1/blocks/...   |
                                        |   /v1/pin /v1/unpin /v1/evict|
                                        |   /v1/config                 |
                                        +------------------------------+

The app lives in :mod:`.app`; this module owns only the listening socket and
the thread. The socket is bound here, before uvicorn starts, so
:meth:`AdminServer.start` knows and returns the real address (port 0 picks a
free one) and a client that connects at once waits in the backlog instead of
being refused.
"""
from __future__ import annotations

import logging
import socket
import threading

import uvicorn

from kvtier.daemon.admin.auth import is_loopback_host
from kvtier.daemon.admin.app import build_app
from kvtier.daemon.admin.view import AdminStateView

log = logging.getLogger("kvtier.admin")

LISTEN_BACKLOG = 128  # admin traffic is a few operators and one Prometheus
STOP_TIMEOUT_S = 10.0  # uvicorn finishes in-flight requests well within this
GRACEFUL_SHUTDOWN_S = 5  # an admin request is short; do not hold up daemon shutdown


class AdminServerError(RuntimeError):
    """The admin API could not start (address in use, non-loopback without a token, ...)."""


class AdminServer:
    """Serve the admin API for ``state`` on ``host:port`` from a background thread."""

    def __init__(self, state, host: str, port: int) -> None:
        self._view = AdminStateView(state)
        self._host = host
        self._port = port
        self._thread: threading.Thread | None = None
        self._server: uvicorn.Server | None = None
        self._sock: socket.socket | None = None
        self.app = build_app(self._view)

    @property
    def address(self) -> tuple[str, int] | None:
        """The bound ``(host, port)``, or None before :meth:`start`."""
        if self._sock is None:
            return None
        host, port = self._sock.getsockname()[:2]
        return host, port

    def start(self) -> tuple[str, int]:
        """Bind, start serving in a thread, return the real ``(host, port)``."""
        if self._thread is not None:
            raise AdminServerError("admin server already started")
        if not is_loopback_host(self._host) and not self._view.token():
            raise AdminServerError(
                f"refusing to serve the admin API on non-loopback address {self._host!r} "
                "without a token (set token_file)")
        self._sock = self._bind()
        # log_config=None: uvicorn's loggers propagate to the daemon's logging setup
        config = uvicorn.Config(self.app, log_config=None, log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="kvtier-admin", daemon=True)
        self._thread.start()
        address = self.address
        assert address is not None
        log.info("admin API listening on %s:%d", *address)
        return address

    def stop(self) -> None:
        """Ask uvicorn to exit, wait for the thread, close the socket. Idempotent."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(STOP_TIMEOUT_S)
            if self._thread.is_alive():
                log.warning("admin thread did not stop within %.0f s", STOP_TIMEOUT_S)
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _bind(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self._host, self._port))
            sock.listen(LISTEN_BACKLOG)
        except OSError as exc:
            sock.close()
            raise AdminServerError(f"cannot bind the admin API to {self._host}:{self._port}: {exc}") from exc
        sock.set_inheritable(False)
        return sock

    def _serve(self) -> None:
        assert self._server is not None and self._sock is not None
        try:
            self._server.run(sockets=[self._sock])
        except Exception:  # the daemon keeps its data port; the failure is logged loudly
            log.exception("admin API thread failed")
            raise
