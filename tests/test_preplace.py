"""Pre-placement end to end: a real region daemon and two real edge daemons.

The region counts the chains it is asked for (LOOKUP/GET) and pushes its hot prefixes to
its edges as soft pins (``POST /v1/preplace/push`` runs the periodic worker's round now;
one test lets the worker run by itself). The edges need a token; the region has it in
``--preplace-token-file``."""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from daemon_proc import start_kvtierd
from ports import free_port
from kvtier.client.block_client import BlockClient
from kvtier.common.blockformat import encode_block, payload_of
from kvtier.common.codec_ids import codec_id
from kvtier.common.keys import KVLayout, Namespace
from kvtier.daemon.preplace.pusher import PrePlacer
from kvtier.daemon.preplace.settings import PreplaceSettings
from kvtier.tools.admin_client import AdminClient, AdminError

EDGE_TOKEN = "edge-secret"
PAYLOAD_BYTES = 16 << 10
BLOCK_TOKENS = 16
LAYOUT = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 64, "dtype": "float16", "block_tokens": BLOCK_TOKENS}
NS_SPEC = {"model": "preplace-test", "layout": LAYOUT}
NS = Namespace("preplace-test", KVLayout(**LAYOUT))
BLOCK_BYTES = 64 + PAYLOAD_BYTES
WAIT_S = 20.0  # the periodic worker's first rounds, on a loaded machine
POLL_S = 0.1


def chain(first_token: int, blocks: int) -> tuple[list[int], list[bytes]]:
    tokens = list(range(first_token, first_token + blocks * BLOCK_TOKENS))
    return tokens, NS.keys(tokens)


def store(daemon, keys: list[bytes], token=None) -> dict[bytes, bytes]:
    blocks = {k: encode_block(k, NS.id, codec_id("raw"), os.urandom(PAYLOAD_BYTES)) for k in keys}
    with BlockClient(daemon.data_addr, token) as c:
        c.put_many(list(blocks.items()), ns_id=NS.id)
    return blocks


def ask(daemon, keys: list[bytes], times: int) -> None:
    with BlockClient(daemon.data_addr) as c:
        for _ in range(times):
            assert c.lookup(keys, NS.id) == len(keys)


def soft_pinned(edge, keys: list[bytes]) -> list[bool]:
    admin = AdminClient(edge.admin_addr, EDGE_TOKEN)
    out = []
    for k in keys:
        info = admin.block_info(k)
        out.append(bool(info and info["soft_pinned"]))
    return out


def held(edge, blocks: dict[bytes, bytes]) -> bool:
    """The edge holds every block, its payload byte for byte (each daemon stamps its own seq)."""
    with BlockClient(edge.data_addr, EDGE_TOKEN) as c:
        got = c.get_many(list(blocks))
    return all(b is not None and bytes(payload_of(b)) == bytes(payload_of(want))
               for b, want in zip(got, blocks.values()))


def metric(admin_addr: str, name: str, labels: str = "", token=None) -> float | None:
    text = AdminClient(admin_addr, token).request("GET", "/metrics", expect_json=False).decode()
    wanted = f"{name}{labels} "
    for line in text.splitlines():
        if line.startswith(wanted):
            return float(line[len(wanted):])
    return None


def push(region) -> dict:
    return AdminClient(region.admin_addr).request("POST", "/v1/preplace/push", {})


@pytest.fixture
def edges(tmp_path):
    token_file = tmp_path / "edge-token"
    token_file.write_text(EDGE_TOKEN + "\n")
    started = [start_kvtierd(tmp_path / name, "--token-file", str(token_file), admin="127.0.0.1:0")
               for name in ("edge-a", "edge-b")]
    yield started
    for edge in started:
        if edge.alive():
            assert edge.stop() == 0, edge.log_tail()


def start_region(tmp_path, edges, *extra, token: str = EDGE_TOKEN, name: str = "region"):
    token_file = tmp_path / f"{name}-edge-token"
    token_file.write_text(token + "\n")
    args = ["--preplace-edges", ",".join(e.data_addr for e in edges), "--preplace-token-file", str(token_file),
            "--preplace-interval-s", "3600", *extra]
    return start_kvtierd(tmp_path / name, *args, admin="127.0.0.1:0")


