"""Direct reads in flight: each device's contiguous stripe units joined into preadv runs, spans
read window by window into reused buffers, and raw blocks landed straight in the load's output."""
from __future__ import annotations

import torch

from daemon_proc import device_map_of, start_kvtierd
from kvtier.client import direct_reader
from kvtier.client.direct_reader import _Span, _windows, device_runs
from kvtier.client.kvcache import KVCache
from kvtier.common.keys import KVLayout, Namespace

MiB = 1 << 20


def _pieces(offsets_sizes, span=0):
    buf = memoryview(bytearray(sum(n for _, n in offsets_sizes)))
    out, pos = [], 0
    for off, n in offsets_sizes:
        out.append((off, buf[pos:pos + n], span))
        pos += n
    return out


def test_contiguous_pieces_on_a_device_become_one_run_up_to_the_limit():
    pieces = _pieces([(0, MiB), (MiB, MiB), (2 * MiB, MiB)], span=0) + _pieces([(3 * MiB, MiB), (4 * MiB, MiB)], span=1)
    runs = device_runs(pieces)
    assert [(off, [v.nbytes for v in views], spans) for off, views, spans in runs] == [
        (0, [MiB] * 4, {0, 1}), (4 * MiB, [MiB], {1})]  # RUN_BYTES_MAX (4 MiB) ends the first run
    gap = device_runs(_pieces([(0, MiB), (3 * MiB, MiB)]))
    assert [off for off, _, _ in gap] == [0, 3 * MiB]  # not contiguous on the device: two reads


def test_spans_go_in_windows_and_a_large_span_alone():
    spans = [_Span(i * 10, i * 10 + n, (i,)) for i, n in enumerate([4, 4, 4, 20, 2])]
    assert [[s.members[0] for s in w] for w in _windows(spans, 10)] == [[0, 1], [2], [3], [4]]


def test_a_large_direct_load_lands_in_the_output_and_reuses_its_read_buffers(tmp_path, monkeypatch):
    monkeypatch.setattr(direct_reader, "READ_RANGE_BYTES_MAX", 1 * MiB)  # spans of 4 blocks ...
    monkeypatch.setattr(direct_reader, "WINDOW_BYTES_MAX", 1 * MiB)  # ... one window each
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=256)  # 256 KiB blocks
    ns = Namespace("direct-windows", layout)
    tokens = list(range(256 * 16))
    gen = torch.Generator().manual_seed(2)
    kv = [tuple(torch.randn(1, 2, len(tokens), 64, generator=gen).half() for _ in range(2)) for _ in range(4)]
    d = start_kvtierd(tmp_path)
    try:
        with KVCache(ns, d.data_addr, hot_pool_bytes=0, transport="direct", device_map=device_map_of(d)) as cache:
            assert cache.store(tokens, kv) == 16
            cache.flush()
            out = torch.zeros(4, 2, 1, 2, len(tokens), 64, dtype=torch.float16)
            for _ in range(2):
                out.zero_()
                got = cache.load(tokens, out=out)
                assert got.transports == {"direct": 16} and got.num_tokens == len(tokens)
                assert all(torch.equal(k, k2) and torch.equal(v, v2) for (k, v), (k2, v2) in zip(kv, got.layers))
            pool = cache._warm.daemons[0].reader._span_buffers.statistics()
            assert pool.takes >= 8 and pool.reused >= pool.takes - 2  # later windows reuse the first ones' buffers
    finally:
        assert d.stop() == 0, d.log_tail()
