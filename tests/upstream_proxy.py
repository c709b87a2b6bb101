"""A small TCP proxy between an edge kvtierd and its upstream, for the pull-through tests.

    proxy = FrameProxy("127.0.0.1:PORT_OF_REGION")      # listens on 127.0.0.1:proxy.port
    proxy.delay_s = 0.02          # each reply frame from the upstream is held this long (WAN latency)
    proxy.flip_get_payload = True # flip the last payload byte of every GET reply (a corrupt block)
    proxy.cut_get_after = 4096    # forward only this many payload bytes of a GET reply, then close
    proxy.stall_get = True        # forward a GET reply's header, then send nothing more
    proxy.close()

It reads the upstream's byte stream frame by frame (the 32-byte header says how long each
is), so faults land where they are meant to: in a GET reply's payload, never in HELLO.
Requests from the edge pass through unchanged. This kernel has tbf but not netem, hence a
proxy for latency.
"""
from __future__ import annotations

import socket
import threading
import time

from kvtier.wire.events import REPLY_BIT, Op
from kvtier.wire.frames import FRAME_HEADER, FRAME_HEADER_SIZE

GET_REPLY = Op.GET | REPLY_BIT


class FrameProxy:
    def __init__(self, upstream: str, listen_host: str = "127.0.0.1"):
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self.delay_s = 0.0
        self.flip_get_payload = False
        self.cut_get_after: int | None = None
        self.stall_get = False
        self.get_replies = 0  # GET replies that passed (or were faulted)
        self.connections = 0
        self._listener = socket.create_server((listen_host, 0))
        self.address = f"{listen_host}:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                try:
                    s.close()
                except OSError:
                    pass

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._sockets += [client, server]
                self.connections += 1
            threading.Thread(target=self._pipe, args=(client, server), daemon=True).start()
            threading.Thread(target=self._replies, args=(server, client), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(1 << 16):
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            _shut_both(src, dst)

    def _replies(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                head = _recv_exactly(src, FRAME_HEADER_SIZE)
                if head is None:
                    break
                fields = FRAME_HEADER.unpack(head)
                op, meta_len, payload_len = fields[2], fields[6], fields[7]
                body = _recv_exactly(src, meta_len + payload_len)
                if body is None:
                    break
                if self.delay_s:
                    time.sleep(self.delay_s)
                if op == GET_REPLY and payload_len:
                    self.get_replies += 1
                    if self.stall_get:
                        dst.sendall(head)
                        self._stop.wait()
                        break
                    if self.cut_get_after is not None:
                        dst.sendall(head + body[:meta_len + self.cut_get_after])
                        break
                    if self.flip_get_payload:
                        body = body[:-1] + bytes([body[-1] ^ 0xFF])
                dst.sendall(head + body)
        except OSError:
            pass
        finally:
            _shut_both(src, dst)


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(1 << 20, n - len(buf)))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _shut_both(*socks: socket.socket) -> None:
    """Shut both directions of each socket (already closed ones too), so the other pipe ends."""
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
