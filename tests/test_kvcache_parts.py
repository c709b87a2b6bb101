"""KVCache's pure parts: engine KV <-> blocks, and the per-tier recorders."""
from __future__ import annotations

import pytest
import torch

from kvtier.client.block_payload import blocks_from_kv, check_kv, kv_from_blocks
from kvtier.common.keys import KVLayout
from kvtier.client.tier_stats import LATENCY_SAMPLES_MAX, TierRecorder


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_blocks_round_trip_engine_kv_bit_exactly(dtype):
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype, block_tokens=4)
    dt = getattr(torch, dtype)
    kv = [(torch.randn(1, 2, 14, 8).to(dt), torch.randn(1, 2, 14, 8).to(dt)) for _ in range(3)]
    assert check_kv(kv, layout) == 14
    blocks = blocks_from_kv(kv, layout, first_block=1, num_blocks=2)  # tokens 4..12
    assert blocks.shape == (2, *layout.block_shape) and blocks.is_contiguous()
    # block i, layer l, K/V j, head h, token t == engine kv[l][j][0, h, 4 + 4i + t]
    assert torch.equal(blocks[1, 2, 1, 0, 3], kv[2][1][0, 0, 11])
    layers = kv_from_blocks([blocks[0], blocks[1]], layout, "cpu")
    for (k, v), (rk, rv) in zip(layers, kv):
        assert k.shape == (1, 2, 8, 8)
        assert torch.equal(k, rk[:, :, 4:12]) and torch.equal(v, rv[:, :, 4:12])
        assert k.is_contiguous()


def test_blocks_from_kv_rejects_what_does_not_fit():
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_tokens=4)
    kv = [(torch.zeros(1, 2, 8, 8, dtype=torch.float16),) * 2 for _ in range(2)]
    with pytest.raises(ValueError, match="need tokens up to 12"):
        blocks_from_kv(kv, layout, 1, 2)
    with pytest.raises(ValueError, match=r"layer 1 k has shape"):
        check_kv([kv[0], (torch.zeros(1, 3, 8, 8, dtype=torch.float16),) * 2], layout)
    with pytest.raises(ValueError, match="layer 1 v has 7 tokens"):
        check_kv([kv[0], (kv[0][0], torch.zeros(1, 2, 7, 8, dtype=torch.float16))], layout)
    with pytest.raises(ValueError, match="shape"):
        kv_from_blocks([torch.zeros(2, 2)], layout, "cpu")


def test_tier_recorder_counts_and_percentiles():
    rec = TierRecorder("warm")
    for ms in range(1, 101):  # 1..100 ms
        rec.record(hits=2, misses=1, bytes_read=10, latency_s=ms / 1e3, transport="tcp" if ms % 2 else "direct")
    snap = rec.snapshot()
    assert (snap.hits, snap.misses, snap.lookups, snap.bytes_read, snap.operations) == (200, 100, 300, 1000, 100)
    assert snap.hit_ratio == pytest.approx(2 / 3)
    assert dict(snap.transports) == {"tcp": 100, "direct": 100}
    assert snap.latency_us_p50 == pytest.approx(50_500, rel=1e-9)
    assert snap.latency_us_p99 == pytest.approx(99_010, rel=1e-9)
    assert snap.latency_us_max == pytest.approx(100_000)
    with pytest.raises(TypeError):
        snap.transports["tcp"] = 0  # a snapshot is immutable
    rec.record(hits=1)
    assert snap.hits == 200 and rec.snapshot().hits == 201


def test_tier_recorder_latency_ring_is_bounded():
    rec = TierRecorder("hot")
    for i in range(LATENCY_SAMPLES_MAX + 10):
        rec.record(latency_s=1.0 if i < 10 else 0.001)
    snap = rec.snapshot()
    assert snap.operations == LATENCY_SAMPLES_MAX + 10
    assert snap.latency_us_max == pytest.approx(1000.0)  # the 10 old slow samples were overwritten


def test_tier_recorder_rejects_bad_input():
    with pytest.raises(ValueError, match="tier"):
        TierRecorder("lukewarm")
    with pytest.raises(ValueError, match="negative"):
        TierRecorder("cold").record(hits=-1)
