"""Closing a data connection so that the frames sent last arrive intact."""
from __future__ import annotations

import socket
import time

from kvtier.wire import connection as p
from kvtier.wire.sockets import RECV_CHUNK_BYTES, sendmsg_all

CLOSE_DRAIN_BYTES_MAX = 4 << 20  # unread bytes swallowed before closing on an error, so the error frame
CLOSE_DRAIN_S = 0.5  # is not destroyed by a TCP reset; bounded in bytes and time


def send_error_quietly(sock: socket.socket, conn: p.Connection, request_id: int, code: p.ErrorCode,
                       message: str) -> None:
    """Send an error frame, then half-close and drain so it arrives intact."""
    try:
        sock.settimeout(CLOSE_DRAIN_S)
        sendmsg_all(sock, conn.send_parts(p.ErrorReply(request_id, code, message)))
    except OSError:
        return
    linger(sock)


def linger(sock: socket.socket) -> None:
    """Half-close, then swallow what the peer still sends (bounded), so the
    frames we sent are not destroyed by a reset when we close."""
    try:
        sock.settimeout(CLOSE_DRAIN_S)
        sock.shutdown(socket.SHUT_WR)
        deadline, drained = time.monotonic() + CLOSE_DRAIN_S, 0
        while drained < CLOSE_DRAIN_BYTES_MAX and time.monotonic() < deadline:
            chunk = sock.recv(RECV_CHUNK_BYTES)
            if not chunk:
                break
            drained += len(chunk)
    except OSError:
        pass
