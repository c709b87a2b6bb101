"""perf/bench_cdn.py at a tiny scale, on real kvtierd processes (a region and two edges with
``--upstream``), so that the benchmark cannot rot: its figures must keep meaning what they say."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf"))

from bench_cdn import run_once  # noqa: E402
from cdn_cluster import DEVICE_ARGS, REGION_TOKEN, PreplaceSettings, preplace_push, start_cdn  # noqa: E402
from cdn_replay import EdgeTally, note_second_requests, prompt_tokens, replay  # noqa: E402
from cdn_trace import VERSIONS, TraceConfig, build_trace, edge_of_user, tokenize  # noqa: E402
from prompt_normalize import COMMON_MARKER_PATTERNS, NormalizeConfig, Normalizer  # noqa: E402

TINY = TraceConfig(requests=30, apps=1, documents=2, users=6, seed=3)


def test_versions_of_a_system_prompt_are_one_prompt_once_normalized():
    trace = build_trace(TraceConfig(requests=400, apps=2, seed=5))
    normalizer = Normalizer(NormalizeConfig(marker_patterns=COMMON_MARKER_PATTERNS))
    raw = {(r.app, r.messages[0]["content"]) for r in trace}
    normalized = {(r.app, normalizer.normalize_system(r.messages[0]["content"])) for r in trace}
    assert len(raw) == 2 * VERSIONS  # every version of each app's prompt occurs
    assert len(normalized) == 2
    assert len({tuple(tokenize(text)) for _, text in raw}) == 2 * VERSIONS  # raw, each version has its own tokens


def test_requests_share_everything_before_the_question():
    trace = build_trace(TraceConfig(requests=200, apps=1, documents=2, seed=4))
    a = trace[0]
    b = next(r for r in trace[1:] if (r.app, r.version, r.document) == (a.app, a.version, a.document))
    (tokens_a, shareable_a), (tokens_b, shareable_b) = prompt_tokens(a, None), prompt_tokens(b, None)
    assert 0 < shareable_a == shareable_b < min(len(tokens_a), len(tokens_b))
    assert tokens_a[:shareable_a] == tokens_b[:shareable_b]
    assert tokens_a[shareable_a:] != tokens_b[shareable_b:]


def test_second_request_scoring():
    tally = EdgeTally()
    keys = [bytes([i]) * 16 for i in range(6)]
    note_second_requests(tally, keys, edge_blocks=2, cold_blocks=3)  # blocks 2..4 fetched cold
    assert (tally.second_requests, tally.second_warm) == (0, 0)
    note_second_requests(tally, keys, edge_blocks=5, cold_blocks=0)  # the edge now serves through block 4
    assert (tally.second_requests, tally.second_warm) == (1, 1)
    note_second_requests(tally, keys[:5], edge_blocks=2, cold_blocks=3)
    note_second_requests(tally, keys[:5], edge_blocks=3, cold_blocks=2)  # fetched cold again: not warm
    assert (tally.second_requests, tally.second_warm) == (2, 1)


def test_session_affinity_spreads_users_over_edges():
    edges = [edge_of_user(u, 4) for u in range(400)]
    assert set(edges) == {0, 1, 2, 3}
    assert edges == [edge_of_user(u, 4) for u in range(400)]  # stable


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    requests = build_trace(TINY)
    assert len({edge_of_user(r.user, 2) for r in requests}) == 2
    out = {}
    for normalized in (False, True):
        workdir = tmp_path_factory.mktemp(f"cdn-normalized-{normalized}")
        out[normalized] = run_once(requests, workdir, 2, None, normalized, DEVICE_ARGS, "tiny", concurrent=False)
    return out


def test_cold_fetched_prefixes_are_warm_at_the_edge_the_second_time(tiny_runs):
    for run in tiny_runs.values():
        assert run["requests"] == TINY.requests
        assert run["upstream_failures"] == 0
        assert run["blocks_cold"] > 0, run  # an edge fetched what the other edge had computed
        assert run["second_requests"] > 0, run
        assert run["second_requests_warm"] == run["second_requests"], run


def test_cold_fetches_agree_between_the_client_and_the_edges(tiny_runs):
    for run in tiny_runs.values():
        assert run["cold_fetches_kvcache"] == run["blocks_cold"]
        assert run["cold_fetches_edges_upstream"] >= run["cold_fetches_kvcache"]
        assert run["warm_hits_kvcache"] == run["blocks_edge"]
        assert run["blocks_edge"] + run["blocks_cold"] + run["blocks_computed"] == run["blocks_asked"]


def test_normalization_raises_the_hit_ratio(tiny_runs):
    raw, normalized = tiny_runs[False], tiny_runs[True]
    assert normalized["edge_hit_ratio_of_shareable"] > raw["edge_hit_ratio_of_shareable"]
    assert normalized["blocks_computed"] < raw["blocks_computed"]


def test_preplaced_prefix_is_warm_at_an_edge_that_never_asked_for_it(tmp_path):
    """Edge 0 serves a few requests, edge 1 one request (cold: the region holds the prompt);
    then the region pushes its hot prefixes, and edge 2's first request is served by edge 2."""
    trace = build_trace(TraceConfig(requests=60, apps=1, documents=1, users=30, seed=7))
    by_edge = {e: [r for r in trace if edge_of_user(r.user, 3) == e] for e in range(3)}
    cdn = start_cdn(tmp_path, 3, PreplaceSettings(interval_s=3600.0))  # rounds only when asked
    try:
        def serve_at(edge: int, requests) -> EdgeTally:
            tallies, _ = replay(requests, cdn.edge_addresses, cdn.region.data_addr, REGION_TOKEN, True,
                                concurrent=False)
            assert tallies[edge].requests == len(requests)
            return tallies[edge]

        serve_at(0, by_edge[0][:4])
        before = serve_at(1, by_edge[1][:1])
        assert before.blocks_edge == 0 and before.blocks_cold > 0  # not pushed yet: fetched from the region
        report = preplace_push(cdn.region)
        assert report["prefixes"] >= 1 and all(e["ok"] for e in report["edges"]), report
        after = serve_at(2, by_edge[2][:1])
        assert after.blocks_edge >= before.blocks_cold > 0  # the pushed prompt, held by edge 2 itself
        assert after.blocks_cold == 0
    finally:
        cdn.stop()
