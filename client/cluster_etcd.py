"""The members of an etcd cluster, read once and then watched (``etcd://HOST:PORT/PREFIX``).

::

    start   range /PREFIX/members/ (etcd away: ClusterUnavailable naming the URL)
    thread  watch from the range's revision + 1 and apply each PUT / DELETE to the table;
            a broken stream marks the view stale (kept as it was), is counted, and after
            RETRY_INTERVAL_S a full range (resync) and a new watch follow
    close   shut the watch's socket down and join the thread

Unary calls go through etcd3gw (etcd's JSON gateway, ``/v3/``); the watch stream is read
here with http.client, on a socket this module owns, so that the end of the stream (etcd
killed) is seen at once and close() can interrupt it. Bookkeeping is
:class:`~.cluster_members.MemberTable`.
"""
from __future__ import annotations

import base64
import http.client
import json
import logging
import socket
import threading
from typing import Any

from kvtier.common.addresses import format_address
from kvtier.common.cluster_url import ClusterUrl

from .cluster_members import ClusterUnavailable, MembersStatistics, MemberTable, MemberView

log = logging.getLogger("kvtier.client.cluster")

API_PATH = "/v3/"  # etcd >= 3.4
REQUEST_TIMEOUT_S = 2.0  # one range or lease call
RETRY_INTERVAL_S = 0.5  # etcd lost: how often to try again
WATCH_CONNECT_TIMEOUT_S = 2.0
WATCH_LINE_BYTES_MAX = 4 << 20  # one watch response: a few hundred member events at most
TCP_KEEPALIVE_IDLE_S, TCP_KEEPALIVE_INTERVAL_S, TCP_KEEPALIVE_COUNT = 5, 2, 3  # a silent peer: gone in ~11 s
JOIN_GRACE_S = 1.0  # beyond the longest request the watch thread may be in when closed


class EtcdError(Exception):
    """An etcd request or watch failed; names the URL."""


def _b64(raw: str | bytes) -> str:
    return base64.b64encode(raw.encode() if isinstance(raw, str) else raw).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_range(prefix: str) -> dict[str, str]:
    """The request fields that select every key starting with ``prefix``."""
    raw = prefix.encode()
    assert raw and raw[-1] < 0xFF, f"prefix {prefix!r}"
    return {"key": _b64(raw), "range_end": _b64(raw[:-1] + bytes([raw[-1] + 1]))}


