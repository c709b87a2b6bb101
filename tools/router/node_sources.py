"""Where a router reads one node's state: its KV-events sockets and its admin API.

``NodeSpec.parse("edge-1,events=tcp://10.0.0.1:7412,replay=tcp://10.0.0.1:7413,admin=http://10.0.0.1:7411,data=10.0.0.1:7410")``

:func:`fetch_snapshot` reads ``GET /v1/kv-events/snapshot``; :func:`request_replay` asks the
replay socket for the batches from a sequence number on (a DEALER, as vLLM's replay expects).
"""
from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from dataclasses import dataclass

import zmq

from kvtier.daemon.events import kv_event_format as fmt
from kvtier.daemon.events.snapshot import KVSnapshot, snapshot_from_document

SNAPSHOT_TIMEOUT_S = 10.0  # a snapshot of millions of keys is tens of MB of JSON
REPLAY_TIMEOUT_S = 2.0  # a replay answer in full, or the router falls back to a snapshot
REPLAY_MESSAGES_MAX = 100_000  # a replay longer than the publisher's buffer cannot be honest


class SourceError(Exception):
    """A node's snapshot or replay could not be read; the message names the node and why."""


@dataclass(frozen=True)
class NodeSpec:
    node_id: str
    events: str  # tcp://HOST:PORT of the PUB socket
    admin: str  # http://HOST:PORT of the admin API (the snapshot)
    replay: str | None = None
    data: str | None = None  # HOST:PORT clients dial (what a route answer names)
    token: str | None = None  # the admin API's token, if it has one

    @classmethod
    def parse(cls, text: str, token: str | None = None) -> "NodeSpec":
        node_id, _, rest = text.partition(",")
        fields = {}
        for part in filter(None, rest.split(",")):
            name, eq, value = part.partition("=")
            if not eq or name not in ("events", "replay", "admin", "data"):
                raise ValueError(f"node {node_id!r}: {part!r} is not events=, replay=, admin= or data=")
            fields[name] = value
        if not node_id or "events" not in fields or "admin" not in fields:
            raise ValueError(f"node {text!r}: give ID,events=tcp://HOST:PORT,admin=http://HOST:PORT"
                             f"[,replay=tcp://HOST:PORT][,data=HOST:PORT]")
        return cls(node_id, token=token, **fields)


def fetch_snapshot(node: NodeSpec, timeout_s: float = SNAPSHOT_TIMEOUT_S) -> KVSnapshot:
    request = urllib.request.Request(node.admin.rstrip("/") + "/v1/kv-events/snapshot")
    if node.token is not None:
        request.add_header("Authorization", f"Bearer {node.token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            doc = json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        raise SourceError(f"node {node.node_id}: snapshot answered {exc.code}: {exc.read()[:200]!r}") from None
    except (OSError, ValueError, http.client.HTTPException) as exc:  # a reply cut short, or not HTTP
        raise SourceError(f"node {node.node_id}: snapshot from {node.admin}: {type(exc).__name__}: {exc}") from None
    try:
        return snapshot_from_document(doc)
    except ValueError as exc:
        raise SourceError(f"node {node.node_id}: {exc}") from None


def request_replay(ctx: zmq.Context, node: NodeSpec, start_seq: int,
                   timeout_s: float = REPLAY_TIMEOUT_S) -> list[tuple[int, fmt.KVEventBatch]]:
    """The buffered batches numbered ``start_seq`` and up, in order; SourceError on a timeout or
    a malformed answer."""
    if node.replay is None:
        raise SourceError(f"node {node.node_id}: no replay endpoint")
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        try:
            sock.connect(node.replay)
        except zmq.ZMQError as exc:
            raise SourceError(f"node {node.node_id}: replay endpoint {node.replay!r}: {exc}") from None
        sock.send_multipart((b"", fmt.encode_seq(start_seq)))
        out = []
        while len(out) <= REPLAY_MESSAGES_MAX:
            if not sock.poll(int(timeout_s * 1000)):
                raise SourceError(f"node {node.node_id}: replay from {start_seq} timed out after {timeout_s} s")
            frames = sock.recv_multipart()
            if len(frames) == 4 and frames[2] == fmt.END_SEQ:
                return out
            try:
                _, seq, batch = fmt.parse_message(frames[1:])
            except fmt.KVEventFormatError as exc:
                raise SourceError(f"node {node.node_id}: replay: {exc}") from None
            out.append((seq, batch))
        raise SourceError(f"node {node.node_id}: replay of more than {REPLAY_MESSAGES_MAX} batches")
    finally:
        sock.close(linger=0)
