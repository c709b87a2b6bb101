"""The preplace_* settings: flags, TOML keys, and the errors that name a bad one (no daemon)."""
import pytest

from kvtier.daemon.config import ConfigError, config_from_args
from kvtier.daemon.preplace.edge_link import soft_pin_ttl_ms
from kvtier.daemon.preplace.edges import Edge, UnknownEdge, choose
from kvtier.daemon.preplace.settings import PREPLACE_BYTES_DEFAULT, PreplaceSettings


def test_flags_make_the_settings():
    cfg = config_from_args(["--preplace-edges", "127.0.0.1:7001, [::1]:7002", "--preplace-bytes", "64m",
                            "--preplace-ttl-s", "30", "--preplace-interval-s", "5"])
    s = cfg.preplace_settings("tok")
    assert s == PreplaceSettings("127.0.0.1:7001, [::1]:7002", 64 << 20, 30.0, 5.0, "tok")
    assert s.static_edges == ("127.0.0.1:7001", "[::1]:7002") and s.cluster_url is None
    assert config_from_args([]).preplace_settings(None) is None


def test_toml_keys_and_the_cluster_form(tmp_path):
    path = tmp_path / "kvtierd.toml"
    path.write_text('preplace_edges = "etcd://127.0.0.1:2379/edges"\npreplace_bytes = "2g"\n'
                    'preplace_ttl_s = 120\npreplace_interval_s = 7.5\npreplace_token_file = "/etc/kvtier/edge"\n')
    cfg = config_from_args(["--config", str(path)])
    s = cfg.preplace_settings(None)
    assert (s.budget_bytes, s.ttl_s, s.interval_s) == (2 << 30, 120.0, 7.5)
    assert s.cluster_url.members_prefix == "/edges/members/" and s.static_edges == ()
    assert cfg.redacted()["preplace_token_file"] == "<set>"
    assert config_from_args(["--config", str(path), "--preplace-bytes", "1m"]).preplace_bytes == 1 << 20
    assert config_from_args(["--preplace-edges", "h:1"]).preplace_bytes == PREPLACE_BYTES_DEFAULT


@pytest.mark.parametrize("argv, message", [
    (["--preplace-edges", "nohost"], "preplace_edges: 'nohost' is not HOST:PORT"),
    (["--preplace-edges", "h:1,h:1"], "names an edge twice"),
    (["--preplace-edges", "h:0"], "has port 0"),
    (["--preplace-edges", ","], "names no edge"),
    (["--preplace-edges", "etcd:///x"], "names no etcd endpoint"),
    (["--preplace-edges", "h:1", "--preplace-ttl-s", "0"], "preplace_ttl_s: 0.0 is outside"),
    (["--preplace-edges", "h:1", "--preplace-ttl-s", "5e6"], "preplace_ttl_s"),
    (["--preplace-edges", "h:1", "--preplace-interval-s", "0.01"], "preplace_interval_s: 0.01 is outside"),
    (["--preplace-edges", "h:1", "--preplace-interval-s", "inf"], "preplace_interval_s: inf is outside"),
    (["--preplace-edges", "h:1", "--preplace-interval-s", "nan"], "preplace_interval_s: nan is outside"),
    (["--preplace-edges", "h:1", "--preplace-bytes", "0"], "--preplace-bytes: must be positive"),
    (["--preplace-token-file", "/tmp/t"], "preplace_token_file: only makes sense with preplace_edges"),
])
def test_bad_settings_are_refused_naming_them(argv, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        config_from_args(argv)


def test_bad_toml_types_are_refused(tmp_path):
    path = tmp_path / "kvtierd.toml"
    path.write_text('preplace_edges = "h:1"\npreplace_ttl_s = "soon"\n')
    with pytest.raises(ConfigError, match="preplace_ttl_s: expected seconds as a number"):
        config_from_args(["--config", str(path)])


def test_choosing_edges_by_name_or_address():
    edges = (Edge("node-a", "10.0.0.1:7410"), Edge("node-b", "10.0.0.2:7410"))
    assert choose(edges, "all") == edges
    assert choose(edges, ["10.0.0.2:7410"]) == edges[1:]
    assert choose(edges, ["node-b", "node-a", "node-a"]) == edges  # the configured order, once each
    with pytest.raises(UnknownEdge, match="unknown edge 'node-c'; the edges are: node-a, node-b"):
        choose(edges, ["node-a", "node-c"])


def test_ttl_to_the_wires_milliseconds():
    assert soft_pin_ttl_ms(0.0001) == 1 and soft_pin_ttl_ms(2.5) == 2500 and soft_pin_ttl_ms(1e9) == 2**32 - 1
