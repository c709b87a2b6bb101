"""Cluster membership without etcd: the URL and record (common), the daemon's lease state
table and config, the client's member table and static list. Exact-order bookkeeping."""
import pytest

from kvtier.client.cluster_members import MemberTable, MemberView, Member, StaticMembers, open_members
from kvtier.client.routing import Rendezvous
from kvtier.common.cluster_url import (ClusterUrlError, MemberRecord, check_node_id,
                                       parse_cluster_url)
from kvtier.daemon.cluster.lease_state import TRANSITIONS, LeaseState, MemberState, Outcome, Step
from kvtier.daemon.cluster.node_id import NODE_ID_FILE, NodeIdError, load_or_create_node_id
from kvtier.daemon.config import ConfigError, DaemonConfig, config_from_args


# -- the URL and the record ------------------------------------------------------------
def test_cluster_url_parses_endpoints_and_prefix():
    url = parse_cluster_url("etcd://10.0.0.1:2379,[::1]:2380,etcd-c/kvtier/prod/")
    assert url.endpoints == (("10.0.0.1", 2379), ("::1", 2380), ("etcd-c", 2379))
    assert url.prefix == "kvtier/prod"
    assert url.members_prefix == "/kvtier/prod/members/"
    assert url.member_key("node-a") == "/kvtier/prod/members/node-a"
    assert url.node_id_of("/kvtier/prod/members/node-a") == "node-a"
    assert parse_cluster_url(url.text) == url
    assert parse_cluster_url("etcd://127.0.0.1:2379").prefix == "kvtier"


@pytest.mark.parametrize("text, words", [
    ("tcp://127.0.0.1:2379/x", "not an etcd://"),
    ("etcd:///kvtier", "names no etcd endpoint"),
    ("etcd://a:1,,b:2/x", "names no etcd endpoint"),
    ("etcd://a:0/x", "port 0"),
    ("etcd://a:99999/x", "out of range"),
    ("etcd://a:1,a:1/x", "twice"),
    ("etcd://a:1/bad prefix", "prefix"),
    ("etcd://a:1/x//y", "prefix"),
])
def test_cluster_url_errors_name_the_part(text, words):
    with pytest.raises(ClusterUrlError, match=words):
        parse_cluster_url(text)


def test_member_record_round_trip_and_checks():
    rec = MemberRecord("node-a", "10.0.0.5:7410", "10.0.0.5:7411", 1700000000.5)
    assert MemberRecord.decode(rec.encode()) == rec
    assert MemberRecord.decode(MemberRecord("n1", "[::1]:7410").encode()).admin is None
    for raw in (b"not json", b'{"version": 2}', b'{"version": 1, "node_id": "a", "data": "h:0"}',
                b'{"version": 1, "node_id": "a/b", "data": "h:1"}', b"x" * 5000):
        with pytest.raises(ClusterUrlError):
            MemberRecord.decode(raw)


@pytest.mark.parametrize("name", ["", "-a", "a/b", "a b", "x" * 65, "é"])
def test_node_id_rules(name):
    with pytest.raises(ClusterUrlError):
        check_node_id(name)


def test_node_id_is_kept_in_the_data_dir(tmp_path):
    first = load_or_create_node_id(str(tmp_path))
    assert (tmp_path / NODE_ID_FILE).read_text().strip() == first
    assert load_or_create_node_id(str(tmp_path)) == first
    assert load_or_create_node_id(str(tmp_path), "given-1") == "given-1"
    assert load_or_create_node_id(str(tmp_path)) == first  # a given id is not written
    (tmp_path / NODE_ID_FILE).write_text("bad id\n")
    with pytest.raises(NodeIdError, match=NODE_ID_FILE):
        load_or_create_node_id(str(tmp_path))


