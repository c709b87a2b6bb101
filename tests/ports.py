"""A loopback port for a process a test starts with a fixed address (one a restart keeps).

A port the kernel hands out for ``bind(0)`` lies in the ephemeral range, where it also picks the
source port of every connection and the port of every daemon started on ``:0``: between the probe
and the daemon's own bind, another test's process can take it ("Address already in use"). So the
port is drawn below that range, where the kernel never assigns one by itself, and probed there.
"""
from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FIXED_PORT_MIN = 10000  # above the well-known and registered services a test machine may run
PROBES_MAX = 200  # ports tried before giving up (each a bind on loopback)


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A loopback TCP port free now, outside the kernel's ephemeral range."""
    high = _ephemeral_low()
    for _ in range(PROBES_MAX):
        port = random.randrange(FIXED_PORT_MIN, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in [{FIXED_PORT_MIN}, {high}) after {PROBES_MAX} tries")
