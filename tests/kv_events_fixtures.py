"""kvtierd processes that publish KV events, on ports chosen for them (a restart keeps them),
and a SUB socket that waits until the publisher serves it."""
from __future__ import annotations

import json
import urllib.request

import zmq

from daemon_proc import start_kvtierd
from ports import free_port
from kvtier.daemon.events import kv_event_format as fmt

RECEIVE_TIMEOUT_MS = 5000


def start_events_daemon(path, *extra: str, replay: bool = True):
    events = f"tcp://127.0.0.1:{free_port()}"
    args = ["--kv-events-endpoint", events, *extra]
    replay_endpoint = None
    if replay:
        replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
        args += ["--kv-events-replay-endpoint", replay_endpoint]
    daemon = start_kvtierd(path, *args, admin=f"127.0.0.1:{free_port()}")  # kept by a restart
    daemon.events_endpoint, daemon.replay_endpoint = events, replay_endpoint
    return daemon


def admin_get(daemon, path: str) -> dict:
    with urllib.request.urlopen(f"http://{daemon.admin_addr}{path}", timeout=30) as reply:
        return json.loads(reply.read())


def admin_post(daemon, path: str, doc: dict) -> dict:
    request = urllib.request.Request(f"http://{daemon.admin_addr}{path}", data=json.dumps(doc).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())


class Subscription:
    """A SUB socket on a daemon's PUB endpoint."""

    def __init__(self, ctx: zmq.Context, endpoint: str):
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def receive(self, timeout_ms: int = RECEIVE_TIMEOUT_MS) -> tuple[int, fmt.KVEventBatch] | None:
        if not self.sock.poll(timeout_ms):
            return None
        _, seq, batch = fmt.parse_message(self.sock.recv_multipart())
        return seq, batch

    def wait_served(self, put_probe, attempts: int = 50) -> tuple[int, fmt.KVEventBatch]:
        """PUT probe blocks until one's event arrives: from then on the publisher sends to us
        (a PUB drops messages for a subscription it has not seen yet)."""
        for attempt in range(attempts):
            put_probe(attempt)
            got = self.receive(200)
            if got is not None:
                return got
        raise AssertionError(f"no KV event after {attempts} probe PUTs")

    def close(self) -> None:
        self.sock.close(linger=0)
