"""A real Prometheus scrape of a real kvtierd, parsed with prometheus_client's parser:
the figures must be what the test did over the data port."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import httpx
import pytest
from daemon_proc import start_kvtierd
from prometheus_client.parser import text_string_to_metric_families

from kvtier.client import BlockClient
from kvtier.common.blockformat import encode_block
from kvtier.common.keys import KVLayout, Namespace

REPO = Path(__file__).resolve().parent.parent
NS = Namespace("metrics-model", KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=2))
PAYLOAD_BYTES = 10_000
TOKENS = list(range(10))  # 5 blocks of 2 tokens


def scrape(http: httpx.Client) -> dict[str, dict]:
    """{family name: {"type", "samples": {(sample name, labels...): value}}}."""
    resp = http.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(resp.text):
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
        out[family.name] = {"type": family.type, "samples": samples}
    return out


def value(families, family: str, sample: str | None = None, **labels) -> float:
    return families[family]["samples"][(sample or family, tuple(sorted(labels.items())))]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_kvtierd(tmp_path_factory.mktemp("metrics"), admin="127.0.0.1:0")
    yield d
    assert d.stop() == 0, d.log_tail()


@pytest.fixture(scope="module")
def http(daemon):
    with httpx.Client(base_url=f"http://{daemon.admin_addr}", timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def workload(daemon, http):
    """Puts, hits, misses and a LOOKUP with known answers; returns the scrape before and after."""
    before = scrape(http)
    keys = NS.keys(TOKENS)
    blocks = [encode_block(k, NS.id, 0, bytes([i]) * PAYLOAD_BYTES) for i, k in enumerate(keys[:3])]
    with BlockClient(daemon.data_addr, pool_size=1) as client:
        for key, block in zip(keys, blocks):
            client.put(key, block)
        hits = client.get_many(keys[:2], ns_id=NS.id)
        misses = client.get_many(keys[4:5], ns_id=NS.id)
        assert all(h is not None for h in hits) and misses == [None]
        assert client.lookup(keys, ns_id=NS.id) == 3
        during = scrape(http)
    after = scrape(http)
    return {"before": before, "during": during, "after": after, "block_bytes": len(blocks[0])}


def delta(workload, family, sample=None, **labels) -> float:
    return value(workload["after"], family, sample, **labels) - value(workload["before"], family, sample, **labels)


def test_engine_figures_match_the_workload(workload):
    size = workload["block_bytes"]
    assert delta(workload, "kvtier_puts", "kvtier_puts_total") == 3
    assert delta(workload, "kvtier_written_bytes", "kvtier_written_bytes_total", tier="warm") == 3 * size
    assert delta(workload, "kvtier_hits", "kvtier_hits_total", tier="warm") == 2
    assert delta(workload, "kvtier_misses", "kvtier_misses_total", tier="warm") == 1
    assert delta(workload, "kvtier_read_bytes", "kvtier_read_bytes_total", tier="warm") == 2 * size
    after = workload["after"]
    assert value(after, "kvtier_index_entries") == 3
    assert value(after, "kvtier_stored_bytes") == 3 * size
    free, total = value(after, "kvtier_regions_free"), value(after, "kvtier_regions")
    assert 0 < free < total
    assert value(after, "kvtier_allocation_failures", "kvtier_allocation_failures_total") == 0
    assert value(after, "kvtier_device_errors", "kvtier_device_errors_total") == 0
    assert value(after, "kvtier_ready") == 1


def test_lookup_prefix_hit_ratio_and_namespaces(workload):
    after = workload["after"]
    assert value(after, "kvtier_lookup_keys", "kvtier_lookup_keys_total") == 5
    assert value(after, "kvtier_lookup_hit_keys", "kvtier_lookup_hit_keys_total") == 3
    assert value(after, "kvtier_lookup_prefix_hit_ratio") == pytest.approx(3 / 5)
    assert math.isnan(value(workload["before"], "kvtier_lookup_prefix_hit_ratio")), "no LOOKUP yet: NaN, not 0"
    ns = NS.id.hex()
    # GET: 2 hits + 1 miss; LOOKUP: 3 leading present + 2 not
    assert value(after, "kvtier_namespace_hits", "kvtier_namespace_hits_total", tier="warm", namespace=ns) == 5
    assert value(after, "kvtier_namespace_misses", "kvtier_namespace_misses_total", tier="warm", namespace=ns) == 3


def test_op_latency_histograms(workload):
    after = workload["after"]
    fam = after["kvtier_op_duration_seconds"]
    assert fam["type"] == "histogram"
    for op, count in (("put", 3), ("get", 2), ("lookup", 1)):
        buckets = sorted(((float(dict(labels)["le"]), v) for (name, labels), v in fam["samples"].items()
                          if name.endswith("_bucket") and dict(labels)["op"] == op))
        assert buckets[-1][0] == math.inf and buckets[-1][1] == count, (op, buckets)
        assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:])), "cumulative"
        assert value(after, "kvtier_op_duration_seconds", "kvtier_op_duration_seconds_count", op=op) == count
        total_s = value(after, "kvtier_op_duration_seconds", "kvtier_op_duration_seconds_sum", op=op)
        assert 0 < total_s < 60
    assert value(after, "kvtier_requests", "kvtier_requests_total", op="put") == 3


def test_connections_and_network_bytes(workload):
    assert value(workload["during"], "kvtier_open_connections") >= 1
    assert delta(workload, "kvtier_connections", "kvtier_connections_total") >= 1
    assert delta(workload, "kvtier_network_sent_bytes", "kvtier_network_sent_bytes_total") >= \
        2 * workload["block_bytes"]
    assert delta(workload, "kvtier_network_received_bytes", "kvtier_network_received_bytes_total") >= \
        3 * workload["block_bytes"]


def test_request_buffers(workload):
    """The workload's PUTs and GETs borrowed arenas and gave them back; nothing was refused."""
    after = workload["after"]
    assert value(after, "kvtier_request_arenas") >= 1 and value(after, "kvtier_request_arenas_lent") == 0
    assert value(after, "kvtier_request_arenas_refused", "kvtier_request_arenas_refused_total") == 0
    assert value(after, "kvtier_transient_buffer_bytes") == 0
    assert value(after, "kvtier_transient_buffer_budget_bytes") == 1 << 30
    assert value(after, "kvtier_transient_buffer_refused", "kvtier_transient_buffer_refused_total") == 0
    assert value(after, "kvtier_transient_buffer_waits", "kvtier_transient_buffer_waits_total") == 0