# -- the daemon's config -------------------------------------------------------------
def test_cluster_flags_and_toml_keys(tmp_path):
    cfg = config_from_args(["--cluster", "etcd://127.0.0.1:2379/kv", "--advertise", "127.0.0.2:7410",
                            "--node-id", "n1", "--lease-ttl", "3"])
    assert (cfg.cluster_url.prefix, cfg.advertise_address, cfg.node_id, cfg.lease_ttl_s) == \
        ("kv", ("127.0.0.2", 7410), "n1", 3)
    toml = tmp_path / "k.toml"
    toml.write_text('cluster = "etcd://127.0.0.1:2379/kv"\nnode_id = "n2"\nlease_ttl = 4\n')
    cfg = config_from_args(["--config", str(toml), "--lease-ttl", "6"])
    assert (cfg.cluster, cfg.node_id, cfg.lease_ttl_s) == ("etcd://127.0.0.1:2379/kv", "n2", 6)
    assert config_from_args([]).cluster is None


@pytest.mark.parametrize("settings, words", [
    (dict(cluster="http://x:1/p"), "not an etcd://"),
    (dict(cluster="etcd://x:1/p", lease_ttl_s=1), "lease_ttl: 1 s is outside 2..300"),
    (dict(cluster="etcd://x:1/p", lease_ttl_s=301), "lease_ttl"),
    (dict(cluster="etcd://x:1/p", advertise="h:0"), "advertise: 'h:0' has port 0"),
    (dict(cluster="etcd://x:1/p", node_id="a b"), "node_id"),
    (dict(cluster="etcd://x:1/p", listen="0.0.0.0:7410", token_file="/t"), "wildcard; set advertise"),
    (dict(advertise="h:1"), "advertise: only makes sense with cluster"),
    (dict(node_id="n"), "node_id: only makes sense with cluster"),
])
def test_cluster_config_errors_name_the_setting(settings, words):
    with pytest.raises(ConfigError, match=words):
        DaemonConfig(**settings)


# -- the lease state table ---------------------------------------------------------------
def test_lease_state_registers_keeps_loses_and_re_registers_in_order():
    s = LeaseState("n1", "etcd://x:1/p", "h:1", 3)
    steps = [s.next_step()]
    s.record(Outcome.REGISTERED, lease_id=7, ttl_s=3, members=1)
    steps.append(s.next_step())
    assert s.delay_s() == 1.0
    s.record(Outcome.KEPT, members=2)
    s.record(Outcome.ETCD_ERROR, error="gone")
    steps.append(s.next_step())  # still holds the lease: try to keep it
    assert s.delay_s() == 0.5
    s.record(Outcome.ETCD_ERROR, error="gone again")
    s.record(Outcome.EXPIRED)
    steps.append(s.next_step())
    s.record(Outcome.REGISTERED, lease_id=8, ttl_s=3, members=2)
    s.record(Outcome.STOPPED)
    steps.append(s.next_step())
    assert steps == [Step.REGISTER, Step.KEEPALIVE, Step.KEEPALIVE, Step.REGISTER, Step.NONE]
    st = s.statistics()
    assert (st.state, st.lease_id, st.registrations, st.re_registrations, st.keepalives, st.etcd_errors,
            st.members_seen, st.last_error) == ("stopped", 8, 2, 1, 1, 2, 2, "gone again")


def test_lease_state_table_is_complete_and_refuses_the_rest():
    for state in MemberState:
        assert (state, Outcome.STOPPED) in TRANSITIONS
    s = LeaseState("n1", "etcd://x:1/p", "h:1", 3)
    with pytest.raises(AssertionError, match="KEPT in state REGISTERING"):
        s.record(Outcome.KEPT)
    s.record(Outcome.ETCD_ERROR, error="down at first")
    assert s.next_step() is Step.REGISTER  # no lease yet: register, not keepalive


# -- the client's member table -------------------------------------------------------
URL = parse_cluster_url("etcd://127.0.0.1:2379/kv")


