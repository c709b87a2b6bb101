"""kvtier-router against real kvtierd processes over real ZMQ and HTTP on 127.0.0.1: routes
from the events, resynchronization after missed events (disconnect, a gap, a restart), the
accuracy probe, bad requests, and the client's EdgePicker with the router up and down."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
import zmq

from kvtier.client import BlockClient, EdgePicker
from kvtier.common.blockformat import encode_block
from kvtier.common.keys import KVLayout, Namespace
from kvtier.daemon.events.snapshot import snapshot_from_document
from kvtier.tools.router.cli import start_router
from kvtier.tools.router.node_sources import REPLAY_TIMEOUT_S, NodeSpec
from kvtier.tools.router.subscriber import EventSubscriber

from kv_events_fixtures import admin_get, start_events_daemon

NS = Namespace("router-test", KVLayout(2, 2, 8, block_tokens=4))
TOKENS = list(range(4 * 12))
CHAIN = NS.keys(TOKENS)  # 12 keys
SYNC_TIMEOUT_S = 30.0


def put(daemon, keys) -> None:
    with BlockClient(daemon.data_addr) as client:
        client.put_many([(k, encode_block(k, NS.id, 1, b"x" * 512)) for k in keys])


def delete(daemon, keys) -> None:
    with BlockClient(daemon.data_addr) as client:
        client.delete_many(list(keys))


def seq_last(daemon) -> int:
    return admin_get(daemon, "/v1/kv-events")["seq_last"]


def true_keys(daemon) -> set[bytes]:
    return set(snapshot_from_document(admin_get(daemon, "/v1/kv-events/snapshot")).keys())


def spec(node_id: str, daemon) -> NodeSpec:
    return NodeSpec(node_id, daemon.events_endpoint, f"http://{daemon.admin_addr}", daemon.replay_endpoint,
                    daemon.data_addr)


def post_route(address, doc) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{address[0]}:{address[1]}/v1/route", data=json.dumps(doc).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture
def nodes(tmp_path):
    a = start_events_daemon(tmp_path / "a")
    try:
        b = start_events_daemon(tmp_path / "b", replay=False)
    except BaseException:
        a.kill()  # not left running when the second one fails to start
        raise
    yield {"a": a, "b": b}
    for d in (a, b):
        if d.alive():
            assert d.stop() == 0, d.log_tail()


@pytest.fixture
def router(nodes):
    server, subscriber, probe, lookups = start_router([spec(n, d) for n, d in nodes.items()], "127.0.0.1", 0,
                                                      None, probe_fraction=1.0)
    yield server, subscriber
    server.stop()
    subscriber.stop()
    probe.stop()
    lookups.close()


def wait_synced(table, nodes, *names) -> None:
    for name in names:
        assert table.wait_synced_to(name, seq_last(nodes[name]), SYNC_TIMEOUT_S), table.statistics()


def test_routes_follow_the_events_and_answer_bad_requests_with_400(nodes, router):
    server, subscriber = router
    table = server.router.table
    put(nodes["a"], CHAIN[:3])
    put(nodes["b"], CHAIN[:6])
    wait_synced(table, nodes, "a", "b")
    status, answer = post_route(server.address, {"keys": [k.hex() for k in CHAIN]})
    assert status == 200
    assert answer == {"node": "b", "data": nodes["b"].data_addr, "prefix_blocks": 6, "blocks": 12,
                      "nodes": [{"node": "b", "data": nodes["b"].data_addr}]}
    status, answer = post_route(server.address, {"ns_id": NS.id.hex(), "block_tokens": 4, "tokens": TOKENS[:8]})
    assert (status, answer["prefix_blocks"], [n["node"] for n in answer["nodes"]]) == (200, 2, ["a", "b"])
    server.router.probe.wait_drained()  # the probes LOOKUP the nodes after the answer: before the delete
    delete(nodes["b"], CHAIN[1:2])
    wait_synced(table, nodes, "b")
    assert post_route(server.address, {"keys": [k.hex() for k in CHAIN]})[1]["node"] == "a"
    for bad in ({"keys": ["nothex"]}, {"tokens": [1]}, ["not", "an", "object"]):
        status, answer = post_route(server.address, bad)
        assert status == 400 and answer["error"]
    request = urllib.request.Request(f"http://{server.address[0]}:{server.address[1]}/v1/route", data=b"{not json")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert info.value.code == 400 and b"not JSON" in info.value.read()
    assert post_route(server.address, {"keys": [CHAIN[0].hex()]})[0] == 200  # serves on
    probe = server.router.probe
    probe.wait_drained()
    stats = probe.statistics()
    assert stats.probed >= 4 and stats.accuracy == 1.0, stats
    with urllib.request.urlopen(f"http://{server.address[0]}:{server.address[1]}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    assert "kvtier_router_accuracy_ratio 1.0" in text and 'kvtier_router_node_up{node="a"} 1' in text


def test_a_subscriber_that_missed_events_resyncs_from_the_snapshot(nodes, router):
    server, subscriber = router
    table = server.router.table
    put(nodes["a"], CHAIN[:4])
    wait_synced(table, nodes, "a", "b")
    subscriber.stop()  # disconnected: everything from here is missed
    delete(nodes["a"], CHAIN[2:3])
    put(nodes["a"], CHAIN[6:9])
    put(nodes["b"], CHAIN[:5])
    assert table.node_keys("a") == set(CHAIN[:4])  # stale
    again = EventSubscriber(table, [spec(n, d) for n, d in nodes.items()])
    again.start()
    try:
        wait_synced(table, nodes, "a", "b")
        expected_a = set(CHAIN[:2]) | {CHAIN[3]} | set(CHAIN[6:9])
        assert table.node_keys("a") == expected_a == true_keys(nodes["a"])
        assert table.node_keys("b") == set(CHAIN[:5]) == true_keys(nodes["b"])
        assert again.statistics()["snapshots"] == 2
        # a gap while connected: the table is put back three batches; the next batch shows the
        # gap and the replay socket fills it
        seq = table.node_seq("a")
        before = true_keys(nodes["a"])
        table.load_snapshot("a", seq - 3, before - set(CHAIN[6:9]))
        put(nodes["a"], CHAIN[9:10])
        wait_synced(table, nodes, "a")
        assert table.node_keys("a") == before | {CHAIN[9]} == true_keys(nodes["a"])
        assert again.statistics()["replays"] >= 1
    finally:
        again.stop()


def test_a_restarted_node_goes_down_and_comes_back_from_its_snapshot(nodes, router):
    server, subscriber = router
    table = server.router.table
    put(nodes["a"], CHAIN[:2])
    put(nodes["b"], CHAIN[:8])
    wait_synced(table, nodes, "a", "b")
    old_seq = table.node_seq("b")
    nodes["b"].restart()
    wait_synced(table, nodes, "b")
    assert table.node_seq("b") > old_seq  # a new run numbers past the old one
    assert table.node_keys("b") == true_keys(nodes["b"])
    assert set(CHAIN[:8]) <= table.node_keys("b")  # recovered from flash, so in the snapshot
    assert server.router.route(CHAIN).node == "b"
    assert subscriber.statistics()["disconnects"] >= 1


def test_edge_picker_asks_the_router_and_falls_back_to_rendezvous_when_it_is_down(nodes, router):
    server, subscriber = router
    put(nodes["a"], CHAIN[:7])
    wait_synced(server.router.table, nodes, "a", "b")
    edges = [nodes["a"].data_addr, nodes["b"].data_addr]
    picker = EdgePicker(edges, router_url=f"http://{server.address[0]}:{server.address[1]}", timeout_s=5.0)
    choice = picker.pick_for_tokens(NS, TOKENS)
    assert (choice.address, choice.prefix_blocks, choice.source) == (nodes["a"].data_addr, 7, "router")
    new_prefix = picker.pick_for_tokens(NS, list(range(1000, 1040)))  # held nowhere: rendezvous
    assert new_prefix.source == "rendezvous" and new_prefix.address in edges
    server.stop()
    fallback = picker.pick_for_tokens(NS, TOKENS)
    assert fallback.source == "rendezvous" and fallback.address in edges
    picker.pick_for_tokens(NS, TOKENS)  # within retry_after_s: the router is not asked
    stats = picker.statistics()
    assert (stats.router_picks, stats.rendezvous_picks, stats.router_failures) == (1, 3, 1)


@pytest.mark.parametrize("reply", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{\"seq\": 1",  # cut short
    b"KVTIER\x00\x01 not http at all\r\n\r\n",  # admin= pointed at another port
], ids=["truncated-body", "not-http"])
def test_a_node_whose_snapshot_reply_is_broken_does_not_stop_the_router_following_the_others(nodes, reply):
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)

    def answer_every_connection():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(reply)
    threading.Thread(target=answer_every_connection, daemon=True).start()
    broken = NodeSpec("broken", nodes["b"].events_endpoint, f"http://127.0.0.1:{listener.getsockname()[1]}")
    server, subscriber, _, lookups = start_router([spec("a", nodes["a"]), broken], "127.0.0.1", 0, None,
                                                  probe_fraction=0.0)  # no accuracy probe
    try:
        table = server.router.table
        wait_synced(table, nodes, "a")
        put(nodes["a"], CHAIN[:4])
        wait_synced(table, nodes, "a")
        assert table.node_keys("a") >= set(CHAIN[:4])
        assert subscriber._thread.is_alive() and subscriber.statistics()["snapshot_failures"] >= 1
    finally:
        listener.close()
        server.stop()
        subscriber.stop()
        lookups.close()


def test_a_node_whose_admin_api_hangs_does_not_hold_up_the_others_events(nodes):
    import socket

    listener = socket.socket()  # accepts, and never answers: an admin API that is stuck
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    stuck = NodeSpec("stuck", nodes["b"].events_endpoint, f"http://127.0.0.1:{listener.getsockname()[1]}")
    server, subscriber, _, lookups = start_router([spec("a", nodes["a"]), stuck], "127.0.0.1", 0, None,
                                                  probe_fraction=0.0)
    try:
        table = server.router.table
        waits = []
        for i in range(4):  # over several of stuck's snapshot retries (each waits 10 s for an answer)
            started = time.monotonic()
            put(nodes["a"], CHAIN[i:i + 1])
            assert table.wait_synced_to("a", seq_last(nodes["a"]), SYNC_TIMEOUT_S)
            waits.append(time.monotonic() - started)
            time.sleep(0.7)
        assert max(waits) < 3.0, waits  # a's events were never held behind stuck's fetch
        assert set(CHAIN[:4]) <= table.node_keys("a")
    finally:
        listener.close()
        server.stop()
        subscriber.stop()
        lookups.close()


def test_a_node_whose_replay_socket_hangs_does_not_hold_up_the_others_events(nodes):
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # takes replay requests, and never answers
    silent.setsockopt(zmq.LINGER, 0)
    replay_port = silent.bind_to_random_port("tcp://127.0.0.1")
    b = nodes["b"]
    stuck = NodeSpec("stuck", b.events_endpoint, f"http://{b.admin_addr}", f"tcp://127.0.0.1:{replay_port}")
    server, subscriber, _, lookups = start_router([spec("a", nodes["a"]), stuck], "127.0.0.1", 0, None,
                                                  probe_fraction=0.0)
    try:
        table = server.router.table
        put(b, CHAIN[:3])
        wait_synced(table, {"a": nodes["a"], "stuck": b}, "a", "stuck")
        table.load_snapshot("stuck", table.node_seq("stuck") - 2, set(CHAIN[:1]))  # as if two batches were missed
        put(b, CHAIN[3:4])  # shows stuck's gap: a replay is asked for, and never answered
        time.sleep(0.2)
        started = time.monotonic()
        put(nodes["a"], CHAIN[:1])
        assert table.wait_synced_to("a", seq_last(nodes["a"]), SYNC_TIMEOUT_S)
        waited_s = time.monotonic() - started
        assert waited_s < REPLAY_TIMEOUT_S / 2, f"a's batch waited {waited_s:.2f} s behind stuck's replay"
        wait_synced(table, {"stuck": b}, "stuck")  # the replay timed out: the snapshot closed the gap
        assert table.node_keys("stuck") == set(CHAIN[:4]) == true_keys(b)
        assert subscriber.statistics()["replay_failures"] >= 1
    finally:
        server.stop()
        subscriber.stop()
        lookups.close()
        silent.close(linger=0)
        ctx.term()
