"""BlockClient: the blocking client of kvtierd's data protocol.

A small pool of TCP connections (created on demand, at most ``pool_size``);
each call takes one, pipelines its frames on it, and gives it back, so one
client may be shared by several threads. A pooled connection the daemon has
closed meanwhile (a restart, a dropped idle connection) is noticed before it
is used and replaced. A connection that fails mid-call is dropped and the
call is retried once on a fresh one, except a DELETE whose request had
already gone out: the daemon may have applied it, and a repeat would report
the keys it deleted as "not found", so that call raises ConnectionLost
instead (check with ``lookup``). Every other op gives the same result when
repeated: a re-put of a present key is a no-op returning the stored seq,
PIN and UNPIN set a flag and report whether each key is present, and the
rest only read. Blocks are verified (CRC and key) before they are returned;
a block that fails is a miss.

    with BlockClient("127.0.0.1:7410") as c:
        c.put(key, block); c.get(key); c.lookup(chain_keys)
"""
from __future__ import annotations

import math
import queue
import socket
import threading
import time
from dataclasses import dataclass

import numpy as np

from kvtier.wire import connection as p
from kvtier.client import transport_ops as ops
from kvtier.client.scatter_plan import FOLD_RECEIVE_BYTES_MAX, ScatterPlan
from kvtier.wire.channel import Channel
from kvtier.wire.sockets import receive_payload
from kvtier.wire.events import PIN_TTL_MS_MAX
from kvtier.wire.writers import check_key
from kvtier.common.addresses import DATA_PORT_DEFAULT, parse_address
from kvtier.common.stripe import StripeGeometry

RECEIVE_SCRATCH_BYTES_MAX = 64 << 20  # reply payload buffer kept per connection; larger ones are allocated
REPLY_BUFFERS_MAX = 4  # copy=False reply buffers kept per connection for reuse (callers may hold views)
PIN_TTL_S_MAX = PIN_TTL_MS_MAX / 1000  # a soft pin's TTL goes on the wire as a u32 of milliseconds
ZERO_COPY = object()  # `into` marker: receive each reply into a buffer of its own and keep views


# Where a block lives in the daemon's logical space (see ``geometry()``): the
# protocol's own frozen dataclass (logical_offset, length, seq, sealed), so a
# LOOKUP reply's locations are handed out without a second object per key.
BlockLocationInfo = p.Location



def pin_request(ttl_s: float | None):
    """How a PIN frame is made for ``ttl_s`` (``kind(request_id, keys, ns_id)``): a hard pin, or a
    soft one whose TTL goes out in whole milliseconds (rounded up); ValueError names a bad TTL."""
    if ttl_s is None:
        return p.Pin
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s <= PIN_TTL_S_MAX:
        raise ValueError(f"pin ttl_s must be a number in (0, {PIN_TTL_S_MAX}] seconds, got {ttl_s!r}")
    ttl_ms = min(max(1, math.ceil(ttl_s * 1000)), PIN_TTL_MS_MAX)
    return lambda request_id, keys, ns_id: p.Pin(request_id, keys, ns_id, ttl_ms)

@dataclass(frozen=True)
class ClientStatistics:
    requests: int
    frames: int
    reconnects: int
    corrupt_blocks: int
    bytes_sent: int
    bytes_received: int


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


class ClientBase:
    """What the blocking and the asyncio clients share: where the daemon is, who we are,
    what its last HELLO said, and the counters."""

    def __init__(self, address: str, token: str | None, pool_size: int, timeout_s: float, client_name: str):
        if pool_size < 1:
            raise ValueError(f"pool_size must be at least 1, got {pool_size}")
        self._host, self._port = parse_address(address, what="daemon address", default_port=DATA_PORT_DEFAULT)
        self._token, self._timeout_s, self._name = token, timeout_s, client_name
        self._info: dict | None = None
        self._closed = False
        self._counts = {"requests": 0, "frames": 0, "reconnects": 0, "corrupt_blocks": 0,
                        "bytes_sent": 0, "bytes_received": 0}
        self.limits = p.DEFAULT_LIMITS

    def _hello_info(self, info: dict) -> None:
        """A connection's HELLO reply: the daemon's document and the limits it implies."""
        self._info = info
        self.limits = limits_from_info(info)

    @property
    def _reader_verifies(self) -> bool:
        """The daemon lets a reader that checks payload CRCs itself skip its own check."""
        return self._offers(p.FEATURE_GET_READER_VERIFIES)

    def _offers(self, feature: str) -> bool:
        """Whether the daemon's HELLO (once one came) lists ``feature``."""
        return self._info is not None and feature in self._info.get("features", ())

    def _cannot_connect(self, exc: Exception) -> p.ConnectionLost:
        return p.ConnectionLost(f"cannot connect to kvtierd at {self._host}:{self._port}: {exc}")


