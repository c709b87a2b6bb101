"""Gathered socket writes shared by the block clients and the daemon: every buffer
goes out with ``sendmsg`` (header and payload views, no joining copy)."""
from __future__ import annotations

import socket

SENDMSG_IOV_MAX = 512  # buffers per sendmsg call, under Linux's IOV_MAX of 1024


def sendmsg_all(sock: socket.socket, parts) -> int:
    """Write every buffer of ``parts`` in order; the bytes sent (all of them, unless it raises)."""
    views = [v for v in (memoryview(b).cast("B") for b in parts) if v.nbytes]
    total, i = 0, 0
    while i < len(views):
        n = sock.sendmsg(views[i:i + SENDMSG_IOV_MAX])
        total += n
        while n:
            if n >= views[i].nbytes:
                n -= views[i].nbytes
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0
    return total