def test_metrics_agree_with_the_stats_endpoint(workload, http):
    stats = http.get("/v1/stats").json()
    families = scrape(http)
    assert value(families, "kvtier_hits", "kvtier_hits_total", tier="warm") == stats["tiers"]["warm"]["hits"]
    assert value(families, "kvtier_index_entries") == stats["engine"]["blocks"]
    assert value(families, "kvtier_regions_free") == stats["engine"]["regions_free"]
    assert stats["lookup"]["prefix_hit_ratio"] == pytest.approx(3 / 5)


def test_names_follow_prometheus_conventions(workload):
    for name, fam in workload["after"].items():
        assert re.fullmatch(r"kvtier_[a-z][a-z0-9_]*", name), name
        if fam["type"] == "counter":
            assert all(s[0].endswith(("_total", "_created")) for s in fam["samples"]), name
        if fam["type"] == "gauge":
            assert not name.endswith("_total"), name
        for unit in ("_ms", "_us", "_kb", "_mb", "_milliseconds"):
            assert unit not in name, f"{name}: use base units"


def test_grafana_dashboard_uses_only_exported_metrics(workload):
    dashboard = json.loads((REPO / "docs" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = set(re.findall(r"kvtier_[a-z0-9_]+", " ".join(exprs)))
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    exported = {name + suffix for name, fam in workload["after"].items() for suffix in suffixes[fam["type"]]}
    assert used and used <= exported, used - exported
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for figure in ("prefix hit ratio", "allocation failure", "latency"):
        assert figure in titles


def test_openmetrics_when_the_scraper_asks(workload, http):
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

    resp = http.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert resp.headers["content-type"].startswith("application/openmetrics-text")
    families = {f.name: f for f in parse_openmetrics(resp.text)}
    hits = [s for s in families["kvtier_hits"].samples if s.name == "kvtier_hits_total"]
    assert hits[0].value == value(scrape(http), "kvtier_hits", "kvtier_hits_total", tier="warm")
