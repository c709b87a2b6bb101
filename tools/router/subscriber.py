"""Keeps a :class:`.routing_table.RoutingTable` up to date from N nodes' KV events.

One thread, one poll over every node's SUB socket, its connection monitor and a stop fd:

* a node's PUB connects (first time, or after it restarted): load its snapshot, then the
  batches that arrived meanwhile;
* its connection drops: the node is down (left out of answers);
* a batch: applied; on a gap, ask the node's replay socket for what is missing, and if that
  cannot close the gap, load a snapshot. Batches that arrive while a node catches up wait in
  a bounded list (past it, the node is resynchronized from a snapshot again);
* a snapshot that fails (the node's admin API is not up yet) is tried again every
  ``SNAPSHOT_RETRY_S`` until it succeeds or the connection drops.

Snapshots and replays are fetched on worker threads (a node whose admin API or replay socket
hangs must not hold up every other node's events); the node's batches wait in its list
meanwhile, and the result is applied on the polling thread, unless the node's connection
changed since it was asked for.
"""
from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvtier.daemon.events import kv_event_format as fmt

from .node_sources import NodeSpec, SourceError, fetch_snapshot, request_replay
from .routing_table import ApplyOutcome, RoutingTable

log = logging.getLogger("kvtier.router")

PENDING_BATCHES_MAX = 100_000  # batches held for a node that is catching up
SNAPSHOT_RETRY_S = 0.5  # a node whose snapshot failed (its admin API not up yet, say) is asked again this soon
FETCH_WORKERS_MAX = 8  # snapshots and replays fetched at once


