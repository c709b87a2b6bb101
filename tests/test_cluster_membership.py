"""kvtierd members of a real etcd (on loopback): registration, SIGTERM and kill -9, etcd
down at start, etcd killed and back, the client's watched view, the daemon's metrics."""
import subprocess
import sys
import time
import urllib.request

import pytest

from cluster_fixtures import LEASE_TTL_S, etcd, members_of, start_member, wait_members  # noqa: F401
from daemon_proc import DEFAULT_ARGS, start_kvtierd
from etcd_server import EtcdServer, etcd_missing_reason
from ports import free_port
from kvtier.client import BlockClient
from kvtier.client.cluster_members import ClusterUnavailable, open_members
from kvtier.daemon.cluster.node_id import NODE_ID_FILE

POLL_S = 0.1  # how often a test re-reads a daemon's /metrics while it waits on etcd's timers
METRICS_WAIT_S = 15.0


def metric(admin_addr: str, name: str, labels: str = "") -> float | None:
    """One sample of the daemon's /metrics (``labels`` as Prometheus writes them), None if absent."""
    wanted = f"{name}{labels} "
    with urllib.request.urlopen(f"http://{admin_addr}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(wanted):
                return float(line[len(wanted):])
    return None


def wait_metric(admin_addr: str, name: str, ok, labels: str = "") -> float:
    """The metric once ``ok(value)`` holds (a daemon's timers run on their own: polled, bounded)."""
    deadline = time.monotonic() + METRICS_WAIT_S
    while True:
        value = metric(admin_addr, name, labels)
        if value is not None and ok(value):
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{name}{labels} = {value} never satisfied the test within {METRICS_WAIT_S} s")
        time.sleep(POLL_S)


def test_registers_under_the_prefix_and_deregisters_on_sigterm(etcd, tmp_path):
    a = start_member(tmp_path, etcd, "node-a")
    b = start_member(tmp_path, etcd, "node-b", prefix="other")
    try:
        assert members_of(etcd.url()) == {"node-a": a.data_addr}
        assert members_of(etcd.url("other")) == {"node-b": b.data_addr}
        assert a.stop() == 0
        assert members_of(etcd.url()) == {}  # gone at once: the key deleted and the lease revoked
    finally:
        a.stop()
        b.stop()


def test_an_old_instance_stopping_after_its_successor_leaves_the_successor_registered(etcd, tmp_path):
    old = start_member(tmp_path / "old", etcd, "node-a")
    new = start_member(tmp_path / "new", etcd, "node-a")  # same node id: its key replaces the old one's
    try:
        assert members_of(etcd.url()) == {"node-a": new.data_addr}
        assert old.stop() == 0
        assert members_of(etcd.url()) == {"node-a": new.data_addr}
        assert new.stop() == 0
        assert members_of(etcd.url()) == {}
    finally:
        old.stop()
        new.stop()


def test_node_id_is_kept_across_restarts_and_advertise_is_registered(etcd, tmp_path):
    d = start_kvtierd(tmp_path / "n", "--cluster", etcd.url(), "--lease-ttl", str(LEASE_TTL_S),
                      "--advertise", "127.0.0.9:7999")
    try:
        node_id = (tmp_path / "n" / NODE_ID_FILE).read_text().strip()
        assert members_of(etcd.url()) == {node_id: "127.0.0.9:7999"}
        d.restart()
        assert members_of(etcd.url()) == {node_id: "127.0.0.9:7999"}
    finally:
        d.stop()


def test_kill_9_leaves_within_the_lease_ttl(etcd, tmp_path):
    a, b = start_member(tmp_path, etcd, "node-a"), start_member(tmp_path, etcd, "node-b")
    members = open_members(etcd.url())
    try:
        wait_members(members, lambda v: v.node_ids == ("node-a", "node-b"))
        a.kill()
        view, waited_s = wait_members(members, lambda v: v.node_ids == ("node-b",))
        assert waited_s <= LEASE_TTL_S + 1, f"node-a left {waited_s:.2f} s after kill -9"
        assert view.addresses == (b.data_addr,)
    finally:
        members.close()
        b.stop()


def test_etcd_down_at_start_is_an_error_naming_the_url(tmp_path):
    url = f"etcd://127.0.0.1:{free_port()}/kvtier"
    cmd = [sys.executable, "-m", "kvtier.daemon.main", "--data-dir", str(tmp_path / "d"), *DEFAULT_ARGS,
           "--admin", "none", "--cluster", url]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    assert f"cannot join the cluster at {url}" in result.stderr
    assert "kvtierd ready" not in result.stdout
    with pytest.raises(ClusterUnavailable, match=f"cannot read the members at {url}"):
        open_members(url)


def test_etcd_killed_while_running_the_daemon_serves_and_comes_back(etcd, tmp_path):
    d = start_member(tmp_path, etcd, "node-a", admin="127.0.0.1:0")
    members = open_members(etcd.url())
    try:
        assert metric(d.admin_addr, "kvtier_cluster_registered", '{node_id="node-a",state="registered"}') == 1.0
        etcd.kill()
        wait_metric(d.admin_addr, "kvtier_cluster_etcd_errors_total", lambda v: v >= 1)
        view, _ = wait_members(members, lambda v: v.stale)
        assert view.node_ids == ("node-a",)  # the last view, kept
        with BlockClient(d.data_addr) as c:  # serving on
            assert c.ping() >= 0
        etcd.start()  # same ports, same data: the lease survived (etcd renews leases on restart)
        wait_metric(d.admin_addr, "kvtier_cluster_registered", lambda v: v == 1.0,
                    '{node_id="node-a",state="registered"}')
        view, _ = wait_members(members, lambda v: not v.stale)
        assert view.node_ids == ("node-a",)
        assert members_of(etcd.url()) == {"node-a": d.data_addr}
        assert members.statistics().etcd_errors >= 1 and members.statistics().resyncs >= 1
    finally:
        members.close()
        d.stop()


@pytest.mark.slow
def test_etcd_back_without_the_lease_the_daemon_re_registers(tmp_path):
    reason = etcd_missing_reason()
    if reason:
        pytest.skip(reason)
    first = EtcdServer(tmp_path / "etcd1")
    d = start_member(tmp_path, first, "node-a", admin="127.0.0.1:0")
    second = None
    try:
        first.kill()
        wait_metric(d.admin_addr, "kvtier_cluster_etcd_errors_total", lambda v: v >= 1)
        second = EtcdServer(tmp_path / "etcd2", client_port=first.client_port)  # etcd's data lost: no lease
        assert wait_metric(d.admin_addr, "kvtier_cluster_re_registrations_total", lambda v: v >= 1) == 1
        assert members_of(second.url()) == {"node-a": d.data_addr}
        assert metric(d.admin_addr, "kvtier_cluster_members_seen") == 1
    finally:
        d.stop()
        first.stop()
        if second is not None:
            second.stop()


@pytest.mark.slow
def test_a_client_view_follows_an_etcd_that_came_back_without_its_data(tmp_path):
    """etcd restarted empty: its revisions start again below the ones the client saw. The view
    takes the members the daemons register anew, follows later joins, and its version grows."""
    import base64
    import json

    reason = etcd_missing_reason()
    if reason:
        pytest.skip(reason)
    first = EtcdServer(tmp_path / "etcd1")
    for i in range(200):  # an etcd that has run a while
        body = json.dumps({"key": base64.b64encode(f"/other/{i}".encode()).decode(), "value": "eA=="}).encode()
        urllib.request.urlopen(urllib.request.Request(f"http://{first.endpoint}/v3/kv/put", data=body), timeout=5)
    a = start_member(tmp_path, first, "node-a")
    members = open_members(first.url())
    second = b = None
    try:
        before, _ = wait_members(members, lambda v: v.node_ids == ("node-a",))
        first.kill()
        wait_members(members, lambda v: v.stale)
        second = EtcdServer(tmp_path / "etcd2", client_port=first.client_port)  # its data lost
        view, _ = wait_members(members, lambda v: not v.stale and v.node_ids == ("node-a",), timeout_s=15)
        b = start_member(tmp_path, second, "node-b")
        later, _ = wait_members(members, lambda v: v.node_ids == ("node-a", "node-b"), timeout_s=10)
        assert before.version < view.version < later.version
    finally:
        members.close()
        for d in (a, b):
            if d is not None:
                d.stop()
        first.stop()
        if second is not None:
            second.stop()


def test_closing_a_view_whose_watch_etcd_never_answers_is_prompt():
    """An etcd (or gateway) that answers reads but hangs on the watch: close() interrupts it."""
    import http.server
    import json
    import threading

    class HangingWatch(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path.endswith("/watch"):
                time.sleep(30)
                return
            body = json.dumps({"header": {"revision": "5"}, "kvs": []}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), HangingWatch)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        members = open_members(f"etcd://127.0.0.1:{server.server_address[1]}/kvtier")
        time.sleep(0.3)  # the watch thread is waiting for etcd's answer
        started = time.monotonic()
        members.close()
        assert time.monotonic() - started < 1.0
        assert not members._thread.is_alive()
    finally:
        server.shutdown()


def test_client_view_watches_joins_and_leaves(etcd, tmp_path):
    members = open_members(etcd.url())
    started = []
    try:
        assert members.current().node_ids == ()
        for name in ("node-c", "node-a", "node-b"):
            started.append(start_member(tmp_path, etcd, name))
        view, _ = wait_members(members, lambda v: len(v) == 3)
        assert view.node_ids == ("node-a", "node-b", "node-c")
        assert dict(zip(view.node_ids, view.addresses)) == {"node-c": started[0].data_addr,
                                                            "node-a": started[1].data_addr,
                                                            "node-b": started[2].data_addr}
        assert started[1].stop() == 0
        view, _ = wait_members(members, lambda v: len(v) == 2)
        assert view.node_ids == ("node-b", "node-c")
        st = members.statistics()
        assert (st.members, st.joins, st.leaves, st.bad_records, st.stale) == (2, 3, 1, 0, False)
    finally:
        members.close()
        for d in started:
            d.stop()


def test_cluster_without_the_cluster_extra_says_which_extra(tmp_path):
    argv = ["--data-dir", str(tmp_path / "d"), *DEFAULT_ARGS, "--admin", "none",
            "--cluster", "etcd://127.0.0.1:2379/kv"]
    code = ("import sys; sys.modules['etcd3gw'] = None;"  # as if the cluster extra were not installed
            f"from kvtier.daemon.main import main; sys.exit(main({argv!r}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    assert "cannot join the cluster at etcd://127.0.0.1:2379/kv" in result.stderr
    assert "pip install 'kvtier[cluster]'" in result.stderr