class ReplyBuffers:
    """Receive buffers for ``copy=False`` replies, reused once no view of them is left.

    The blocks of such a reply are handed out as views of its buffer, so a
    buffer is free again only when the caller has dropped every view. The
    buffers are ``bytearray`` objects, which refuse to change size while any
    memoryview of them exists (and anything built on one, e.g.
    ``np.frombuffer``, keeps its memoryview): :func:`_exported` asks exactly
    that, on any Python version or build, instead of guessing from reference
    counts. Reuse matters because fresh memory is paid for in page faults on the
    first write, which cost more than the kernel's copy of the bytes."""

    def __init__(self, count_max: int = REPLY_BUFFERS_MAX, bytes_max: int = RECEIVE_SCRATCH_BYTES_MAX):
        self._buffers: list = []
        self._count_max, self._bytes_max = count_max, bytes_max

    def take(self, nbytes: int):
        """A writable buffer of at least ``nbytes`` that nobody else references."""
        free = [i for i in range(len(self._buffers)) if not _exported(self._buffers[i])]
        for i in free:
            if len(self._buffers[i]) >= nbytes:
                return self._buffers[i]
        if nbytes > self._bytes_max:
            return np.empty(nbytes, np.uint8)  # never reused: no need to zero it (or to probe it later)
        buf = bytearray(nbytes)
        if len(self._buffers) < self._count_max:
            self._buffers.append(buf)
        elif free:
            self._buffers[free[0]] = buf  # a free but too small one makes room
        return buf


def _exported(buf: bytearray) -> bool:
    """True while any memoryview of ``buf`` is alive: a bytearray with buffer
    exports raises BufferError when asked to change size. The probe drops one
    byte and puts it back; both stay within the allocation (no copy, no move),
    and the byte's value does not matter in a receive buffer."""
    if not buf:
        return False  # holds no bytes to overwrite
    try:
        buf.pop()
    except BufferError:
        return True
    buf.append(0)
    return False


class _Channel(Channel):
    """A pooled connection: reply payloads land in the caller's memory, a reused buffer of views
    (``ZERO_COPY``), or this connection's scratch buffer, from which GET blocks are copied once."""

    def __init__(self, host: str, port: int, timeout_s: float, token: str | None, name: str):
        self._scratch = bytearray()
        self._views = ReplyBuffers()
        self._in_scratch = False
        super().__init__(host, port, timeout_s, token, name)

    def exchange(self, messages: list, into=None, deadline=None, on_sent=None) -> list:
        many = into is ZERO_COPY or isinstance(into, ScatterPlan)
        return super().exchange(messages, into if len(messages) == 1 or many else None,
                                on_sent=into.sent if isinstance(into, ScatterPlan) else None)

    def _place_payload(self, head, into) -> bool:
        """Into ``into`` if given and large enough, else this connection's reusable scratch buffer
        (no fresh pages to fault in); GET blocks of a scatter plan straight into their destinations."""
        conn = self.conn
        self._in_scratch = False
        scatter = into.views_for(head.request_id, conn.pending_meta) \
            if isinstance(into, ScatterPlan) and head.base_op == p.Op.GET else None
        if scatter is not None:  # each receive's CRCs folded while in cache
            conn.set_payload_buffers(scatter, FOLD_RECEIVE_BYTES_MAX)
            receive_payload(self.sock, conn, into.landed)
            return True
        if into is ZERO_COPY:  # the blocks are returned as views of this buffer
            conn.set_payload_buffer(self._views.take(head.payload_len))
        elif isinstance(into, memoryview) and head.payload_len <= into.nbytes:
            conn.set_payload_buffer(into)
        elif head.payload_len <= RECEIVE_SCRATCH_BYTES_MAX:
            if len(self._scratch) < head.payload_len:
                self._scratch = bytearray(head.payload_len)
            conn.set_payload_buffer(self._scratch)
            self._in_scratch = True
        return False

    def _received(self, reply):
        if self._in_scratch and isinstance(reply, p.GetReply):
            reply = p.GetReply(reply.request_id, tuple(b if b is None or b is p.DEFERRED else bytes(b)
                                                       for b in reply.blocks), origins=reply.origins)
        self._in_scratch = False
        return reply


