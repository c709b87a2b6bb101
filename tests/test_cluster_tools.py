"""The tools against a real etcd: ``kvtier cluster status`` and kvperf ``--target=etcd://``."""
import json

from cluster_fixtures import etcd, start_member  # noqa: F401
from kvtier.client import BlockClient
from kvtier.client.routing import Rendezvous
from kvtier.tools.admin_cli import EXIT_FAILED, EXIT_OK, main as kvtier_main
from kvtier.tools.kvperf.cli import EXIT_OK as KVPERF_OK, run as kvperf_run
from kvtier.tools.kvperf.content import block_key
from ports import free_port


def test_cluster_status_lists_members_leases_and_figures(etcd, tmp_path, capsys):
    a = start_member(tmp_path, etcd, "node-a", admin="127.0.0.1:0")
    b = start_member(tmp_path, etcd, "node-b")  # no admin API: figures from the data port's STATS
    try:
        assert kvtier_main(["--json", "cluster", "status", "--cluster", etcd.url()]) == EXIT_OK
        doc = json.loads(capsys.readouterr().out)
        assert doc["cluster"] == etcd.url()
        na, nb = doc["members"]
        assert (na["node_id"], na["data"], na["admin"]) == ("node-a", a.data_addr, a.admin_addr)
        assert (nb["node_id"], nb["data"], nb["admin"]) == ("node-b", b.data_addr, None)
        for n in (na, nb):
            assert 0 < n["lease_ttl_s"] <= 2 and n["reachable"] and n["error"] is None
        assert na["figures"]["source"] == "admin" and na["figures"]["blocks"] == 0
        assert nb["figures"]["source"] == "stats" and nb["figures"]["engine.blocks"] == 0
        assert kvtier_main(["cluster", "status", "--cluster", etcd.url()]) == EXIT_OK
        text = capsys.readouterr().out
        assert f"cluster {etcd.url()}: 2 member(s)" in text
        assert "node-a" in text and a.data_addr in text and "0 blocks" in text
        b.kill()  # listed until its lease expires, as unreachable
        assert kvtier_main(["--json", "cluster", "status", "--cluster", etcd.url()]) == EXIT_OK
        nb = json.loads(capsys.readouterr().out)["members"][1]
        assert nb["node_id"] == "node-b" and not nb["reachable"] and nb["error"]
    finally:
        a.stop()
        b.stop()


def test_cluster_status_etcd_down_names_the_url(capsys):
    url = f"etcd://127.0.0.1:{free_port()}/kvtier"
    assert kvtier_main(["cluster", "status", "--cluster", url]) == EXIT_FAILED
    assert f"etcd at {url} did not answer" in capsys.readouterr().err


def test_kvperf_routes_over_the_members_by_node_id(etcd, tmp_path, capsys):
    a, b = start_member(tmp_path, etcd, "node-a"), start_member(tmp_path, etcd, "node-b")
    try:
        args = ["--output-format=json", f"--target={etcd.url()}", "--bs=64k", "--size=4m", "--keyspace=cl",
                "--seed=3"]
        assert kvperf_run([*args, "--name=w", "--rw=write", "--verify=1"]) == KVPERF_OK
        doc = json.loads(capsys.readouterr().out)
        assert doc["jobs"][0]["verify_errors"] == 0 and doc["jobs"][0]["write"]["total_ios"] == 64
        owners = Rendezvous(["node-a", "node-b"]).owners([block_key(3, "cl", 0, i) for i in range(64)])
        on_b = int(owners.sum())
        assert 0 < on_b < 64
        for daemon, expected in ((a, 64 - on_b), (b, on_b)):  # each block on its owner by node id
            with BlockClient(daemon.data_addr) as c:
                assert c.stats()["engine"]["blocks"] == expected
    finally:
        a.stop()
        b.stop()


def test_kvperf_etcd_target_errors(capsys):
    url = f"etcd://127.0.0.1:{free_port()}/kvtier"
    code = kvperf_run([f"--target={url}", "--bs=64k", "--size=1m", "--name=w", "--rw=write"])
    assert code != KVPERF_OK
    assert f"cannot use target {url}" in capsys.readouterr().err
    assert kvperf_run(["--target=etcd://h:0/x", "--bs=64k", "--size=1m", "--name=w", "--rw=write"]) != KVPERF_OK
    assert "port 0" in capsys.readouterr().err
