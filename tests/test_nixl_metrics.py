"""The NIXL data plane in /metrics: a real kvtierd with its NIXL agent and its admin API, a store
and a load through the nixl transport, then a Prometheus scrape of what they did."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("nixl_cu12._api", reason="NIXL is not installed (pip install 'kvtier[nixl]')")

import httpx  # noqa: E402
import torch  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvtier.client.kvcache import KVCache  # noqa: E402
from kvtier.common.keys import KVLayout, Namespace  # noqa: E402
from kvtier.daemon.admin.nixl_metrics import nixl_families  # noqa: E402
from nixl_daemon import LOOPBACK_ENV, start_nixl_daemon  # noqa: E402

os.environ.update(LOOPBACK_ENV)
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=32)


def _scrape(addr: str) -> dict:
    text = httpx.get(f"http://{addr}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_nixl_metrics_appear_once_the_agent_exists_and_count_what_moved(tmp_path):
    d = start_nixl_daemon(tmp_path / "kvtierd", "--nixl", "auto", admin="127.0.0.1:0")
    try:
        assert not [k for k in _scrape(d.admin_addr) if k[0].startswith("kvtier_nixl_")]  # no agent yet
        tokens = list(range(32 * 3))
        g = torch.Generator().manual_seed(1)
        kv = [(torch.randn(1, 2, len(tokens), 64, generator=g).half(),
               torch.randn(1, 2, len(tokens), 64, generator=g).half()) for _ in range(LAYOUT.num_layers)]
        with KVCache(Namespace("nixl-metrics", LAYOUT), d.data_addr, hot_pool_bytes=0, transport="nixl") as cache:
            assert cache.wait_nixl_ready(10)
            assert cache.store(tokens, kv, durable=True) == 3
            assert cache.load(tokens).transports == {"nixl": 3}
        m = _scrape(d.admin_addr)
        assert m[("kvtier_nixl_info", (("transport", "sm"), ("ucx_tls", "self,sm,tcp")))] == 1
        assert m[("kvtier_nixl_put_blocks_total", ())] == 3
        assert m[("kvtier_nixl_transfers_total", (("op", "read"),))] >= 1
        assert m[("kvtier_nixl_transfers_total", (("op", "write"),))] >= 1
        assert m[("kvtier_nixl_transferred_bytes_total", (("op", "read"),))] >= 3 * LAYOUT.block_raw_bytes
        assert m[("kvtier_nixl_transferred_bytes_total", (("op", "write"),))] >= 3 * LAYOUT.block_raw_bytes
        assert m[("kvtier_nixl_failures_total", ())] == 0 and m[("kvtier_nixl_timeouts_total", ())] == 0
        assert m[("kvtier_nixl_gets_peer_gone_total", ())] == m[("kvtier_nixl_writes_parked_total", ())] == 0
        assert m[("kvtier_nixl_reads_parked_total", ())] == m[("kvtier_nixl_refused_parked_total", ())] == 0
        assert m[("kvtier_nixl_parked_transfers", ())] == m[("kvtier_nixl_parked_bytes", ())] == 0
        assert m[("kvtier_nixl_registered_bytes", ())] == 0  # registered for a transfer while it runs, no longer
        assert m[("kvtier_nixl_refused_untrusted_total", ())] == 0
    finally:
        assert d.stop() == 0, d.log_tail()


def test_no_agent_no_families():
    assert list(nixl_families({})) == []
