"""systemd's sd_notify protocol, spoken directly (no libsystemd).

Datagrams of ``KEY=VALUE`` lines to the unix socket named by
``$NOTIFY_SOCKET``; a leading ``@`` names an abstract socket. Without the
variable every call is a no-op, so the daemon runs the same outside systemd.
"""
from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("kvtier.daemon.notify")


class Notifier:
    def __init__(self, environ=None):
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET", "")
        self._address = ("\0" + path[1:]) if path.startswith("@") else path
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        watchdog_on = usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid()))
        self.watchdog_interval_s: float | None = int(usec) / 2e6 if watchdog_on else None

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def notify(self, *lines: str) -> bool:
        """Send the lines as one datagram; False (and a log line) if it failed."""
        if not self._address:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto("\n".join(lines).encode(), self._address)
            return True
        except OSError as exc:
            log.warning("event=sd_notify_failed error=%s", exc)
            return False

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, status: str) -> bool:
        return self.notify(f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def reloading(self) -> bool:
        return self.notify("RELOADING=1")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")
