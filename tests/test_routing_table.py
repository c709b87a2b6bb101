"""The router's pure parts: the routing table (sequence checks, longest prefix), route
request parsing and the accuracy rule."""
from __future__ import annotations

import pytest

from kvtier.common.keys import KVLayout, Namespace, chain_keys
from kvtier.daemon.events import kv_event_format as fmt
from kvtier.tools.router.accuracy import AccuracyProbe, is_accurate
from kvtier.tools.router.route_requests import RouteRequestError, route_keys
from kvtier.tools.router.routing_table import ApplyOutcome, PrefixAnswer, RoutingTable

NS = Namespace("m", KVLayout(2, 2, 8, block_tokens=4))
CHAIN = NS.keys(list(range(40)))  # 10 keys


def batch(*events) -> fmt.KVEventBatch:
    return fmt.KVEventBatch(ts=0.0, events=list(events))


def test_longest_prefix_is_the_deepest_key_every_chosen_node_holds():
    table = RoutingTable()
    table.load_snapshot("a", 10, CHAIN[:3])
    table.load_snapshot("b", 20, CHAIN[:6])
    table.load_snapshot("c", 30, CHAIN[1:9])  # lacks the first key: holds no prefix
    assert table.longest_prefix(CHAIN) == PrefixAnswer(6, ("b",))
    assert table.longest_prefix(CHAIN[:2]) == PrefixAnswer(2, ("a", "b"))
    assert table.longest_prefix(NS.keys(list(range(100, 140)))) == PrefixAnswer(0, ())
    assert table.longest_prefix([]) == PrefixAnswer(0, ())


def test_batches_apply_in_order_stale_ones_are_skipped_and_gaps_reported():
    table = RoutingTable()
    assert table.apply("a", 1, batch(fmt.stored(CHAIN[:1]))) is ApplyOutcome.GAP  # never synced
    table.load_snapshot("a", 5, [])
    assert table.apply("a", 6, batch(fmt.stored(CHAIN[:4]))) is ApplyOutcome.APPLIED
    assert table.apply("a", 6, batch(fmt.stored(CHAIN[:8]))) is ApplyOutcome.STALE
    assert table.apply("a", 7, batch(fmt.removed([CHAIN[2]]), fmt.stored([CHAIN[9]]))) is ApplyOutcome.APPLIED
    assert table.longest_prefix(CHAIN) == PrefixAnswer(2, ("a",))
    assert table.apply("a", 9, batch(fmt.stored(CHAIN))) is ApplyOutcome.GAP
    assert table.node_keys("a") == {CHAIN[0], CHAIN[1], CHAIN[3], CHAIN[9]}  # a gap changes nothing
    stats = table.statistics()
    assert (stats.batches_applied, stats.batches_stale, stats.gaps) == (2, 1, 2)
    assert not stats.nodes["a"].synced and stats.nodes["a"].seq == 7
    table.load_snapshot("a", 9, CHAIN[:1])
    assert table.node_keys("a") == {CHAIN[0]} and table.statistics().keys == 1
    assert table.apply("a", 10, batch(fmt.AllBlocksCleared())) is ApplyOutcome.APPLIED
    assert table.node_keys("a") == set() and table.statistics().keys == 0


def test_a_down_node_is_left_out_until_its_next_snapshot():
    table = RoutingTable()
    table.load_snapshot("a", 1, CHAIN)
    table.load_snapshot("b", 1, CHAIN[:2])
    table.set_down("a")
    assert table.longest_prefix(CHAIN) == PrefixAnswer(2, ("b",))
    assert table.wait_synced_to("a", 1, timeout_s=0.01) is False
    table.load_snapshot("a", 50, CHAIN[:5])
    assert table.longest_prefix(CHAIN) == PrefixAnswer(5, ("a",))
    assert table.wait_synced_to("a", 50, timeout_s=0.01) is True


def test_route_requests_take_keys_namespace_fields_or_ns_id_and_name_bad_input():
    tokens = list(range(40))
    doc_ns = {"model": "m", "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_tokens": 4}}
    assert route_keys({"keys": [k.hex() for k in CHAIN]}) == CHAIN
    assert route_keys({"namespace": doc_ns, "tokens": tokens}) == CHAIN
    assert route_keys({"ns_id": NS.id.hex(), "block_tokens": 4, "tokens": tokens}) == chain_keys(NS.id, tokens, 4)
    for bad, match in [([], "JSON object"), ({}, "give 'keys'"), ({"keys": ["zz"]}, "hex digits"),
                       ({"keys": [1]}, "hex digits"), ({"keys": [], "tokens": []}, "unknown fields"),
                       ({"namespace": {"model": "m"}, "tokens": tokens}, "namespace:"),
                       ({"namespace": doc_ns, "tokens": ["a"]}, "integers"),
                       ({"namespace": doc_ns, "tokens": [-1]}, r"\[0, 2\*\*32\)"),
                       ({"ns_id": NS.id.hex(), "tokens": tokens}, "block_tokens"),
                       ({"ns_id": "00", "block_tokens": 4, "tokens": tokens}, "hex digits")]:
        with pytest.raises(RouteRequestError, match=match):
            route_keys(bad)


def test_an_answer_is_accurate_when_its_node_holds_the_longest_prefix_any_node_holds():
    assert is_accurate("a", {"a": 3, "b": 3, "c": 1})
    assert not is_accurate("c", {"a": 3, "b": 3, "c": 1})
    assert is_accurate(None, {"a": 0, "b": 0}) and not is_accurate(None, {"a": 0, "b": 2})
    assert not is_accurate("a", {"b": 1})


def test_the_probe_samples_answers_and_counts_unreachable_nodes_as_holding_nothing():
    held = {"a": {CHAIN[0]}, "b": set()}

    def lookup(node, keys):
        if node == "down":
            raise OSError("connection refused")
        return next(
            (i for i, k in enumerate(keys) if k not in held[node]), len(keys))

    probe = AccuracyProbe(["a", "b", "down"], lookup, fraction=1.0)
    try:
        assert probe.probe(CHAIN, "a") is True
        assert probe.probe(CHAIN, "b") is False
        assert probe.probe(CHAIN, None) is False
        stats = probe.statistics()
        assert (stats.probed, stats.accurate, stats.probe_errors) == (3, 1, 3) and stats.accuracy == 1 / 3
    finally:
        probe.stop()
    with pytest.raises(ValueError, match="fraction"):
        AccuracyProbe(["a"], lookup, fraction=2.0)
