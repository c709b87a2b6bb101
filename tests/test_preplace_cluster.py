"""Pre-placement to the members of the edges' etcd cluster (a real etcd, real daemons)."""
from cluster_fixtures import etcd, start_member  # noqa: F401  (fixture)
from daemon_proc import start_kvtierd
from test_preplace import EDGE_TOKEN, NS_SPEC, ask, chain, held, push, soft_pinned, store

from kvtier.common.cluster_url import parse_cluster_url
from kvtier.daemon.preplace.edges import ClusterEdges, Edge
from kvtier.tools.admin_client import AdminClient


def test_edges_are_the_live_members_of_their_cluster(etcd, tmp_path):  # noqa: F811
    token_file = tmp_path / "edge-token"
    token_file.write_text(EDGE_TOKEN)
    edges = [start_member(tmp_path, etcd, name, "--token-file", str(token_file), admin="127.0.0.1:0", prefix="edges")
             for name in ("edge-b", "edge-a")]
    region_token = tmp_path / "region-edge-token"
    region_token.write_text(EDGE_TOKEN)
    region = start_kvtierd(tmp_path / "region", "--preplace-edges", etcd.url("edges"), "--preplace-token-file",
                           str(region_token), "--preplace-interval-s", "3600", admin="127.0.0.1:0")
    try:
        directory = ClusterEdges(parse_cluster_url(etcd.url("edges")))
        b, a = edges
        assert directory.current() == (Edge("edge-a", a.data_addr), Edge("edge-b", b.data_addr))  # by node id

        status = AdminClient(region.admin_addr).request("GET", "/v1/preplace")
        assert [e["name"] for e in status["edges"]] == ["edge-a", "edge-b"]

        tokens, keys = chain(0, 3)
        blocks = store(region, keys)
        doc = AdminClient(region.admin_addr).request("POST", "/v1/preplace", {
            "namespace": NS_SPEC, "tokens": tokens, "edges": ["edge-b"], "ttl_s": 600})
        assert [(e["edge"], e["ok"], e["blocks_pinned"]) for e in doc["edges"]] == [("edge-b", True, 3)]
        assert soft_pinned(b, keys) == [True] * 3 and soft_pinned(a, keys) == [False] * 3

        ask(region, keys, 2)
        report = push(region)
        assert [(e["edge"], e["ok"]) for e in report["edges"]] == [("edge-a", True), ("edge-b", True)]
        for edge in edges:
            assert soft_pinned(edge, keys) == [True] * 3 and held(edge, blocks)
    finally:
        assert region.stop() == 0
        for edge in edges:
            assert edge.stop() == 0
