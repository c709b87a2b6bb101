"""The KV-events publisher thread: a ZMQ PUB socket, and a ROUTER socket that replays the
recent batches, as vLLM's ``ZmqEventPublisher`` does (:mod:`.kv_event_format`).

The thread sleeps in one poll on the sink's eventfd and the replay socket. On a wake it
takes every queued batch, encodes it and sends it; the PUB socket never blocks (ZMQ drops
messages for a subscriber past its high-water mark: that subscriber sees a gap). The last
``replay_batches_max`` payloads are kept for replay requests.

Both sockets bind (subscribers connect to each daemon): ``tcp://HOST:PORT``, port 0 for one
the kernel picks (:attr:`KVEventPublisher.endpoint` and ``replay_endpoint`` say which).
"""
from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass

import zmq

from . import kv_event_format as fmt
from .event_sink import EventKind, KVEventSink, QueuedBatch, halves_to_keys

log = logging.getLogger("kvtier.daemon.events")

REPLAY_BATCHES_MAX = 10_000  # batches kept for replay (vLLM's buffer_steps default)
PUB_HWM_MESSAGES = 100_000  # per subscriber, queued by ZMQ before it drops for that subscriber
STOP_TIMEOUT_S = 5.0  # how long stop() waits for the thread to send what is queued


@dataclass(frozen=True)
class PublisherStatistics:
    endpoint: str
    replay_endpoint: str | None
    batches_published: int
    batches_dropped: int  # queue full: never sent (their numbers are gaps)
    queue_batches: int
    seq_last: int
    events_stored: int
    events_removed: int
    events_cleared: int
    bytes_published: int
    replay_requests: int
    replay_bad_requests: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind; a tcp port of 0 becomes one the kernel picks. Returns the bound endpoint."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        endpoint = endpoint[:-1] + "*"
    if endpoint.startswith("tcp://[") or endpoint.count(":") > 2:
        sock.setsockopt(zmq.IPV6, 1)
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class KVEventPublisher:
    def __init__(self, sink: KVEventSink, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 replay_batches_max: int = REPLAY_BATCHES_MAX):
        self._sink = sink
        self._topic = topic.encode()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=replay_batches_max)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, PUB_HWM_MESSAGES)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            self.endpoint = _bind(self._pub, endpoint)
            self.replay_endpoint = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (replay_batches_max + 1))  # a whole replay and its end
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = _bind(self._replay, replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(f"kv events: cannot bind {endpoint!r}"
                          f"{'' if replay_endpoint is None else f' / {replay_endpoint!r}'}: {exc}") from None
        self._lock = threading.Lock()
        self._counts = collections.Counter()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvtierd-kv-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Send what is queued, then close the sockets (idempotent)."""
        self._stopping = True
        self._sink.wake()
        if self._thread.is_alive():
            self._thread.join(STOP_TIMEOUT_S)
        if self._thread.is_alive():  # its sockets are its own until it returns; it dies with the process
            log.warning("event=kv_events_stop_timeout timeout_s=%s", STOP_TIMEOUT_S)
            return
        self._close_sockets()

    def _close_sockets(self) -> None:
        if self._ctx.closed:
            return
        for sock in (self._pub, self._replay):
            if sock is not None and not sock.closed:
                sock.close(linger=0)
        self._ctx.term()

    # -- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sink.wake_fd, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._sink.wake_fd in ready:
                self._sink.clear_wake()
                for batch in self._sink.take_all():
                    self._publish(batch)
            if self._replay is not None and ready.get(self._replay):
                self._serve_replay()
            if self._stopping:
                for batch in self._sink.take_all():
                    self._publish(batch)
                return

    def _publish(self, queued: QueuedBatch) -> None:
        keys = halves_to_keys(queued.k0, queued.k1)
        if queued.kind is EventKind.STORED:
            event, name = fmt.stored(keys), "events_stored"
        elif queued.kind is EventKind.REMOVED:
            event, name = fmt.removed(keys), "events_removed"
        else:
            event, name = fmt.AllBlocksCleared(), "events_cleared"
        payload = fmt.encode_batch(fmt.KVEventBatch(ts=queued.ts, events=[event]))
        try:
            self._pub.send_multipart(fmt.message_frames(self._topic, queued.seq, payload), flags=zmq.NOBLOCK)
        except zmq.Again:  # no subscriber can take it now: replay or a snapshot catches them up
            pass
        self._buffer.append((queued.seq, payload))
        with self._lock:
            self._counts[name] += 1
            self._counts["batches_published"] += 1
            self._counts["bytes_published"] += len(payload)

    def _serve_replay(self) -> None:
        while True:
            try:
                frames = self._replay.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != fmt.SEQ_BYTES:
                with self._lock:
                    self._counts["replay_bad_requests"] += 1
                log.warning("event=kv_events_bad_replay_request frames=%d", len(frames))
                if frames and len(frames) >= 2:
                    self._send_replay(frames[0], [(b"", fmt.END_SEQ, b"")])
                continue
            client, start = frames[0], fmt.decode_seq(frames[2])
            with self._lock:
                self._counts["replay_requests"] += 1
            answer = [(self._topic, fmt.encode_seq(seq), payload) for seq, payload in self._buffer if seq >= start]
            self._send_replay(client, answer + [(b"", fmt.END_SEQ, b"")])

    def _send_replay(self, client: bytes, messages: list[tuple[bytes, bytes, bytes]]) -> None:
        try:
            for topic, seq, payload in messages:
                self._replay.send_multipart((client, b"", topic, seq, payload), flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # the requester is gone or too slow: it asks again or takes a snapshot
            pass

    def statistics(self) -> PublisherStatistics:
        sink = self._sink.statistics()
        with self._lock:
            c = dict(self._counts)
        return PublisherStatistics(
            endpoint=self.endpoint, replay_endpoint=self.replay_endpoint,
            batches_published=c.get("batches_published", 0), batches_dropped=sink.batches_dropped,
            queue_batches=sink.queue_batches, seq_last=sink.seq_last,
            events_stored=c.get("events_stored", 0), events_removed=c.get("events_removed", 0),
            events_cleared=c.get("events_cleared", 0), bytes_published=c.get("bytes_published", 0),
            replay_requests=c.get("replay_requests", 0), replay_bad_requests=c.get("replay_bad_requests", 0))
