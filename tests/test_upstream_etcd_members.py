"""An edge's view of an etcd region (``EtcdTarget``), against a real etcd and a real kvtierd:
members that leave take their pooled connections with them, and a key the edge cannot read
does not stop it following the region."""
from __future__ import annotations

import base64
import json
import time
import urllib.request

from cluster_fixtures import etcd  # noqa: F401
from daemon_proc import start_kvtierd
from kvtier.common.cluster_url import MemberRecord, parse_cluster_url
from kvtier.daemon.upstream import targets


def etcd_call(server, path: str, body: dict) -> None:
    request = urllib.request.Request(f"http://{server.endpoint}/v3{path}", data=json.dumps(body).encode())
    urllib.request.urlopen(request, timeout=5).read()


def put(server, key: bytes, value: bytes) -> None:
    etcd_call(server, "/kv/put", {"key": base64.b64encode(key).decode(), "value": base64.b64encode(value).decode()})


def delete(server, key: bytes) -> None:
    etcd_call(server, "/kv/deleterange", {"key": base64.b64encode(key).decode()})


def record(node: str, address: str) -> bytes:
    return MemberRecord(node_id=node, data=address, admin=None, started_unix_s=time.time()).encode()


def eventually(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def test_members_that_leave_take_their_connections_with_them(etcd, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setattr(targets, "MEMBERS_REFRESH_S", 0.1)
    daemon = start_kvtierd(tmp_path / "region")
    target = targets.EtcdTarget(parse_cluster_url(etcd.url("region")), None, 2.0)
    port = daemon.data_addr.rsplit(":", 1)[1]
    keys = [bytes([i]) * 16 for i in range(8)]
    try:
        for generation in range(4):  # the region's one member restarts under another node id and address
            node = f"node-{generation}"
            put(etcd, f"/region/members/{node}".encode(),
                record(node, f"localhost:{port}" if generation % 2 else daemon.data_addr))
            if generation:
                delete(etcd, f"/region/members/node-{generation - 1}".encode())
            assert eventually(lambda: [n for n, _ in target._members] == [node])
            for client in target.owners_by_rank(keys)[0]:
                assert client.lookup(keys) == 0  # a pooled connection to the member now
        assert set(target._clients) == {address for _, address in target._members}
    finally:
        target.close()
        daemon.stop()


def test_a_member_key_that_is_not_utf8_does_not_stop_the_edge_following_the_region(etcd, monkeypatch):  # noqa: F811
    monkeypatch.setattr(targets, "MEMBERS_REFRESH_S", 0.1)
    target = targets.EtcdTarget(parse_cluster_url(etcd.url("region")), None, 2.0)
    try:
        put(etcd, b"/region/members/node-a", record("node-a", "127.0.0.1:7001"))
        assert eventually(lambda: [n for n, _ in target._members] == ["node-a"])
        put(etcd, b"/region/members/\xff\xfe", b"junk")  # a stray key under the prefix
        put(etcd, b"/region/members/node-b", record("node-b", "127.0.0.1:7002"))
        assert eventually(lambda: [n for n, _ in target._members] == ["node-a", "node-b"])
        assert target._refresher.is_alive()
    finally:
        target.close()