@pytest.fixture
def region_factory(tmp_path):
    started = []

    def make(edges, *extra, **kw):
        started.append(start_region(tmp_path, edges, *extra, **kw))
        return started[-1]

    yield make
    for region in started:
        if region.alive():
            assert region.stop() == 0, region.log_tail()


def test_hot_prefixes_end_up_soft_pinned_on_both_edges_and_expire(edges, region_factory):
    ttl_s = 5.0  # the checks after a push finish well within it on a loaded machine
    region = region_factory(edges, "--preplace-ttl-s", str(ttl_s))
    _, hot = chain(0, 6)
    _, warm = chain(10_000, 3)
    blocks = store(region, hot + warm)
    ask(region, hot, 3)
    ask(region, warm, 1)

    report = push(region)
    assert [e["ok"] for e in report["edges"]] == [True, True], report
    assert report["prefixes"] == 2 and report["planned_bytes"] == 9 * BLOCK_BYTES
    for edge in edges:
        assert soft_pinned(edge, hot + warm) == [True] * 9
        assert held(edge, blocks)
        assert metric(edge.admin_addr, "kvtier_soft_pinned_bytes", token=EDGE_TOKEN) == 9 * BLOCK_BYTES
    for edge in edges:
        label = f'{{edge="{edge.data_addr}"}}'
        assert metric(region.admin_addr, "kvtier_preplaced_bytes_total", label) == 9 * BLOCK_BYTES
        assert metric(region.admin_addr, "kvtier_preplace_soft_pinned_bytes", label) == 9 * BLOCK_BYTES
        assert metric(region.admin_addr, "kvtier_preplace_pushes_total", label) == 1
        assert metric(region.admin_addr, "kvtier_preplace_failures_total", label) == 0
    stats = AdminClient(region.admin_addr).stats()["preplace"]
    assert stats["rounds"] == 1 and stats["heads_tracked"] == 2 and stats["observations"] == 4

    time.sleep(ttl_s + 0.5)  # the soft pins run out at the edges by themselves
    for edge in edges:
        assert soft_pinned(edge, hot + warm) == [False] * 9
        assert held(edge, blocks)  # unpinned, not dropped
        assert metric(edge.admin_addr, "kvtier_soft_pinned_bytes", token=EDGE_TOKEN) == 0
    assert metric(region.admin_addr, "kvtier_preplace_soft_pinned_bytes", f'{{edge="{edges[0].data_addr}"}}') == 0

    report = push(region)  # the edges hold the blocks: only the pins are renewed
    assert [(e["ok"], e["blocks_put"], e["blocks_pinned"]) for e in report["edges"]] == [(True, 0, 9)] * 2
    for edge in edges:
        assert soft_pinned(edge, hot + warm) == [True] * 9


def test_the_periodic_worker_pushes_by_itself(edges, region_factory):
    region = region_factory(edges[:1], "--preplace-interval-s", "0.2")
    _, keys = chain(20_000, 2)
    blocks = store(region, keys)
    with BlockClient(region.data_addr) as c:  # GETs count too
        assert all(b is not None for b in c.get_many(keys, NS.id))
    deadline = time.monotonic() + WAIT_S
    while soft_pinned(edges[0], keys) != [True, True]:
        assert time.monotonic() < deadline, f"never pre-placed; region log:\n{region.log_tail()}"
        time.sleep(POLL_S)
    assert held(edges[0], blocks)


