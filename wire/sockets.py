"""The only socket code of the data protocol, shared by the blocking client and the daemon (the
connection driver, :mod:`.channel`, calls it).

Writes are gathered: every buffer goes out with ``sendmsg`` (header and payload
views, no joining copy). Reads feed a sans-IO :class:`~kvtier.wire.connection.Connection`:
a pending payload is received straight into its buffer (``recv_into``), everything
else in chunks for the parser; a payload scattered over several buffers with
``recvmsg_into`` (:mod:`~kvtier.wire.payload_pieces`)."""
from __future__ import annotations

import socket

SENDMSG_IOV_MAX = 512  # buffers per sendmsg call, under Linux's IOV_MAX of 1024


def connect(host: str, port: int, timeout_s: float) -> socket.socket:
    """A TCP connection to ``host:port`` (within ``timeout_s``), small frames sent at once (TCP_NODELAY)."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def sendmsg_all(sock: socket.socket, parts) -> int:
    """Write every buffer of ``parts`` (contiguous, any shape) in order; the bytes sent (all of
    them, unless it raises). Only a buffer cut by a short send is wrapped in a memoryview."""
    buffers, sizes = [], []
    for buf in parts:
        size = memoryview(buf).nbytes
        if size:
            buffers.append(buf)
            sizes.append(size)
    total, i = 0, 0
    while i < len(buffers):
        n = sock.sendmsg(buffers[i:i + SENDMSG_IOV_MAX])
        total += n
        while n:
            if n >= sizes[i]:
                n -= sizes[i]
                i += 1
            else:
                buffers[i] = memoryview(buffers[i]).cast("B")[n:]
                sizes[i] -= n
                n = 0
    return total


RECV_CHUNK_BYTES = 64 << 10  # frame headers and small frames (payloads land in their buffer); under
# glibc's mmap threshold, above which every recv() buffer is an mmap + munmap


def receive_some(sock: socket.socket, conn) -> None:
    """One blocking receive into ``conn``; the end of the stream is fed to it as ``b""``.
    A payload scattered over several buffers is received with ``recvmsg_into``."""
    views = conn.payload_views()
    if views is None:
        conn.receive_data(sock.recv(RECV_CHUNK_BYTES))
        return
    _receive_into(sock, conn, views)


def receive_payload(sock: socket.socket, conn, landed=None) -> None:
    """Receive the rest of ``conn``'s pending payload, as :func:`receive_some` would one call at a
    time but without asking the parser in between; ``landed(filled)`` after each receive, with the
    bytes of the payload in so far. Returns once it is in, or at the end of the stream (fed to
    ``conn`` as ``b""``)."""
    while (views := conn.payload_views()) is not None:
        if not _receive_into(sock, conn, views):
            return
        if landed is not None:
            landed(conn.payload_filled)


def _receive_into(sock: socket.socket, conn, views: list) -> bool:
    """One receive into the payload's ``views``; False at the end of the stream (fed to ``conn``)."""
    n = sock.recv_into(views[0]) if len(views) == 1 else sock.recvmsg_into(views)[0]
    if n:
        conn.payload_received(n)
    else:
        conn.receive_data(b"")
    return bool(n)