class EventSubscriber:
    def __init__(self, table: RoutingTable, nodes: Sequence[NodeSpec]):
        if len({n.node_id for n in nodes}) != len(nodes):
            raise ValueError("node ids must be distinct")
        self.table = table
        self.nodes = {n.node_id: n for n in nodes}
        self._ctx = zmq.Context()
        self._subs: dict[str, zmq.Socket] = {}
        self._monitors: dict[zmq.Socket, str] = {}
        self._pending: dict[str, list[tuple[int, fmt.KVEventBatch]]] = {n: [] for n in self.nodes}
        self._snapshot_due: dict[str, float] = {}  # node -> when to try its failed snapshot again (monotonic)
        self._fetching: dict[str, _Fetch] = {}  # node -> its replay or snapshot (dropped when its connection changes)
        self._fetches = ThreadPoolExecutor(max_workers=max(1, min(FETCH_WORKERS_MAX, len(nodes))),
                                           thread_name_prefix="kvtier-router-fetch")
        self._fetched_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # a fetch ended
        self._fetched_lock = threading.Lock()  # the fd is closed at stop(); a fetch may end later
        self._counts: Counter[str] = Counter()
        self._counts_lock = threading.Lock()
        self._stop_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="kvtier-router-events", daemon=True)

    def start(self) -> None:
        for node in self.nodes.values():
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.RCVHWM, 0)
            sub.setsockopt(zmq.LINGER, 0)
            monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            sub.connect(node.events)
            self._subs[node.node_id] = sub
            self._monitors[monitor] = node.node_id
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and close the sockets (idempotent)."""
        if self._ctx.closed:
            return
        if self._thread.is_alive():
            os.eventfd_write(self._stop_fd, 1)
            self._thread.join()
        for sub in self._subs.values():
            sub.disable_monitor()
            sub.close(linger=0)
        for monitor in self._monitors:
            monitor.close(linger=0)
        self._ctx.term()
        self._fetches.shutdown(wait=False, cancel_futures=True)
        with self._fetched_lock:
            os.close(self._fetched_fd)
            self._fetched_fd = -1
        os.close(self._stop_fd)

    def statistics(self) -> dict:
        with self._counts_lock:
            return dict(self._counts)

    def _count(self, name: str, n: int = 1) -> None:
        with self._counts_lock:
            self._counts[name] += n

    # -- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._stop_fd, zmq.POLLIN)
        poller.register(self._fetched_fd, zmq.POLLIN)
        by_socket = {sub: node for node, sub in self._subs.items()}
        for sock in (*self._subs.values(), *self._monitors):
            poller.register(sock, zmq.POLLIN)
        while True:
            due = min(self._snapshot_due.values(), default=None)
            ready = dict(poller.poll(None if due is None else max(0, int((due - time.monotonic()) * 1000)) + 1))
            if self._stop_fd in ready:
                return
            if self._fetched_fd in ready:
                os.eventfd_read(self._fetched_fd)
                for node in [n for n, f in self._fetching.items() if f.future.done()]:
                    self._guarded(node, self._fetched, node)
            now = time.monotonic()
            for node in [n for n, at in self._snapshot_due.items() if at <= now]:
                self._guarded(node, self._resync_from_snapshot, node)
            for sock in ready:
                if sock in self._monitors:
                    self._guarded(self._monitors[sock], self._on_monitor, self._monitors[sock], sock)
                elif sock in by_socket:
                    self._guarded(by_socket[sock], self._on_messages, by_socket[sock], sock)

    def _guarded(self, node: str, handle, *args) -> None:
        """``handle(*args)`` for one node; an error it did not expect marks that node down and due for a
        snapshot instead of ending the thread that follows every node."""
        try:
            handle(*args)
        except Exception:  # noqa: BLE001 -- one node's fault is never every node's
            self._count("node_errors")
            log.exception("event=node_handling_failed node=%s", node)
            self.table.set_down(node)
            self._pending[node].clear()
            self._snapshot_due[node] = time.monotonic() + SNAPSHOT_RETRY_S

    def _on_monitor(self, node: str, sock: zmq.Socket) -> None:
        while sock.poll(0):
            event = recv_monitor_message(sock)["event"]
            if event == zmq.EVENT_CONNECTED:
                self._count("connects")
                self._fetching.pop(node, None)  # one asked for before this connection: not its state
                self._resync_from_snapshot(node)
            elif event == zmq.EVENT_DISCONNECTED:
                self._count("disconnects")
                self.table.set_down(node)
                self._pending[node].clear()
                self._snapshot_due.pop(node, None)
                self._fetching.pop(node, None)

    def _on_messages(self, node: str, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                _, seq, batch = fmt.parse_message(frames)
            except fmt.KVEventFormatError as exc:
                self._count("bad_messages")
                log.warning("event=bad_kv_event node=%s error=%s", node, exc)
                continue
            self._count("batches_received")
            if self._pending[node] or node in self._fetching:  # catching up: keep the order
                self._hold(node, seq, batch)
                self._catch_up(node)
            elif self.table.apply(node, seq, batch) is ApplyOutcome.GAP:
                self._count("gaps")
                self._hold(node, seq, batch)
                self._catch_up(node)

    def _hold(self, node: str, seq: int, batch: fmt.KVEventBatch) -> None:
        pending = self._pending[node]
        pending.append((seq, batch))
        if len(pending) > PENDING_BATCHES_MAX:
            pending.clear()
            self._resync_from_snapshot(node)

    def _drain(self, node: str) -> bool:
        """Apply the held batches in order; True when none is left (no gap remains)."""
        pending = sorted(self._pending[node], key=lambda item: item[0])
        for i, (seq, batch) in enumerate(pending):
            if self.table.apply(node, seq, batch) is ApplyOutcome.GAP:
                self._pending[node] = pending[i:]
                return False
        self._pending[node] = []
        return True

    def _catch_up(self, node: str) -> None:
        """Close a gap: the replay socket first, then a snapshot."""
        if node in self._fetching:  # a replay or snapshot is on its way: the held batches wait for it
            return
        if self._drain(node) or node in self._snapshot_due:  # a failed snapshot is retried on its timer
            return
        applied = self.table.node_seq(node)
        if applied is not None and self.nodes[node].replay is not None:
            self._fetch(node, _Kind.REPLAY, request_replay, self._ctx, self.nodes[node], applied + 1)
        else:
            self._resync_from_snapshot(node)

    def _resync_from_snapshot(self, node: str) -> None:
        """Ask for the node's snapshot (once at a time); :meth:`_snapshot_fetched` applies it."""
        if node in self._fetching:
            return
        self._snapshot_due.pop(node, None)
        self._fetch(node, _Kind.SNAPSHOT, fetch_snapshot, self.nodes[node])

    def _fetch(self, node: str, kind: "_Kind", read, *args) -> None:
        future = self._fetches.submit(read, *args)
        self._fetching[node] = _Fetch(kind, future)
        future.add_done_callback(self._wake_for_fetched)

    def _wake_for_fetched(self, _future: Future) -> None:
        with self._fetched_lock:
            if self._fetched_fd >= 0:
                os.eventfd_write(self._fetched_fd, 1)

    def _fetched(self, node: str) -> None:
        fetch = self._fetching.pop(node)
        if fetch.kind is _Kind.SNAPSHOT:
            self._snapshot_fetched(node, fetch.future)
        else:
            self._replay_fetched(node, fetch)

    def _replay_fetched(self, node: str, fetch: "_Fetch") -> None:
        try:
            batches = fetch.future.result()
        except SourceError as exc:
            self._count("replay_failures")
            log.warning("event=replay_failed %s", exc)
            if fetch.kind is _Kind.REPLAY:
                self._resync_from_snapshot(node)
            return
        self._pending[node] += batches
        self._count("replays")
        if not self._drain(node) and fetch.kind is _Kind.REPLAY:
            self._resync_from_snapshot(node)

    def _snapshot_fetched(self, node: str, future: Future) -> None:
        try:
            snapshot = future.result()
        except SourceError as exc:
            self._count("snapshot_failures")
            log.warning("event=snapshot_failed %s", exc)
            self.table.set_down(node)
            self._snapshot_due[node] = time.monotonic() + SNAPSHOT_RETRY_S
            return
        self._snapshot_due.pop(node, None)
        self.table.load_snapshot(node, snapshot.seq, snapshot.keys())
        self._count("snapshots")
        if not self._drain(node) and self.nodes[node].replay is not None:
            # batches published before our subscription took effect: the replay has them
            self._fetch(node, _Kind.REPLAY_AFTER_SNAPSHOT, request_replay, self._ctx, self.nodes[node],
                        snapshot.seq + 1)


class _Kind(enum.Enum):
    SNAPSHOT = "snapshot"
    REPLAY = "replay"  # a gap's: one that fails or falls short is followed by a snapshot
    REPLAY_AFTER_SNAPSHOT = "replay after snapshot"  # one that fails leaves the gap to the next batch


@dataclass(frozen=True)
class _Fetch:
    kind: _Kind
    future: Future