def test_budget_is_respected_in_rank_order_and_counts_what_the_edge_still_holds(edges, region_factory):
    region = region_factory(edges, "--preplace-bytes", str(5 * BLOCK_BYTES))
    _, first = chain(30_000, 3)
    _, second = chain(40_000, 3)
    _, third = chain(50_000, 2)
    store(region, first + second + third)
    ask(region, first, 3)
    ask(region, second, 2)
    ask(region, third, 1)
    report = push(region)
    assert [(e["blocks_put"], e["bytes_put"]) for e in report["edges"]] == [(5, 5 * BLOCK_BYTES)] * 2
    for edge in edges:  # the most popular first; the second cut where the budget ends; the third not at all
        assert soft_pinned(edge, first + second + third) == [True] * 5 + [False] * 3
        assert metric(edge.admin_addr, "kvtier_soft_pinned_bytes", token=EDGE_TOKEN) == 5 * BLOCK_BYTES

    ask(region, third, 10)  # the third is now the hottest: but the edges still hold 5 blocks for us
    report = push(region)
    assert [e["blocks_put"] for e in report["edges"]] == [0, 0]
    for edge in edges:
        assert metric(edge.admin_addr, "kvtier_soft_pinned_bytes", token=EDGE_TOKEN) == 5 * BLOCK_BYTES
        assert metric(region.admin_addr, "kvtier_preplace_soft_pinned_bytes",
                      f'{{edge="{edge.data_addr}"}}') == 5 * BLOCK_BYTES


