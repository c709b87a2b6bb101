"""BlockClient: the blocking client of kvtierd's data protocol.

A small pool of TCP connections (created on demand, at most ``pool_size``);
each call takes one, pipelines its frames on it, and gives it back, so one
client may be shared by several threads. A connection that fails mid-call is
dropped and the call is retried once on a fresh one (every op is safe to
repeat: a re-put of a present key is a no-op). Blocks are verified (CRC and
key) before they are returned; a block that fails is a miss.

    with BlockClient("127.0.0.1:7410") as c:
        c.put(key, block); c.get(key); c.lookup(chain_keys)
"""
from __future__ import annotations

import queue
import socket
import threading
import time
from dataclasses import dataclass, replace

from kvtier.client import protocol as p
from kvtier.client import protocol_ops as ops
from kvtier.client.stripe import StripeGeometry

RECV_CHUNK_BYTES = 256 << 10  # frame headers and small replies; payloads land in their buffer
SENDMSG_IOV_MAX = 512  # buffers per sendmsg call, under Linux's IOV_MAX of 1024
RECEIVE_SCRATCH_BYTES_MAX = 64 << 20  # reply payload buffer kept per connection; larger ones are allocated
PIPELINE_FRAMES_MAX = 8
ZERO_COPY = object()  # `into` marker: receive each reply into a fresh unzeroed buffer and keep views  # frames in flight per connection: bounds buffering on both sides
DEFAULT_PORT = 7410


@dataclass(frozen=True)
class BlockLocationInfo:
    """Where a block lives in the daemon's logical space (see ``geometry()``)."""

    logical_offset: int
    length: int
    seq: int
    sealed: bool


@dataclass(frozen=True)
class ClientStatistics:
    requests: int
    frames: int
    reconnects: int
    corrupt_blocks: int
    bytes_sent: int
    bytes_received: int


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep:
        return address, DEFAULT_PORT
    return host.strip("[]"), int(port)


def geometry_from_info(info) -> StripeGeometry:
    g = info["geometry"]
    return StripeGeometry(tuple(g["device_ids"]), g["stripe_size_bytes"], g["data_offset_bytes"],
                          g["device_data_bytes"])


def limits_from_info(info) -> p.Limits:
    """The daemon's limits (HELLO) where tighter than ours."""
    theirs = info.get("limits", {})
    d = p.DEFAULT_LIMITS
    return p.Limits(batch_count_max=min(d.batch_count_max, theirs.get("batch_count_max", d.batch_count_max)),
                    meta_bytes_max=min(d.meta_bytes_max, theirs.get("meta_bytes_max", d.meta_bytes_max)),
                    payload_bytes_max=min(d.payload_bytes_max, theirs.get("payload_bytes_max", d.payload_bytes_max)),
                    block_bytes_max=min(d.block_bytes_max, theirs.get("block_bytes_max", d.block_bytes_max)))


def _send_parts(sock: socket.socket, parts: list) -> None:
    views = [v for v in (memoryview(b).cast("B") for b in parts) if v.nbytes]
    i = 0
    while i < len(views):
        n = sock.sendmsg(views[i:i + SENDMSG_IOV_MAX])
        while n:
            if n >= views[i].nbytes:
                n -= views[i].nbytes
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0


