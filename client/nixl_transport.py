"""The ``nixl`` transport: GET replies written by the daemon's NIXL agent into this process's
registered buffers (UCX: shared memory on one host, RDMA where a device is present, TCP
otherwise), with control on the data protocol (NIXL_METADATA, NIXL_GET; docs/nixl.md).

::

    client                                   kvtierd
    LOOKUP (locations) ------------------->  lengths, seqs
    NIXL_GET keys + descriptors ----------> from device memory, or read into an arena chunk by chunk
      (+ scatter extents: the output's rows)
                                  <======== NIXL WRITEs, a notification per part
    fold each block's CRC as its parts come
                           <--------------- reply: length written per item
    finish each block: header CRC, payload CRC, key, seq

One NIXL agent per process (:class:`ClientAgent`), without a progress thread (NIXL's
spins on a core even while idle): while a NIXL_GET is in flight the requesting thread
progresses the agent itself, polling its notifications until the reply arrives, between
waits on the control socket that double up to ``PROGRESS_WAIT_MAX_S``: over TCP, where a WRITE
is emulated in software and moves only while the waiting side progresses, up to
``TCP_PROGRESS_WAIT_MAX_S``. Destination buffers are ``bytearray``
objects registered with it and reused once no view of them is left (the probe of
:class:`~.block_client.ReplyBuffers`); a new one is announced to the daemon by
sending NIXL_METADATA again before the next NIXL_GET on each control connection.
The daemon replies once every WRITE of a NIXL_GET is done: a NIXL_GET that ended otherwise
(a timeout, a lost connection, a refusal past BAD_REQUEST) retires its buffer for good
(:meth:`ClientAgent.retire`: a late WRITE may still land there, so its memory is kept, never
reused nor freed, for the agent's life; retired buffers count against DESTINATION_BYTES_MAX,
past which loads go to TCP); the next takes a fresh one. One that also scattered into the
caller's memory, which the caller reuses once the load has failed, is settled first
(:meth:`ControlChannel.settle`): the load returns once the daemon has ended the request, or
after ``SETTLE_TIMEOUT_S`` (counted, logged). Then a late WRITE may still land in that memory,
so the agent keeps a reference to it for good (:meth:`ClientAgent.quarantine`): a pooled output
(:mod:`.output_buffers`) is then never handed out again, nor is the memory freed to anyone else.
A block that fails verification, a failed transfer or a refused request is a
fallback: the warm tier fetches those blocks over TCP and counts them.

NIXL itself is imported only by the agent (:mod:`.nixl_agent`), when a transport is opened.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, fields

import numpy as np

from kvtier.common.addresses import DATA_PORT_DEFAULT, parse_address
from kvtier.common.backoff import Backoff
from kvtier.common.blockformat import BlockFormatError
from kvtier.wire import connection as p
from kvtier.wire import events as m
from kvtier.wire.frames import DEFERRED_LENGTH
from kvtier.wire.payload_pieces import as_bytes_view

from .nixl_agent import SLOT_ALIGN_BYTES, ClientAgent, NixlFetchFailed, NixlUnavailable, buffer_address
from .nixl_arrivals import ArrivingBlocks
from .nixl_control import WAIT_FIRST_S, ControlChannel
from .nixl_held import may_have_posted
from .nixl_put_plan import PutFrame, RegisteredMemory, plan_put
from .scatter_plan import Landing, LandedBlock

log = logging.getLogger("kvtier.client.nixl")

NOTIFICATION_TIMEOUT_S = 5.0  # after the reply, the daemon's notification is due at once: a stalled UCX peer
PROGRESS_WAIT_MAX_S = 0.001  # shared memory / RDMA: the longest wait between progress calls of a NIXL_GET
TCP_PROGRESS_WAIT_MAX_S = 50e-6  # over TCP, where a WRITE moves only while we progress
LEND_PIECE_BYTES_MIN = 256 << 10  # a NIXL_PUT piece outside registered memory this large is lent, not copied
NIXL_SETUP_TIMEOUT_S = 3.0  # connect, HELLO and NIXL_METADATA of a control connection, each: a stopped daemon
SETTLE_TIMEOUT_S = 10.0  # a scatter NIXL_GET without reply waits this long for the daemon to end it: twice its
# TRANSFER_TIMEOUT_S (5 s), by when a daemon that posted WRITEs has them done or released


def _code_name(code) -> str:
    """An error reply's code as its name (the number, for a code this client does not know)."""
    try:
        return p.ErrorCode(code).name
    except ValueError:
        return str(code)