def test_admin_api_and_cli_pin_a_prefix_on_one_chosen_edge_and_on_all(edges, region_factory, tmp_path):
    region = region_factory(edges)
    tokens, keys = chain(60_000, 4)
    blocks = store(region, keys)
    admin = AdminClient(region.admin_addr)
    a, b = edges

    doc = admin.request("POST", "/v1/preplace", {"namespace": NS_SPEC, "tokens": tokens,
                                                 "edges": [a.data_addr], "ttl_s": 600})
    assert doc["held_blocks"] == 4 and doc["missing"] == [] and doc["ttl_s"] == 600
    assert [(e["edge"], e["ok"], e["blocks_put"], e["blocks_pinned"]) for e in doc["edges"]] == \
        [(a.data_addr, True, 4, 4)]
    assert soft_pinned(a, keys) == [True] * 4 and held(a, blocks)
    with BlockClient(b.data_addr, EDGE_TOKEN) as c:
        assert c.lookup(keys) == 0  # the other edge got nothing

    ns_file = tmp_path / "ns.json"
    ns_file.write_text(json.dumps(NS_SPEC))
    cli = subprocess.run([sys.executable, "-m", "kvtier.tools.admin_cli", "--admin", region.admin_addr, "preplace",
                          "--namespace", str(ns_file), "--tokens", ",".join(map(str, tokens)), "--ttl-s", "600"],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert "4 of 4 blocks held at the region" in cli.stdout
    for edge in edges:
        assert soft_pinned(edge, keys) == [True] * 4 and held(edge, blocks)
    assert metric(region.admin_addr, "kvtier_preplace_admin_requests_total") == 2

    _, absent = chain(70_000, 2)  # by keys; the region holds the first two of the four
    cli = subprocess.run([sys.executable, "-m", "kvtier.tools.admin_cli", "--admin", region.admin_addr, "--json",
                          "preplace", *[k.hex() for k in keys[:2] + absent], "--edge", b.data_addr],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 1, cli.stderr  # part of the prefix is not at the region
    doc = json.loads(cli.stdout)
    assert doc["held_blocks"] == 2 and doc["missing"] == [k.hex() for k in absent]
    assert [(e["edge"], e["ok"], e["blocks_put"]) for e in doc["edges"]] == [(b.data_addr, True, 0)]


def test_bad_preplace_requests_are_refused_naming_the_problem(edges, region_factory, tmp_path):
    region = region_factory(edges)
    admin = AdminClient(region.admin_addr)
    _, keys = chain(80_000, 1)
    cases = [({"keys": [keys[0].hex()], "edges": ["127.0.0.1:1"]}, 400, "unknown edge '127.0.0.1:1'"),
             ({"keys": [keys[0].hex()], "edges": []}, 400, "empty list"),
             ({"keys": [keys[0].hex()], "ttl_s": -1}, 422, "ttl_s"),
             ({"keys": ["zz"]}, 422, "keys.0"),
             ({"keys": [keys[0].hex()], "namespace": NS_SPEC, "tokens": [1]}, 422, "either 'keys' or 'namespace'")]
    for body, status, message in cases:
        with pytest.raises(AdminError) as err:
            admin.request("POST", "/v1/preplace", body)
        assert err.value.status == status and message in err.value.message, (body, err.value.message)
    assert metric(region.admin_addr, "kvtier_preplace_admin_requests_total") == 0  # none of them pushed
    assert admin.healthz()["status"] == "ok"

    plain = start_kvtierd(tmp_path / "plain", admin="127.0.0.1:0")  # no --preplace-edges
    try:
        with pytest.raises(AdminError) as err:
            AdminClient(plain.admin_addr).request("POST", "/v1/preplace", {"keys": [keys[0].hex()]})
        assert err.value.status == 404 and "--preplace-edges" in err.value.message
    finally:
        assert plain.stop() == 0


def test_an_edge_that_is_down_is_skipped_and_counted(edges, region_factory):
    region = region_factory(edges)
    a, b = edges
    _, keys = chain(90_000, 3)
    blocks = store(region, keys)
    ask(region, keys, 2)
    b.kill()
    report = push(region)
    outcomes = {e["edge"]: e for e in report["edges"]}
    assert outcomes[a.data_addr]["ok"] and outcomes[a.data_addr]["blocks_pinned"] == 3
    assert not outcomes[b.data_addr]["ok"] and b.data_addr in outcomes[b.data_addr]["error"]
    assert soft_pinned(a, keys) == [True] * 3 and held(a, blocks)
    assert metric(region.admin_addr, "kvtier_preplace_failures_total", f'{{edge="{b.data_addr}"}}') == 1
    assert metric(region.admin_addr, "kvtier_preplace_failures_total", f'{{edge="{a.data_addr}"}}') == 0
    assert metric(region.admin_addr, "kvtier_preplaced_bytes_total", f'{{edge="{b.data_addr}"}}') == 0
    stats = AdminClient(region.admin_addr).request("GET", "/v1/preplace")["statistics"]
    assert "cannot connect" in stats["edges"][b.data_addr]["last_error"]


def test_a_wrong_token_fails_the_push_and_stores_nothing(edges, region_factory):
    region = region_factory(edges, token="not-the-edge-token")
    _, keys = chain(100_000, 2)
    store(region, keys)
    ask(region, keys, 1)
    report = push(region)
    assert [e["ok"] for e in report["edges"]] == [False, False]
    assert all("wrong token" in e["error"] for e in report["edges"]), report
    for edge in edges:
        with BlockClient(edge.data_addr, EDGE_TOKEN) as c:
            assert c.lookup(keys) == 0
        assert metric(region.admin_addr, "kvtier_preplace_failures_total", f'{{edge="{edge.data_addr}"}}') == 1


def test_an_edge_past_its_pin_limit_refuses_the_pins_and_is_counted(tmp_path, region_factory):
    token_file = tmp_path / "edge-token"
    token_file.write_text(EDGE_TOKEN)
    tight = start_kvtierd(tmp_path / "tight-edge", "--token-file", str(token_file), "--pinned-fraction-max", "0",
                          admin="127.0.0.1:0")
    try:
        region = region_factory([tight])
        _, keys = chain(110_000, 2)
        blocks = store(region, keys)
        ask(region, keys, 1)
        (outcome,) = push(region)["edges"]
        assert not outcome["ok"] and "NO_SPACE" in outcome["error"], outcome
        assert outcome["blocks_put"] == 2  # the blocks reached the edge; their pins did not
        assert held(tight, blocks) and soft_pinned(tight, keys) == [False, False]
        label = f'{{edge="{tight.data_addr}"}}'
        assert metric(region.admin_addr, "kvtier_preplace_failures_total", label) == 1
        assert metric(region.admin_addr, "kvtier_preplaced_bytes_total", label) == 2 * BLOCK_BYTES
        assert metric(region.admin_addr, "kvtier_preplace_soft_pinned_bytes", label) == 0
    finally:
        assert tight.stop() == 0


def test_cli_push_and_status(edges, region_factory):
    region = region_factory(edges, "--preplace-bytes", "1m")
    _, keys = chain(120_000, 2)
    store(region, keys)
    ask(region, keys, 1)
    base = [sys.executable, "-m", "kvtier.tools.admin_cli", "--admin", region.admin_addr]
    cli = subprocess.run(base + ["preplace", "--push"], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.startswith("pushed 1 prefixes") and f"{edges[1].data_addr}: put 2 blocks" in cli.stdout
    cli = subprocess.run(base + ["--json", "preplace", "--status"], capture_output=True, text=True, timeout=60)
    doc = json.loads(cli.stdout)
    assert [e["address"] for e in doc["edges"]] == [e.data_addr for e in edges]
    assert doc["settings"]["budget_bytes"] == 1 << 20 and doc["settings"]["token"] == "<set>"
    assert doc["statistics"]["edges"][edges[0].data_addr]["soft_pinned_bytes"] == 2 * BLOCK_BYTES
    cli = subprocess.run(base + ["preplace", "--push", "--edge", "x"], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 2 and "--status and --push take no prefix" in cli.stderr


def test_an_edge_answers_the_pushers_lookup_itself_never_asking_its_upstream_region(tmp_path, region_factory):
    """The edge pulls through from the region: what it lacks of a pushed prefix, asked of the
    region, would count there as a request nobody made (its tail as a chain of its own)."""
    token_file = tmp_path / "edge-token"
    token_file.write_text(EDGE_TOKEN)
    port = free_port()
    edge = start_kvtierd(tmp_path / "pulling-edge", "--token-file", str(token_file),
                         "--upstream", f"127.0.0.1:{port}", admin="127.0.0.1:0")
    try:
        region = region_factory([edge], "--listen", f"127.0.0.1:{port}")
        _, keys = chain(130_000, 5)
        blocks = store(region, keys)
        with BlockClient(edge.data_addr, EDGE_TOKEN) as c:  # the edge holds the first two already
            c.put_many([(key, blocks[key]) for key in keys[:2]], ns_id=NS.id)
        ask(region, keys, 1)
        assert [(e["ok"], e["blocks_put"], e["blocks_pinned"]) for e in push(region)["edges"]] == [(True, 3, 5)]
        assert held(edge, blocks) and soft_pinned(edge, keys) == [True] * 5
        assert AdminClient(region.admin_addr).stats()["preplace"]["observations"] == 1
        assert AdminClient(edge.admin_addr, EDGE_TOKEN).stats()["upstream"]["requests"] == 0
        push(region)
        stats = AdminClient(region.admin_addr).stats()["preplace"]
        assert (stats["observations"], stats["heads_tracked"]) == (1, 1)
    finally:
        assert edge.stop() == 0, edge.log_tail()


class LosingEngine:
    """The region's engine as the pusher uses it: its index still lists ``lost``, a read finds it gone."""

    def __init__(self, blocks: dict[bytes, bytes], lost: bytes):
        self._blocks, self._lost = blocks, lost

    def locate_buffer(self, keys_buf) -> np.ndarray:
        keys = [bytes(keys_buf[i:i + 16]) for i in range(0, len(keys_buf), 16)]
        rows = np.zeros(len(keys), [("found", bool), ("length", np.int64)])
        rows["found"] = [k in self._blocks for k in keys]
        rows["length"] = [len(self._blocks.get(k, b"")) for k in keys]
        return rows

    def get_many(self, keys):
        return [None if k == self._lost else self._blocks.get(bytes(k)) for k in keys]


def test_a_block_gone_from_the_region_mid_push_ends_the_prefix_there(edges):
    _, keys = chain(140_000, 5)
    blocks = {k: encode_block(k, NS.id, codec_id("raw"), os.urandom(PAYLOAD_BYTES)) for k in keys}
    placer = PrePlacer(LosingEngine(blocks, lost=keys[2]), PreplaceSettings(edges[0].data_addr, token=EDGE_TOKEN))
    held_here, (outcome,) = placer.place(keys, NS.id, [edges[0].data_addr])
    assert held_here == 5  # the index had all five when the plan was made
    assert (outcome.ok, outcome.blocks_put, outcome.blocks_pinned) == (True, 2, 2)  # behind the gap: no prefix
    assert soft_pinned(edges[0], keys) == [True, True, False, False, False]
    with BlockClient(edges[0].data_addr, EDGE_TOKEN) as c:
        assert [b is not None for b in c.get_many(keys, NS.id)] == [True, True, False, False, False]
    assert placer.statistics().edges[edges[0].data_addr].soft_pinned_blocks == 2