class EtcdReader:
    """Range and lease calls over etcd3gw, endpoints tried in order from the last that answered."""

    def __init__(self, url: ClusterUrl, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        try:
            import etcd3gw
            from etcd3gw.exceptions import Etcd3Exception
        except ModuleNotFoundError as exc:
            raise ClusterUnavailable(f"etcd:// needs {exc.name}, from the cluster extra: "
                                     "pip install 'kvtier[cluster]'") from None
        self.url = url
        self.timeout_s = timeout_s
        self._errors = (Etcd3Exception,)
        self._clients = [etcd3gw.Etcd3Client(host=h, port=p, timeout=timeout_s, api_path=API_PATH)
                         for h, p in url.endpoints]
        self.current = 0  # index into url.endpoints of the one that answered last

    def post(self, path: str, payload: dict) -> dict[str, Any]:
        last = None
        for step in range(len(self._clients)):
            i = (self.current + step) % len(self._clients)
            client = self._clients[i]
            try:
                out = client.post(client.get_url(path), json=payload)
            except self._errors as exc:
                last = f"{format_address(client.host, client.port)}: {type(exc).__name__}: {exc.detail_text or exc}"
                continue
            self.current = i
            return out
        raise EtcdError(f"etcd at {self.url.text} did not answer ({last})")

    def members(self) -> tuple[list[tuple[str, bytes, int]], int]:
        """(key, value, lease id) of every member key, and the revision they were read at."""
        out = self.post("/kv/range", prefix_range(self.url.members_prefix))
        kvs = [(_unb64(kv["key"]).decode(errors="replace"), _unb64(kv.get("value", "")), int(kv.get("lease", 0)))
               for kv in out.get("kvs", [])]
        return kvs, int(out["header"]["revision"])

    def lease_ttl_s(self, lease_id: int) -> int:
        """Seconds the lease has left (-1: gone)."""
        return int(self.post("/kv/lease/timetolive", {"ID": lease_id}).get("TTL", -1))


class WatchStream:
    """One watch on a key range, read line by line (each line one JSON watch response)."""

    def __init__(self, host: str, port: int) -> None:
        self._conn = http.client.HTTPConnection(host, port, timeout=WATCH_CONNECT_TIMEOUT_S)
        self._resp = None

    def open(self, request: dict) -> None:
        """Connect and start the watch: bounded by WATCH_CONNECT_TIMEOUT_S until etcd has answered
        its headers, then without a timeout (a watch is quiet while nothing changes; keepalives
        find a dead peer). :meth:`shutdown` from another thread interrupts it."""
        self._conn.connect()
        sock = self._conn.sock
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, value in (("TCP_KEEPIDLE", TCP_KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", TCP_KEEPALIVE_INTERVAL_S),
                           ("TCP_KEEPCNT", TCP_KEEPALIVE_COUNT)):
            if hasattr(socket, opt):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
        body = json.dumps({"create_request": request}).encode()
        self._conn.request("POST", API_PATH + "watch", body, {"Content-Type": "application/json"})
        self._resp = self._conn.getresponse()
        if self._resp.status != 200:
            raise EtcdError(f"watch refused: HTTP {self._resp.status} {self._resp.read(512)!r}")
        sock.settimeout(None)

    def next_response(self) -> dict:
        """The next watch response; EtcdError when the stream ends (etcd gone or close())."""
        line = self._resp.readline(WATCH_LINE_BYTES_MAX)
        if not line:
            raise EtcdError("the watch stream ended")
        if not line.endswith(b"\n") and len(line) >= WATCH_LINE_BYTES_MAX:
            raise EtcdError(f"a watch response is over {WATCH_LINE_BYTES_MAX} bytes")
        doc = json.loads(line)
        if "error" in doc:
            raise EtcdError(f"watch error: {doc['error']}")
        return doc.get("result", {})

    def shutdown(self) -> None:
        """Interrupt a blocked :meth:`next_response` from another thread."""
        sock = self._conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by the peer: the reader sees the end either way

    def close(self) -> None:
        self._conn.close()


class EtcdMembers:
    """:class:`~.cluster_members.ClusterMembers` over etcd (see the module doc)."""

    def __init__(self, url: ClusterUrl, *, request_timeout_s: float = REQUEST_TIMEOUT_S,
                 retry_interval_s: float = RETRY_INTERVAL_S) -> None:
        self.url = url
        self.reader = EtcdReader(url, request_timeout_s)
        self._retry_interval_s = retry_interval_s
        self._table = MemberTable(url)
        self._changed = threading.Condition()  # guards _table, _view and the counters
        self._view: MemberView = self._table.view()
        self._etcd_errors = self._resyncs = 0
        self._stop = threading.Event()
        self._stream: WatchStream | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> "EtcdMembers":
        try:
            self._resync()
        except EtcdError as exc:
            raise ClusterUnavailable(f"cannot read the members at {self.url.text}: {exc}") from None
        self._thread = threading.Thread(target=self._run, name="kvtier-members-watch", daemon=True)
        self._thread.start()
        return self

    def current(self) -> MemberView:
        with self._changed:
            return self._view

    def wait_changed(self, version: int, timeout_s: float) -> MemberView:
        """The current view if newer than ``version``, else the next one published (a change,
        or the view turning stale or fresh again), else after ``timeout_s`` the current one."""
        with self._changed:
            start = self._view
            self._changed.wait_for(lambda: self._view.version > version or self._view is not start
                                   or self._stop.is_set(), timeout_s)
            return self._view

    def statistics(self) -> MembersStatistics:
        with self._changed:
            t = self._table
            return MembersStatistics(self.url.text, len(self._view), self._view.version, self._view.stale,
                                     t.joins, t.leaves, t.updates, t.bad_records, self._etcd_errors, self._resyncs)

    def close(self) -> None:
        self._stop.set()
        stream = self._stream
        if stream is not None:
            stream.shutdown()
        if self._thread is not None:
            longest_s = max(self.reader.timeout_s, WATCH_CONNECT_TIMEOUT_S) * len(self.url.endpoints)
            self._thread.join(longest_s + JOIN_GRACE_S)
            if self._thread.is_alive():  # a daemon thread: it ends with its next etcd answer or timeout
                log.error("event=etcd_watch_not_stopped cluster=%s waited_s=%.1f", self.url.text,
                          longest_s + JOIN_GRACE_S)
        with self._changed:
            self._changed.notify_all()

    def __enter__(self) -> "EtcdMembers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the watch thread --------------------------------------------------------------
    def _run(self) -> None:
        need_resync = False
        while not self._stop.is_set():
            try:
                if need_resync:
                    self._resync()
                    need_resync = False
                self._watch()
            except (EtcdError, OSError, ValueError, http.client.HTTPException) as exc:
                if self._stop.is_set():
                    break
                self._lost(exc)
                need_resync = True
                self._stop.wait(self._retry_interval_s)

    def _lost(self, exc: BaseException) -> None:
        with self._changed:
            self._etcd_errors += 1
            was_stale = self._view.stale
            if not was_stale:
                self._view = self._table.view(stale=True)
                self._changed.notify_all()
        if not was_stale:
            log.error("event=etcd_watch_lost cluster=%s error=%s: %s (routing on the last view)", self.url.text,
                      type(exc).__name__, exc)

    def _resync(self) -> None:
        kvs, revision = self.reader.members()
        with self._changed:
            resynced = self._thread is not None
            self._resyncs += resynced
            self._table.reset(kvs, revision)
            self._publish()
        if resynced:
            log.warning("event=etcd_watch_back cluster=%s members=%d", self.url.text, len(self._view))

    def _publish(self) -> None:
        """A new view from the table (the caller holds the lock) and wake the waiters."""
        self._view = self._table.view()
        self._changed.notify_all()

    def _watch(self) -> None:
        host, port = self.url.endpoints[self.reader.current]
        request = dict(prefix_range(self.url.members_prefix), start_revision=self._table.revision + 1)
        stream = WatchStream(host, port)
        self._stream = stream  # published first: close() can interrupt its opening too
        try:
            if self._stop.is_set():
                return
            stream.open(request)
            if self._stop.is_set():  # close() came while the stream had no socket to shut down yet
                return
            while True:
                result = stream.next_response()
                if result.get("canceled"):
                    raise EtcdError(f"watch canceled (compacted to {result.get('compact_revision')}); resyncing")
                self._apply(result)
        finally:
            self._stream = None
            stream.close()

    def _apply(self, result: dict) -> None:
        events = result.get("events", [])
        revision = int(result.get("header", {}).get("revision", 0))
        with self._changed:
            changed = False
            for event in events:
                kv = event["kv"]
                key = _unb64(kv["key"]).decode(errors="replace")
                mod = int(kv.get("mod_revision", revision))
                if event.get("type") == "DELETE":
                    changed |= self._table.delete(key, mod)
                else:
                    changed |= self._table.put(key, _unb64(kv.get("value", "")), int(kv.get("lease", 0)), mod)
            self._table.revision = max(self._table.revision, revision)
            if changed or self._view.stale:
                self._publish()
