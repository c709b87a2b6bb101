"""Who is served NIXL (``nixl_trusted``), and what a served client is handed: the setting parsed
without I/O, a daemon that serves NIXL to no client it was not told to trust, and metadata that
names no memory of the daemon's."""
from __future__ import annotations

import os

import pytest

from kvtier.daemon.config import ConfigError, config_from_args
from kvtier.daemon.nixl.trust import NixlTrust, NixlTrustError, peer_host


def test_loopback_trusts_this_hosts_addresses_and_nothing_else():
    trust = NixlTrust.parse("loopback")
    assert trust.trusts("127.0.0.1") and trust.trusts("127.3.4.5") and trust.trusts("::1")
    assert trust.trusts("::ffff:127.0.0.1")  # an IPv4 client of a dual-stack socket
    assert not trust.trusts("10.0.0.1") and not trust.trusts("::ffff:10.0.0.1") and not trust.trusts("fe80::1")
    assert not trust.network_clients and trust.describe() == "loopback"


def test_networks_and_addresses_are_listed_with_or_without_loopback():
    trust = NixlTrust.parse(" 10.0.0.0/24 , fd00::/64,192.168.1.7")
    assert trust.trusts("10.0.0.200") and trust.trusts("fd00::5") and trust.trusts("192.168.1.7")
    assert not trust.trusts("10.0.1.1") and not trust.trusts("127.0.0.1") and not trust.trusts("192.168.1.8")
    assert trust.network_clients and trust.describe() == "10.0.0.0/24, fd00::/64, 192.168.1.7/32"
    assert NixlTrust.parse("loopback,10.1.0.0/16").describe() == "loopback, 10.1.0.0/16"


def test_none_trusts_no_client():
    trust = NixlTrust.parse("none")
    assert not trust.trusts("127.0.0.1") and not trust.trusts("::1") and trust.describe() == "no client"


@pytest.mark.parametrize("text, says", [("", "is empty"), ("none,loopback", "'none' cannot be listed"),
                                        ("10.0.0.0/33", "'10.0.0.0/33' is not an address"),
                                        ("localhost", "'localhost' is not an address")])
def test_a_bad_setting_names_the_part(text, says):
    with pytest.raises(NixlTrustError, match=says):
        NixlTrust.parse(text)


def test_a_host_that_is_not_an_address_is_not_trusted():
    assert not NixlTrust.parse("loopback").trusts("not-an-address")


def test_peer_host_takes_the_address_of_a_peer():
    assert peer_host("127.0.0.1:5000") == "127.0.0.1" and peer_host("::1:5000") == "::1"


def test_the_daemon_setting_defaults_to_loopback_and_is_checked():
    assert config_from_args([]).nixl_trust.describe() == "loopback"
    assert config_from_args(["--nixl-trusted", "none"]).nixl_trust.describe() == "no client"
    with pytest.raises(ConfigError, match="nixl_trusted: 'bogus'"):
        config_from_args(["--nixl-trusted", "bogus"])


nixl = pytest.importorskip("nixl_cu12._api", reason="NIXL is not installed (pip install 'kvtier[nixl]')")

from nixl_daemon import LOOPBACK_ENV, start_nixl_daemon  # noqa: E402
from kvtier.client import BlockClient  # noqa: E402
from kvtier.client.kvcache import KVCache  # noqa: E402
from kvtier.client.nixl_control import ControlChannel  # noqa: E402
from kvtier.client.nixl_transport import ClientAgent  # noqa: E402
from kvtier.common.keys import KVLayout, Namespace  # noqa: E402
import torch  # noqa: E402
from kvtier.daemon.nixl.agent import DaemonAgent, buffer_address  # noqa: E402
from kvtier.wire import connection as p  # noqa: E402
from kvtier.wire import events as m  # noqa: E402

os.environ.update(LOOPBACK_ENV)
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=32)


def test_the_metadata_a_client_is_handed_names_no_daemon_memory():
    agent = DaemonAgent(loopback_only=True)
    buffer = memoryview(bytearray(1 << 20))
    key = agent._register(buffer)  # as while a transfer runs
    try:
        handed = agent.metadata()
        assert buffer_address(buffer).to_bytes(8, "little") not in handed
        client = nixl.nixl_agent("trust-probe", nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        mine = bytearray(4096)
        client.register_memory([(buffer_address(mine), 4096, 0, "")], "DRAM", backends=["UCX"])
        name = client.add_remote_agent(handed)
        with pytest.raises(Exception, match="NOT_FOUND"):  # no section of the daemon's to aim at
            client.initialize_xfer("READ", client.get_xfer_descs([(buffer_address(mine), 4096, 0)], "DRAM"),
                                   client.get_xfer_descs([(buffer_address(buffer), 4096, 0)], "DRAM"), name)
    finally:
        agent._release([key])
    assert agent.statistics().registered_bytes == 0  # the transfer ended: nothing of the daemon's registered


@pytest.mark.parametrize("trusted", ["none", "10.0.0.0/8"])
def test_a_client_the_daemon_does_not_trust_is_served_over_tcp(tmp_path, trusted):
    d = start_nixl_daemon(tmp_path / "kvtierd", "--nixl-trusted", trusted)
    try:
        assert f"nixl_served_to={'no-client' if trusted == 'none' else trusted}" in d.ready_line
        with BlockClient(d.data_addr) as client:
            client.ping()
            assert not client._offers(m.FEATURE_NIXL) and not client._offers(m.FEATURE_NIXL_PUT)
        host, _, port = d.data_addr.rpartition(":")
        ch = ControlChannel(host, int(port), 10.0, None, "untrusted")
        try:
            agent = ClientAgent.shared(loopback_only=True)
            with pytest.raises(p.RemoteError, match=r"NIXL is not served to 127\.0\.0\.1") as refused:
                ch.exchange(m.NixlMetadata(0, agent.metadata(), agent.regions()))
            assert refused.value.code == p.ErrorCode.AUTH
            assert ch.exchange(p.Ping(0, b"still")).data == b"still"  # the connection serves on
        finally:
            ch.close()
        ns = Namespace("untrusted", LAYOUT)
        with pytest.raises(ValueError, match="nixl"):
            KVCache(ns, d.data_addr, hot_pool_bytes=0, transport="nixl").close()
        with KVCache(ns, d.data_addr, hot_pool_bytes=0) as cache:  # auto: TCP, and it works
            tokens = list(range(64))
            kv = [(torch.ones(1, 2, 64, 64, dtype=torch.float16),) * 2 for _ in range(LAYOUT.num_layers)]
            assert cache.store(tokens, kv) == 2
            loaded = cache.load(tokens)
            assert loaded.num_tokens == 64 and "nixl" not in loaded.transports
        with BlockClient(d.data_addr) as client:
            assert client.stats()["nixl"].get("refused_untrusted", 0) >= 1
    finally:
        assert d.stop() == 0, d.log_tail()


def test_a_daemon_on_the_network_says_at_start_that_its_network_clients_get_no_nixl(tmp_path):
    d = start_nixl_daemon(tmp_path / "kvtierd", "--listen", "0.0.0.0:0", "--token-file", str(_token(tmp_path)))
    try:
        assert "nixl_served_to=loopback" in d.ready_line
        assert "clients on the network are served over TCP, not NIXL" in d.log_tail()
    finally:
        assert d.stop() == 0, d.log_tail()


def _token(tmp_path):
    path = tmp_path / "token"
    path.write_text("s3cret\n")
    return path