class _Channel:
    """One connection: a socket, its protocol state, and the daemon's HELLO info."""

    def __init__(self, host: str, port: int, timeout_s: float, token: str | None, name: str):
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn = p.Connection(p.Role.CLIENT)
        self._next_id = 1
        self._scratch = bytearray()
        self.info: dict = {}
        try:
            (reply,) = self.exchange([p.Hello(0, name, token or "")])
            self.info = dict(reply.info)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.sock.close()

    def exchange(self, messages: list, into=None) -> list:
        """Pipeline ``messages`` (at most PIPELINE_FRAMES_MAX ahead) and return
        their replies in order; an error reply raises RemoteError after every
        reply was read (the connection stays usable)."""
        replies, first_error = [], None
        sent = 0
        while len(replies) < len(messages):
            while sent < len(messages) and sent - len(replies) < PIPELINE_FRAMES_MAX:
                msg = replace(messages[sent], request_id=self._next_id)
                self._next_id += 1
                _send_parts(self.sock, self.conn.send_parts(msg))
                sent += 1
            reply = self._read_reply(into if len(messages) == 1 or into is ZERO_COPY else None)
            expected = self._next_id - (sent - len(replies))
            if reply.request_id != expected and not (isinstance(reply, p.ErrorReply) and reply.request_id == 0):
                raise p.ProtocolError(p.ErrorCode.BAD_FRAME, f"reply for request {reply.request_id}, "
                                      f"expected {expected}")
            if isinstance(reply, p.ErrorReply):
                first_error = first_error or p.RemoteError(reply.code, reply.message, reply.request_id)
                if reply.request_id == 0:  # the daemon closes after a connection-level error
                    raise first_error
            replies.append(reply)
        if first_error is not None:
            raise first_error
        return replies

    def _read_reply(self, into):
        """The next reply. Its payload lands in ``into`` if given and large
        enough, else in this connection's reusable scratch buffer (no fresh
        pages to fault in), from which GET blocks are copied out once."""
        conn, sock = self.conn, self.sock
        head_placed, in_scratch = None, False
        while True:
            event = conn.next_event()
            if event is p.NEED_DATA:
                head = conn.pending_head
                if head is not None and head is not head_placed:
                    head_placed = head
                    if into is ZERO_COPY:  # a buffer of its own, not zeroed: the blocks are returned as views
                        import numpy as np
                        conn.set_payload_buffer(np.empty(head.payload_len, np.uint8))
                    elif into is not None and head.payload_len <= into.nbytes:
                        conn.set_payload_buffer(into)
                    elif head.payload_len <= RECEIVE_SCRATCH_BYTES_MAX:
                        if len(self._scratch) < head.payload_len:
                            self._scratch = bytearray(head.payload_len)
                        conn.set_payload_buffer(self._scratch)
                        in_scratch = True
                view = conn.payload_view()
                if view is not None:
                    n = sock.recv_into(view)
                    if n:
                        conn.payload_received(n)
                    else:
                        conn.receive_data(b"")
                else:
                    conn.receive_data(sock.recv(RECV_CHUNK_BYTES))
                continue
            if event is p.CONNECTION_CLOSED:
                raise p.ConnectionLost("the daemon closed the connection")
            if in_scratch and isinstance(event, p.GetReply):
                event = p.GetReply(event.request_id, tuple(b if b is None or b is p.DEFERRED else bytes(b)
                                                           for b in event.blocks))
            return event


