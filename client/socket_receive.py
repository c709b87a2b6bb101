"""Blocking socket reads into a sans-IO :class:`~kvtier.client.protocol.Connection`, shared
by the blocking client and the daemon: a pending payload is received straight into its
buffer (``recv_into``), everything else in chunks for the parser."""
from __future__ import annotations

import socket

RECV_CHUNK_BYTES = 64 << 10  # frame headers and small frames (payloads land in their buffer); under
# glibc's mmap threshold: a 256 KiB recv() costs an mmap + munmap per call (~20 us)


def receive_some(sock: socket.socket, conn) -> None:
    """One blocking receive into ``conn``; the end of the stream is fed to it as ``b""``."""
    view = conn.payload_view()
    if view is None:
        conn.receive_data(sock.recv(RECV_CHUNK_BYTES))
        return
    n = sock.recv_into(view)
    if n:
        conn.payload_received(n)
    else:
        conn.receive_data(b"")