@dataclass(frozen=True)
class NixlStatistics:
    transport: str  # the UCX transport expected towards this daemon: "sm", "rdma" or "tcp"
    requests: int
    blocks: int
    bytes: int
    refused: int  # NIXL_GETs the daemon answered with an error (the blocks went to TCP)
    corrupt_blocks: int  # blocks that failed verification (went to TCP)
    notification_timeouts: int
    blocks_in_place: int = 0  # of ``blocks``, written straight into the caller's memory (a landing's views)
    puts: int = 0  # NIXL_PUTs answered (the daemon READ their blocks)
    put_blocks: int = 0
    put_bytes: int = 0
    put_bytes_staged: int = 0  # of ``put_bytes``, copied into a registered buffer first (not in lent memory)
    puts_refused: int = 0  # NIXL_PUTs the daemon answered with an error (their blocks went to TCP)
    puts_held: int = 0  # failed NIXL_PUTs whose memory is held, as the daemon's READ of it may be pending
    buffers_retired: int = 0  # destination buffers never reused: a NIXL_GET into them ended before its reply
    scatters_settled: int = 0  # scatter NIXL_GETs without reply that the daemon then ended (SETTLE_TIMEOUT_S)
    scatters_unsettled: int = 0  # scatter NIXL_GETs not ended in time, or answered with an error after WRITEs
    # were posted (released, not stopped): a late WRITE may land in the caller's memory, which is quarantined
    quarantined_bytes: int = 0  # callers' memory kept referenced for good (ClientAgent.quarantine)