class BlockClient:
    """Blocking client; thread-safe; see the module doc."""

    def __init__(self, address: str = "127.0.0.1:7410", token: str | None = None, pool_size: int = 4,
                 timeout_s: float = 30.0, client_name: str = "kvtier-client"):
        if pool_size < 1:
            raise ValueError(f"pool_size must be at least 1, got {pool_size}")
        self._host, self._port = parse_address(address)
        self._token, self._timeout_s, self._name = token, timeout_s, client_name
        self._pool: queue.LifoQueue[_Channel] = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(pool_size)
        self._lock = threading.Lock()
        self._info: dict | None = None
        self._closed = False
        self._counts = {"requests": 0, "frames": 0, "reconnects": 0, "corrupt_blocks": 0,
                        "bytes_sent": 0, "bytes_received": 0}
        self.limits = p.DEFAULT_LIMITS

    # -- plumbing -----------------------------------------------------------
    def __enter__(self) -> "BlockClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                self._pool.get_nowait().close()
            except queue.Empty:
                return

    def _connect(self) -> _Channel:
        try:
            ch = _Channel(self._host, self._port, self._timeout_s, self._token, self._name)
        except OSError as exc:
            raise p.ConnectionLost(f"cannot connect to kvtierd at {self._host}:{self._port}: {exc}") from exc
        with self._lock:
            self._info = ch.info
            self.limits = limits_from_info(ch.info)
        return ch

    def _run(self, make_op, into=None):
        """Drive an op generator on a pooled (or new) connection; a connection
        that fails is dropped and reported as :class:`_Retry`."""
        if self._closed:
            raise p.ClientError("the client is closed")
        with self._slots:
            try:
                ch, fresh = self._pool.get_nowait(), False
            except queue.Empty:
                ch, fresh = self._connect(), True
            try:
                result = self._drive(make_op(), ch, into)
            except (OSError, p.ConnectionLost, p.ProtocolError) as exc:
                ch.close()
                raise _Retry(exc, fresh) from exc
            except p.RemoteError as exc:
                (ch.close if exc.request_id == 0 else lambda: self._pool.put(ch))()
                raise
            except BaseException:
                ch.close()
                raise
            self._pool.put(ch)
            return result

    def _drive(self, op, ch: _Channel, into):
        before_in, before_out = ch.conn.bytes_received, ch.conn.bytes_sent
        try:
            messages = next(op)
            while True:
                replies = ch.exchange(messages, into)
                self._count(frames=len(messages))
                messages = op.send(replies)
        except StopIteration as stop:
            return stop.value
        finally:
            self._count(requests=1, bytes_received=ch.conn.bytes_received - before_in,
                        bytes_sent=ch.conn.bytes_sent - before_out)

    def _call(self, make_op, into=None):
        """Run a fresh op; if a pooled connection was dead, once more on a new one."""
        try:
            return self._run(make_op, into)
        except _Retry as retry:
            if retry.fresh:
                raise _lost(retry.cause) from retry.cause
        self._count(reconnects=1)
        try:
            return self._run(make_op, into)
        except _Retry as retry:
            raise _lost(retry.cause) from retry.cause

    def _count(self, **deltas) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._counts[k] += v

    def statistics(self) -> ClientStatistics:
        with self._lock:
            return ClientStatistics(**self._counts)

    # -- the API ------------------------------------------------------------
    def put(self, key, block, durable: bool = False) -> int:
        (seq,) = self.put_many([(key, block)], durable)
        return seq

    def put_many(self, items, durable: bool = False, ns_id: bytes | None = None) -> list[int]:
        items = list(items)
        return self._call(lambda: ops.op_put_many(items, durable, ns_id, self.limits))

    def get(self, key, ns_id: bytes | None = None, copy: bool = True) -> bytes | None:
        return self.get_many([key], ns_id, copy)[0]

    def get_many(self, keys, ns_id: bytes | None = None, copy: bool = True) -> list[bytes | None]:
        """Verified blocks, None for a miss. ``copy=False`` returns read-only
        memoryviews into the reply buffer instead of bytes: one memory pass
        less per block (the buffer lives as long as any view of it)."""
        keys = list(keys)
        results, corrupt = self._call(lambda: ops.op_get_many(keys, ns_id, self.limits, copy=copy),
                                      into=None if copy else ZERO_COPY)
        if corrupt:
            self._count(corrupt_blocks=corrupt)
        return results

    def get_into(self, key, buffer) -> int | None:
        """Receive the block straight into ``buffer``; its size, or None on a
        miss (or a block that fails verification)."""
        key = ops.check_key(key)
        target = memoryview(buffer).cast("B")
        if target.readonly:
            raise ValueError("get_into needs a writable buffer")
        reply = self._call(lambda: ops.op_single(p.Get(0, (key,))), into=target)
        block = reply.blocks[0]
        if block is None:
            return None
        if not (isinstance(block, memoryview) and block.obj is target.obj):  # came with the header, or too large
            if len(block) > target.nbytes:
                raise ValueError(f"block of {len(block)} bytes does not fit the {target.nbytes}-byte buffer")
            target[:len(block)] = block
            block = target[:len(block)]
        if not ops.verify_ok(block, key):
            self._count(corrupt_blocks=1)
            return None
        return len(block)

    def lookup(self, keys, ns_id: bytes | None = None) -> int:
        keys = list(keys)
        leading, _ = self._call(lambda: ops.op_lookup(keys, ns_id, False, self.limits))
        return leading

    def lookup_locations(self, keys, ns_id: bytes | None = None) -> tuple[int, list[BlockLocationInfo | None]]:
        keys = list(keys)
        leading, locs = self._call(lambda: ops.op_lookup(keys, ns_id, True, self.limits))
        return leading, [None if loc is None else BlockLocationInfo(loc.logical_offset, loc.length, loc.seq,
                                                                    loc.sealed) for loc in locs]

    def delete(self, key) -> bool:
        return self.delete_many([key])[0]

    def delete_many(self, keys) -> list[bool]:
        keys = list(keys)
        return self._call(lambda: ops.op_bools(p.Delete, keys, None, self.limits))

    def pin(self, keys) -> list[bool]:
        keys = list(keys)
        return self._call(lambda: ops.op_bools(p.Pin, keys, None, self.limits))

    def unpin(self, keys) -> list[bool]:
        keys = list(keys)
        return self._call(lambda: ops.op_bools(p.Unpin, keys, None, self.limits))

    def flush(self) -> None:
        self._call(lambda: ops.op_single(p.Flush(0)))

    def stats(self) -> dict:
        return dict(self._call(lambda: ops.op_single(p.Stats(0))).stats)

    def ping(self) -> float:
        """Round-trip time in seconds."""
        started = time.perf_counter()
        self._call(lambda: ops.op_single(p.Ping(0, b"ping")))
        return time.perf_counter() - started

    def server_info(self) -> dict:
        """The daemon's HELLO document (protocol version, limits, geometry)."""
        with self._lock:
            info = self._info
        if info is None:
            self.ping()
            with self._lock:
                info = self._info
        return info

    def geometry(self) -> StripeGeometry:
        """The daemon's device ids and stripe layout, for direct reads."""
        return geometry_from_info(self.server_info())


class _Retry(Exception):
    """A connection failed during an op (internal: _call decides to retry)."""

    def __init__(self, cause: BaseException, fresh: bool):
        super().__init__(str(cause))
        self.cause, self.fresh = cause, fresh


def _lost(exc: BaseException) -> p.ClientError:
    if isinstance(exc, p.ClientError):
        return exc
    if isinstance(exc, socket.timeout):
        return p.ConnectionLost(f"timed out waiting for kvtierd: {exc}")
    return p.ConnectionLost(f"connection to kvtierd failed: {exc}")