def _rec(node, port, admin=None):
    return URL.member_key(node), MemberRecord(node, f"127.0.0.1:{port}", admin).encode()


def test_member_table_snapshot_then_events_in_order():
    t = MemberTable(URL)
    assert t.reset([(*_rec("b", 2), 11), (*_rec("a", 1), 10)], revision=5)
    v = t.view()
    assert (v.node_ids, v.addresses, v.version) == (("a", "b"), ("127.0.0.1:1", "127.0.0.1:2"), 5)
    assert t.put(*_rec("c", 3), 12, revision=6)
    assert not t.put(*_rec("c", 3), 12, revision=7)  # the same record again: no change
    assert t.put(*_rec("a", 9), 13, revision=8)  # a restart on another port
    assert t.delete(URL.member_key("b"), revision=9)
    assert not t.delete(URL.member_key("zz"), revision=10)
    assert not t.put("/kv/members/d", b"garbage", 0, revision=11)
    v = t.view()
    assert (v.node_ids, v.addresses, v.version) == (("a", "c"), ("127.0.0.1:9", "127.0.0.1:3"), 11)
    assert (t.joins, t.leaves, t.updates, t.bad_records) == (1, 1, 1, 1)
    assert t.reset([(*_rec("c", 3), 12), (*_rec("e", 5), 14)], revision=20)  # a resync after a lost watch
    assert (t.view().node_ids, t.joins, t.leaves) == (("c", "e"), 2, 2)


def test_member_table_after_etcd_lost_its_data_watches_from_the_new_revision_and_keeps_growing():
    t = MemberTable(URL)
    t.reset([(*_rec("a", 1), 10)], revision=200)
    assert t.reset([(*_rec("b", 2), 3)], revision=5)  # etcd restarted empty: a lower revision
    v = t.view()
    assert t.revision == 5 and v.version > 200 and v.node_ids == ("b",)
    assert t.put(*_rec("c", 3), 4, revision=6)
    assert t.view().version == v.version + 1


def test_member_table_skips_a_record_under_another_name():
    t = MemberTable(URL)
    key, _ = _rec("a", 1)
    t.reset([(key, MemberRecord("b", "127.0.0.1:1").encode(), 1)], revision=1)
    assert (len(t.view()), t.bad_records) == (0, 1)


def test_view_routes_by_node_id():
    v = MemberView((Member("a", "h:1"), Member("b", "h:2"), Member("c", "h:3")), 4, "etcd://x:1/p")
    keys = [bytes([i]) * 16 for i in range(64)]
    assert (v.rendezvous().owners(keys) == Rendezvous(["a", "b", "c"]).owners(keys)).all()
    assert v.rendezvous() is v.rendezvous()
    assert (v.placement(keys, 2) == Rendezvous(["a", "b", "c"]).ranked(keys, 2)).all()
    assert v.placement(keys, 5).shape == (64, 3)  # fewer members than replicas: every member
    assert v.address_of("b") == "h:2"
    with pytest.raises(KeyError, match="'zz' is not a member"):
        v.address_of("zz")
    with pytest.raises(ValueError, match="no live members"):
        MemberView((), 1, "etcd://x:1/p").rendezvous()


def test_static_members_route_as_an_address_list():
    m = open_members("tcp://127.0.0.1:7411, 127.0.0.1:7410")
    v = m.current()
    assert v.node_ids == v.addresses == ("127.0.0.1:7410", "127.0.0.1:7411")
    keys = [bytes([i]) * 16 for i in range(64)]
    assert (v.rendezvous().owners(keys) == Rendezvous(["127.0.0.1:7410", "127.0.0.1:7411"]).owners(keys)).all()
    assert m.wait_changed(-1, 10.0) is v  # older version: at once
    assert m.statistics().members == 2
    for bad in ([], ["h:0"], ["h:1", "h:1"], ["nohost"]):
        with pytest.raises(ValueError):
            StaticMembers(bad)