class BlockClient(ClientBase):
    """Blocking client; thread-safe; see the module doc."""

    def __init__(self, address: str = "127.0.0.1:7410", token: str | None = None, pool_size: int = 4,
                 timeout_s: float = 30.0, client_name: str = "kvtier-client"):
        super().__init__(address, token, pool_size, timeout_s, client_name)
        self._pool: queue.LifoQueue[_Channel] = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(pool_size)
        self._lock = threading.Lock()

    # -- plumbing -----------------------------------------------------------
    def __enter__(self) -> "BlockClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the idle connections now; one still serving a request is closed when it ends
        (never pooled again), and a request made after this raises ClientError."""
        with self._lock:
            self._closed = True
            while True:
                try:
                    self._pool.get_nowait().close()
                except queue.Empty:
                    return

    def _give_back(self, ch: _Channel) -> None:
        """Pool a connection whose request ended with its replies read; close it if the client closed meanwhile."""
        with self._lock:
            if not self._closed:
                self._pool.put(ch)
                return
        ch.close()

    def _connect(self) -> _Channel:
        try:
            ch = _Channel(self._host, self._port, self._timeout_s, self._token, self._name)
        except OSError as exc:
            raise self._cannot_connect(exc) from exc
        with self._lock:
            self._hello_info(ch.info)
        return ch

    def _pooled_or_new(self) -> tuple[_Channel, bool]:
        """``(channel, fresh)``: an idle pooled connection that is still open, else a new one."""
        while True:
            try:
                ch = self._pool.get_nowait()
            except queue.Empty:
                return self._connect(), True
            if ch.idle_and_open():
                return ch, False
            ch.close()  # the daemon closed it while it idled
            self._count(reconnects=1)

    def _run(self, make_op, into=None):
        """Drive an op generator on a pooled (or new) connection; a connection
        that fails is dropped and reported as :class:`_Retry`."""
        with self._slots:  # a request that waited for a slot while the client closed opens nothing
            if self._closed:
                raise p.ClientError("the client is closed")
            ch, fresh = self._pooled_or_new()
            wire_before = ch.wire_bytes_sent
            try:
                result = self._drive(make_op(), ch, into)
            except (OSError, p.ConnectionLost, p.ProtocolError) as exc:
                ch.close()
                raise _Retry(exc, fresh, ch.wire_bytes_sent != wire_before) from exc
            except p.RemoteError as exc:
                (ch.close if exc.request_id == 0 else lambda: self._give_back(ch))()
                raise
            except BaseException:
                ch.close()
                raise
            self._give_back(ch)
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

    def _call(self, make_op, into=None, repeatable: bool = True):
        """Run a fresh op; if a pooled connection failed, once more on a new
        one, unless the op is not ``repeatable`` and its request went out."""
        try:
            return self._run(make_op, into)
        except _Retry as retry:
            if retry.fresh:
                raise _lost(retry.cause) from retry.cause
            if retry.sent and not repeatable:
                raise _not_repeated(retry.cause) from retry.cause
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

    def put_many(self, items, durable: bool = False, ns_id: bytes | None = None, repair: bool = False) -> list[int]:
        """The seqs stored, one per item. ``repair``: the blocks are copies of what other owners hold
        (read-repair, re-replication): a daemon that deleted a key lately (HELLO feature
        ``put_skip_deleted``) does not store it and answers seq 0; an older daemon stores them all."""
        items = list(items)
        if repair and self._info is None:
            self.ping()  # learn the features first
        skip = repair and self._offers(p.FEATURE_PUT_SKIP_DELETED)
        return self._call(lambda: ops.op_put_many(items, durable, ns_id, self.limits, skip))

    def get(self, key, ns_id: bytes | None = None, copy: bool = True) -> bytes | None:
        return self.get_many([key], ns_id, copy)[0]

    def get_many(self, keys, ns_id: bytes | None = None, copy: bool = True,
                 origins: list | None = None) -> list[bytes | None]:
        """Verified blocks, None for a miss. ``copy=False`` returns read-only
        memoryviews into the reply buffer instead of bytes: one memory pass
        less per block (the buffer lives as long as any view of it). ``origins``
        (a list) is filled with one bool per key: True where the daemon fetched
        the block from its upstream (HELLO feature ``upstream``), else False."""
        keys = list(keys)
        reported = self._origins_list(origins, len(keys))
        results, corrupt = self._call(lambda: ops.op_get_many(keys, ns_id, self.limits, copy=copy,
                                                              reader_verifies=self._reader_verifies,
                                                              origins=reported),
                                      into=None if copy else ZERO_COPY)
        if corrupt:
            self._count(corrupt_blocks=corrupt)
        return results

    def get_many_into(self, keys, targets, head_nbytes: int, ns_id: bytes | None = None) -> list:
        """GET each block straight into its destination: block i's bytes past its first
        ``head_nbytes`` (block header + codec header) are received into the writable views
        ``targets[i]`` (or those a function ``targets[i]()`` makes when its reply comes), in
        order, and verified there (CRC over the views, key). Per key a
        :class:`~.scatter_plan.LandedBlock`, a verified read-only block where it came in
        another size than planned (it landed apart), or None for a miss (a target may then
        hold any bytes)."""
        keys = list(keys)
        if len(keys) != len(targets):
            raise ValueError(f"{len(keys)} keys but {len(targets)} targets")
        plan = ScatterPlan(head_nbytes, targets)
        results, corrupt = self._call(lambda: ops.op_get_into(keys, ns_id, self.limits, plan, self._reader_verifies),
                                      into=plan)
        if corrupt:
            self._count(corrupt_blocks=corrupt)
        return results

    @property
    def has_upstream(self) -> bool:
        """The daemon answers misses from an upstream and says per block where it came from."""
        return self._offers(p.FEATURE_UPSTREAM)

    def _origins_list(self, origins: list | None, count: int) -> list | None:
        """``origins`` to fill from the reply where the daemon reports them, else filled with False now."""
        if origins is None:
            return None
        if self._info is None:
            self.ping()  # learn the features first
        if self.has_upstream:
            return origins
        origins[:] = [False] * count
        return None

    def get_into(self, key, buffer) -> int | None:
        """Receive the block straight into ``buffer``; its size, or None on a
        miss (or a block that fails verification twice: the second time the
        daemon checks it too, as in :meth:`get_many`)."""
        key = check_key(key)
        target = memoryview(buffer).cast("B")
        if target.readonly:
            raise ValueError("get_into needs a writable buffer")
        for reader_verifies in (self._reader_verifies, False):
            reply = self._call(lambda: ops.op_single(p.Get(0, (key,), None, reader_verifies)), into=target)
            block = reply.blocks[0]
            if block is None:
                return None
            if not (isinstance(block, memoryview) and block.obj is target.obj):  # came with the header, or too large
                if len(block) > target.nbytes:
                    raise ValueError(f"block of {len(block)} bytes does not fit the {target.nbytes}-byte buffer")
                target[:len(block)] = block
                block = target[:len(block)]
            if ops.verify_ok(block, key):
                return len(block)
            self._count(corrupt_blocks=1)
        return None

    def lookup(self, keys, ns_id: bytes | None = None, origins: list | None = None) -> int:
        """Leading keys of the chain the daemon holds (or, with an upstream, can fetch);
        ``origins`` (a list) is filled with one bool per leading key: True where only the
        daemon's upstream holds it."""
        keys = list(keys)
        reported = self._origins_list(origins, 0)
        leading, _ = self._call(lambda: ops.op_lookup(keys, ns_id, False, self.limits, reported))
        if origins is not None and reported is None:
            origins[:] = [False] * leading
        return leading

    def lookup_locations(self, keys, ns_id: bytes | None = None) -> tuple[int, list[BlockLocationInfo | None]]:
        keys = list(keys)
        leading, locs = self._call(lambda: ops.op_lookup(keys, ns_id, True, self.limits))
        return leading, list(locs)

    def delete(self, key) -> bool:
        return self.delete_many([key])[0]

    def delete_many(self, keys) -> list[bool]:
        """Per key, whether it was present (and is now deleted). Raises
        ConnectionLost, without repeating the DELETE, if the connection failed
        after the request went out (see the module doc)."""
        keys = list(keys)
        return self._call(lambda: ops.op_bools(p.Delete, keys, None, self.limits), repeatable=False)

    def pin(self, keys, ttl_s: float | None = None) -> list[bool]:
        """Pin blocks (per key: present). ``ttl_s``: a soft pin that expires by itself after that
        many seconds (kept in the daemon's memory only; needs the ``pin_ttl`` HELLO feature);
        None: a hard pin, durable until :meth:`unpin`. A pin past the daemon's pinned-bytes
        limit raises RemoteError(NO_SPACE) and pins nothing."""
        keys = list(keys)
        return self._call(lambda: ops.op_bools(pin_request(ttl_s), keys, None, self.limits))

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
    """A connection failed during an op (internal: _call decides to retry).
    ``sent``: some of the op's request bytes had gone out on it."""

    def __init__(self, cause: BaseException, fresh: bool, sent: bool):
        super().__init__(str(cause))
        self.cause, self.fresh, self.sent = cause, fresh, sent


def _not_repeated(exc: BaseException) -> p.ConnectionLost:
    return p.ConnectionLost(f"connection to kvtierd failed after the DELETE was sent ({exc}); the daemon may "
                            "have applied it, so it was not repeated (a repeat would report the keys it deleted "
                            "as not found): look the keys up to see")


def _lost(exc: BaseException) -> p.ClientError:
    if isinstance(exc, p.ClientError):
        return exc
    if isinstance(exc, socket.timeout):
        return p.ConnectionLost(f"timed out waiting for kvtierd: {exc}")
    return p.ConnectionLost(f"connection to kvtierd failed: {exc}")