class NixlTransport:
    """GETs from one daemon through NIXL; ``pool_size`` control connections, opened on demand.
    Opening one talks to the daemon (connect, HELLO, NIXL_METADATA, each within
    ``setup_timeout_s``): :class:`~.nixl_setup.NixlSetup` does it off the caller's path."""

    def __init__(self, address: str, token: str | None = None, pool_size: int = 4, timeout_s: float = 30.0,
                 client_name: str = "kvtier-nixl", setup_timeout_s: float = NIXL_SETUP_TIMEOUT_S):
        self._host, self._port = parse_address(address, what="daemon address", default_port=DATA_PORT_DEFAULT)
        self._token, self._timeout_s, self._name = token, timeout_s, client_name
        self._setup_timeout_s = min(setup_timeout_s, timeout_s)
        self._idle: queue.LifoQueue[ControlChannel] = queue.LifoQueue()
        self._slots = threading.Semaphore(pool_size)
        self._lock = threading.Lock()
        self._closed = False
        self._daemon_agent: str | None = None
        self._counts = {f.name: 0 for f in fields(NixlStatistics) if f.name not in ("transport", "quarantined_bytes")}
        first = self._open_channel()  # fails now, not on the first GET, where NIXL or the daemon cannot
        try:
            peer = first.sock.getpeername()[0]
            self.agent = ClientAgent.shared(loopback_only=peer.startswith("127.") or peer == "::1")
            plan = self.agent.plan
            self.transport = plan.name if first.same_host else "rdma" if "rc" in plan.tls.split(",") else "tcp"
            # a WRITE over TCP is emulated in software and moves only while we progress
            self._wait_max_s = TCP_PROGRESS_WAIT_MAX_S if self.transport == "tcp" else PROGRESS_WAIT_MAX_S
            self._puts = m.FEATURE_NIXL_PUT in first.info.get("features", ())
            self._limits = {**asdict(m.DEFAULT_LIMITS), **first.info.get("limits", {})}
            self._declare(first)
        except BaseException:
            first.close()
            raise
        self._idle.put(first)

    def _open_channel(self) -> ControlChannel:
        ch = ControlChannel(self._host, self._port, self._timeout_s, self._token, self._name, self._setup_timeout_s)
        if m.FEATURE_NIXL not in ch.info.get("features", ()):
            ch.close()
            raise NixlUnavailable(f"the daemon at {self._host}:{self._port} does not offer the nixl transport "
                                  "(HELLO features; kvtierd --nixl, NIXL installed there)")
        return ch

    def _declare(self, ch: ControlChannel) -> None:
        """Send this agent's metadata and destination regions, if the daemon has an older set."""
        generation = self.agent.generation
        if ch.generation == generation:
            return
        reply = ch.exchange(m.NixlMetadata(0, self.agent.metadata(), self.agent.regions()),
                            timeout_s=self._setup_timeout_s)
        if self._daemon_agent is None:
            self._daemon_agent = self.agent.add_daemon(reply.metadata)
        ch.generation = generation

    def _count(self, **deltas) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def statistics(self) -> NixlStatistics:
        with self._lock:
            return NixlStatistics(self.transport, **self._counts, quarantined_bytes=self.agent.quarantined_bytes())

    def get_many(self, keys: list[bytes], lengths: list[int], seqs: list[int], ns_id: bytes | None = None,
                 landing: Landing | None = None) -> list:
        """Verified blocks (read-only views of a registered buffer; they stay valid while referenced),
        None where the daemon had none or the block failed verification (go to TCP for those).
        ``lengths``/``seqs`` are the LOOKUP locations'. With a ``landing`` that names its region, a
        block of the size it expects is written straight into its views there (a head slot here)
        and comes back as a :class:`~.scatter_plan.LandedBlock`. NixlFetchFailed: nothing was delivered."""
        views = [None] * len(keys)
        if landing is not None and landing.region is not None:
            for i, n in enumerate(lengths):
                rows = landing.views(i, 0)
                if n == landing.head_nbytes + sum(v.nbytes for v in rows):
                    views[i] = rows
        spans = [-(-(landing.head_nbytes if v is not None else n) // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES
                 for n, v in zip(lengths, views)]
        buf = self.agent.take_buffer(max(sum(spans), 1))
        if buf is None:
            raise NixlFetchFailed("every NIXL destination buffer is in use")
        starts = np.cumsum([0] + spans[:-1]).tolist()
        destinations = [[buf[at:at + n]] if v is None else [buf[at:at + landing.head_nbytes], *v]
                        for at, n, v in zip(starts, lengths, views)]
        scatter = any(v is not None for v in views)
        arriving = ArrivingBlocks(destinations)
        try:
            with self.agent.lend(landing.region) if scatter else nullcontext():
                return self._fetch(keys, lengths, seqs, ns_id, destinations, arriving, scatter)
        finally:
            if arriving.transfer_open:
                self.agent.retire(buf)
                self._count(buffers_retired=1)
            if arriving.unsettled:
                self.agent.quarantine(landing.region)

    def _fetch(self, keys, lengths, seqs, ns_id, destinations: list[list[memoryview]], arriving: ArrivingBlocks,
               scatter: bool) -> list:
        extents = [tuple((buffer_address(v), v.nbytes) for v in views) for views in destinations]
        results: list = [None] * len(keys)
        pending = list(range(len(keys)))
        with self._channel() as ch:
            while pending:
                self._declare(ch)  # a buffer registered since: the daemon must know it first
                lengths_written = self._get(ch, [keys[i] for i in pending],
                                            [(extents[i][0][0], sum(n for _, n in extents[i])) for i in pending],
                                            ns_id, arriving, pending,
                                            tuple(extents[i] for i in pending) if scatter else None)
                deferred = [i for i, n in zip(pending, lengths_written) if n == DEFERRED_LENGTH]
                for i, n in zip(pending, lengths_written):
                    if n and n != DEFERRED_LENGTH:
                        results[i] = self._verified(arriving, i, n, keys[i], seqs[i])
                pending = deferred
        return results

    @contextmanager
    def _channel(self):
        """A control connection for the body: given back after it, or closed when the body raised
        anything but NixlFetchFailed (a refusal: the connection serves on) or left a reply unread."""
        ch = self._take_channel()
        try:
            yield ch
        except NixlFetchFailed:
            if ch.broken:
                ch.close()
                ch = None
            raise
        except BaseException:
            ch.close()
            ch = None
            raise
        finally:
            self._give_channel(ch)

    def _get(self, ch: ControlChannel, keys, descriptors, ns_id, arriving: ArrivingBlocks,
             items: list[int], extents=None) -> tuple[int, ...]:
        """One NIXL_GET of ``keys`` (``items``: their indexes in ``arriving``); the parts the daemon
        notifies are checked as they come, while the reply is awaited and after it."""
        def take_parts() -> bool:
            self.agent.progress()
            parts = self.agent.take_parts(self._daemon_agent, ch.last_request_id)
            for item, offset, length in parts:
                if item < len(items):
                    arriving.arrived(items[item], offset, length)
            return bool(parts)

        arriving.transfer_open = True  # until the reply: the daemon sends it once every WRITE is done
        try:
            reply = ch.exchange(m.NixlGet(0, tuple(keys), self.agent.name, tuple(descriptors), ns_id, True, extents),
                                while_waiting=take_parts, wait_max_s=self._wait_max_s)
        except p.RemoteError as exc:
            self._count(refused=1)
            arriving.transfer_open = exc.code != p.ErrorCode.BAD_REQUEST  # BAD_REQUEST: refused before any WRITE
            if arriving.transfer_open and extents is not None:  # released, not cancelled: over TCP bytes still come
                self._scatter_unsettled(ch, arriving, f"the daemon gave up on its WRITEs: {_code_name(exc.code)}")
            raise NixlFetchFailed(f"NIXL_GET refused by the daemon: {exc}") from None
        except BaseException:
            if extents is not None:  # the caller's memory: it must not be written once the load returns
                self._settle(ch, arriving, take_parts)
            raise
        arriving.transfer_open = False
        self._count(requests=1)
        written = [(items[j], n) for j, n in enumerate(reply.lengths) if n and n != DEFERRED_LENGTH]
        deadline = time.monotonic() + NOTIFICATION_TIMEOUT_S
        backoff = Backoff(WAIT_FIRST_S, self._wait_max_s)
        while True:
            if take_parts():
                backoff.reset()
            if all(arriving.covered(i, n) for i, n in written):
                return reply.lengths
            if time.monotonic() > deadline:
                self._count(notification_timeouts=1)
                raise NixlFetchFailed(f"the NIXL notifications of request {ch.last_request_id} did not cover its "
                                      f"blocks within {NOTIFICATION_TIMEOUT_S} s (NOTIFICATION_TIMEOUT_S)")
            backoff.sleep(deadline)

    def _settle(self, ch: ControlChannel, arriving: ArrivingBlocks, take_parts) -> None:
        """End a scatter NIXL_GET that got no reply on ``ch``: wait for the daemon to end it, progressing
        the agent meanwhile (a WRITE over TCP moves only so), and count how that went."""
        def progress() -> bool:
            nonlocal progressing
            if progressing:
                try:
                    return take_parts()
                except NixlFetchFailed as exc:  # the daemon's WRITE then times out, and it ends the request
                    progressing = False
                    log.warning("event=nixl_settle_progress_failed daemon=%s:%d error=%s", self._host, self._port, exc)

        progressing = True
        started = time.monotonic()
        end = ch.settle(SETTLE_TIMEOUT_S, progress, self._wait_max_s)
        if end is None:
            self._scatter_unsettled(ch, arriving,
                                    f"the daemon did not end it within {SETTLE_TIMEOUT_S} s (SETTLE_TIMEOUT_S)")
        elif isinstance(end, p.ErrorReply) and end.code != p.ErrorCode.BAD_REQUEST:
            self._scatter_unsettled(ch, arriving, f"the daemon gave up on its WRITEs: {_code_name(end.code)}")
        else:  # its reply (every WRITE done, or refused before any), or its close (it had ended the request)
            self._count(scatters_settled=1)
            log.info("event=nixl_scatter_settled daemon=%s:%d request=%d wait_s=%.3f", self._host, self._port,
                     ch.last_request_id, time.monotonic() - started)

    def _scatter_unsettled(self, ch: ControlChannel, arriving: ArrivingBlocks, why: str) -> None:
        """A scatter NIXL_GET whose WRITEs may still land in the caller's memory after the load returns:
        that memory is quarantined when the load returns (get_many)."""
        arriving.unsettled = True
        self._count(scatters_unsettled=1)
        log.warning("event=nixl_scatter_unsettled daemon=%s:%d request=%d: %s; a late WRITE may land in the caller's "
                    "memory, which is kept referenced for good", self._host, self._port, ch.last_request_id, why)

    @property
    def puts(self) -> bool:
        """Whether the daemon answers NIXL_PUT (feature ``nixl_put``) and we still send them (:mod:`.nixl_held`)."""
        return self._puts and not self.agent.held.puts_stopped

    def put_many(self, items, durable: bool = False, ns_id: bytes | None = None) -> list[int]:
        """PUT ``(key, block)`` items (a block: bytes-like or :class:`~kvtier.wire.events.BlockParts`)
        by having the daemon READ them: in place where they lie in memory this agent registered
        (:meth:`ClientAgent.lend_range`; a piece of ``LEND_PIECE_BYTES_MIN`` or more outside it, a
        send buffer, is lent for the call), through a staging buffer otherwise. Their seqs, as
        ``BlockClient.put_many``'s. NixlFetchFailed: refused or failed (PUT them over TCP)."""
        keys = [bytes(k) for k, _ in items]
        blocks = [[as_bytes_view(part) for part in (b if isinstance(b, m.BlockParts) else (b,))] for _, b in items]
        addresses = [[buffer_address(piece) if piece.nbytes else 0 for piece in pieces] for pieces in blocks]
        limits = self._limits
        registered = RegisteredMemory(self.agent.regions())
        seqs: list[int] = []
        large = [(a, piece.nbytes) for pieces, where in zip(blocks, addresses) for piece, a in zip(pieces, where)
                 if piece.nbytes >= LEND_PIECE_BYTES_MIN and not registered.touches(a, piece.nbytes)]
        with self.agent.lend_all(large):  # what is not lent is staged
            frames = plan_put(blocks, addresses, RegisteredMemory(self.agent.regions()),
                              limits["payload_bytes_max"], limits["batch_count_max"], limits["meta_bytes_max"])
            with self._channel() as ch:
                for frame in frames:
                    seqs += self._put_frame(ch, frame, [keys[i] for i in frame.indexes], durable, ns_id,
                                            [piece for i in frame.indexes for piece in blocks[i]])
        return seqs

    def _put_frame(self, ch: ControlChannel, frame: PutFrame, keys: list[bytes], durable: bool, ns_id,
                   pieces: list) -> list[int]:
        staging = self.agent.take_buffer(frame.staged_bytes) if frame.staged_bytes else None
        if frame.staged_bytes and staging is None:
            raise NixlFetchFailed("every NIXL staging buffer is in use")
        for at, piece in frame.staged:
            staging[at:at + piece.nbytes] = piece
        self._declare(ch)  # a buffer registered or memory lent since: the daemon must know it first
        extents = frame.resolved(buffer_address(staging) if staging is not None else 0)
        try:
            reply = ch.exchange(m.NixlPut(0, tuple(keys), self.agent.name, extents, durable, ns_id),
                                while_waiting=self.agent.progress, wait_max_s=self._wait_max_s)
        except BaseException as exc:
            if may_have_posted(exc):  # its READ may still be served from these: they stay mapped (nixl_held)
                self.agent.held.hold(pieces)
                self._count(puts_held=1)
            if isinstance(exc, p.RemoteError):
                self._count(puts_refused=1)
                raise NixlFetchFailed(f"NIXL_PUT refused by the daemon: {exc}") from None
            raise
        finally:
            del staging
        self._count(puts=1, put_blocks=len(keys), put_bytes=frame.nbytes, put_bytes_staged=frame.staged_bytes)
        return list(reply.seqs)

    def _verified(self, arriving: ArrivingBlocks, item: int, length: int, key: bytes, seq: int):
        try:
            view = arriving.finish(item, length, key, seq)
        except BlockFormatError:
            self._count(corrupt_blocks=1)
            return None
        self._count(blocks=1, bytes=length, blocks_in_place=int(isinstance(view, LandedBlock)))
        return view

    def _take_channel(self) -> ControlChannel:
        if not self._slots.acquire(timeout=self._timeout_s):
            raise NixlFetchFailed(f"no NIXL control connection free within {self._timeout_s} s")
        try:
            if self._closed:
                raise p.ClientError("the NIXL transport is closed")
            try:
                return self._idle.get_nowait()
            except queue.Empty:
                return self._open_channel()
        except BaseException:
            self._slots.release()
            raise

    def _give_channel(self, ch: ControlChannel | None) -> None:
        if ch is not None:
            with self._lock:
                kept = not self._closed
                if kept:
                    self._idle.put(ch)
            if not kept:
                ch.close()
        self._slots.release()

    def close(self) -> None:
        """Close the idle control connections (the daemon then forgets this agent's regions); one still
        serving a request is closed when it ends, and a request made after this raises ClientError."""
        with self._lock:
            self._closed = True
            idle = []
            while not self._idle.empty():
                idle.append(self._idle.get_nowait())
        for ch in idle:
            ch.close()
