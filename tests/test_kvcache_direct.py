"""Direct device reads through KVCache against a real kvtierd: the same bytes
as TCP, automatic transport choice, recycled regions detected and served
by TCP instead, corrupted device bytes never handed to the engine."""
from __future__ import annotations

import pytest
import torch

from daemon_proc import device_map_of, start_kvtierd
from kvtier.common.blockformat import encode_block
from kvtier.client.direct_reader import DirectLocation, DirectReader
from kvtier.common.keys import KVLayout, Namespace
from kvtier.client.kvcache import KVCache

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", block_tokens=16)


def make_kv(tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (1, LAYOUT.num_kv_heads, tokens, LAYOUT.head_dim)
    return [(torch.randn(shape, generator=g).half(), torch.randn(shape, generator=g).half())
            for _ in range(LAYOUT.num_layers)]


def same_prefix(layers, kv, tokens):
    return all(torch.equal(k, rk[:, :, :tokens]) and torch.equal(v, rv[:, :, :tokens])
               for (k, v), (rk, rv) in zip(layers, kv))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_kvtierd(tmp_path_factory.mktemp("kvtierd"))
    yield d
    assert d.stop() == 0, d.log_tail()


def test_direct_reads_return_the_same_bytes_as_tcp(daemon):
    ns = Namespace("direct-same", LAYOUT)
    tokens = list(range(100, 100 + 16 * 12))
    kv = make_kv(len(tokens), seed=1)
    with KVCache(ns, daemon.data_addr, hot_pool_bytes=0, device_map=device_map_of(daemon)) as cache:
        assert cache.direct_enabled  # auto: the devices are visible here
        assert cache.store(tokens, kv) == 12
        # still in the open region (unsealed): served by TCP even in direct mode
        before = cache.load(tokens)
        assert before.transports == {"tcp": 12}
        cache.flush()  # seal the open region
        after = cache.load(tokens)
        assert after.transports == {"direct": 12}
        assert same_prefix(after.layers, kv, len(tokens)) and same_prefix(before.layers, kv, len(tokens))
        keys = cache.keys_for(tokens)
        client = cache._warm.daemons[0].client
        present, locs = client.lookup_locations(keys)
        assert present == 12 and all(loc.sealed for loc in locs)
        with DirectReader(client.geometry(), device_map_of(daemon)) as reader:
            direct = reader.read_many(keys, [DirectLocation(l.logical_offset, l.length, l.seq) for l in locs])
        assert [bytes(b) for b in direct] == client.get_many(keys)
        stats = cache.statistics()
        assert stats.warm.transports == {"tcp": 12, "direct": 12} and stats.warm.fallbacks == 0


def test_auto_transport_without_visible_devices_is_tcp(daemon, tmp_path):
    ns = Namespace("direct-auto", LAYOUT)
    with KVCache(ns, daemon.data_addr, hot_pool_bytes=0) as cache:
        assert not cache.direct_enabled
    bogus = {dev: str(tmp_path / "absent") for dev in device_map_of(daemon)}
    with KVCache(ns, daemon.data_addr, hot_pool_bytes=0, device_map=bogus) as cache:
        assert not cache.direct_enabled
    with pytest.raises(OSError, match="absent"):
        KVCache(ns, daemon.data_addr, hot_pool_bytes=0, device_map=bogus, transport="direct")
    with pytest.raises(ValueError, match="no local path"):
        KVCache(ns, daemon.data_addr, hot_pool_bytes=0, device_map={"00" * 16: "/dev/null"}, transport="direct")


def test_corrupted_device_bytes_are_a_miss_never_data(daemon):
    ns = Namespace("direct-corrupt", LAYOUT)
    tokens = list(range(300, 300 + 16 * 4))
    kv = make_kv(len(tokens), seed=2)
    dmap = device_map_of(daemon)
    with KVCache(ns, daemon.data_addr, hot_pool_bytes=0, device_map=dmap, transport="direct") as cache:
        cache.store(tokens, kv)
        client = cache._warm.daemons[0].client
        client.flush()
        keys = cache.keys_for(tokens)
        _, locs = client.lookup_locations(keys)
        # flip bytes of block 2's payload on the device, behind the daemon's back
        geom = client.geometry()
        dev, dev_off, _ = geom.map_range(locs[2].logical_offset + 100, 1)[0]
        with open(dmap[geom.device_ids[dev]], "r+b") as f:
            f.seek(dev_off)
            f.write(b"\xa5" * 8)
        loaded = cache.load(tokens)
        # blocks 0 and 1 directly; block 2 fails validation and TCP falls back: the flush wrote the
        # open region in place, so the daemon still holds it in memory and serves the good copy
        assert loaded.num_tokens == 64 and same_prefix(loaded.layers, kv, 64)
        stats = cache.statistics()
        assert stats.warm.fallbacks >= 1
        assert cache._warm.daemons[0].reader.statistics().validation_failures >= 1


def test_recycled_region_is_detected_and_tcp_serves_the_block(tmp_path):
    """A LOOKUP answer goes stale: the region is reclaimed and reused, the
    block is written again elsewhere. The direct read at the old location
    finds other bytes, rejects them, and TCP serves the current copy."""
    small = start_kvtierd(tmp_path / "small", "--device-size", "4m", "--region-size", "1m",
                          "--stripe-size", "256k")
    try:
        ns = Namespace("direct-recycle", LAYOUT)
        tokens = list(range(500, 500 + 16 * 3))
        kv = make_kv(len(tokens), seed=3)
        dmap = device_map_of(small)
        with KVCache(ns, small.data_addr, hot_pool_bytes=0, device_map=dmap, transport="direct") as cache:
            client = cache._warm.daemons[0].client
            keys = cache.keys_for(tokens)
            cache.store(tokens, kv)
            client.flush()
            stale = client.lookup_locations(keys)
            assert stale[0] == 3 and all(loc.sealed for loc in stale[1])
            # fill the store until the first region is reclaimed and reused
            filler = bytes(60_000)
            geom = client.geometry()
            for i in range(4 * geom.logical_size_bytes // len(filler)):
                key = (10**6 + i).to_bytes(16, "little")
                client.put(key, encode_block(key, ns.id, 0, filler))
                if i % 16 == 0 and client.lookup(keys[:1]) == 0:
                    break
            assert client.lookup(keys[:1]) == 0, "the daemon never reclaimed the first region"
            for j in range(64):  # make sure the reclaimed space is written over
                key = (2 * 10**6 + j).to_bytes(16, "little")
                client.put(key, encode_block(key, ns.id, 0, filler))
            client.flush()
            # the block is written again (a fresh location, a fresh sequence)
            cache.store(tokens, kv)
            # the race: this load uses the LOOKUP answer from before the reclaim
            client.lookup_locations = lambda ks, ns_id=None: (len(ks), stale[1][:len(ks)])
            loaded = cache.load(tokens)
            assert loaded.num_tokens == len(tokens) and same_prefix(loaded.layers, kv, len(tokens))
            assert loaded.transports == {"tcp": 3}
            stats = cache.statistics()
            assert stats.warm.fallbacks == 3
            assert cache._warm.daemons[0].reader.statistics().validation_failures == 3
    finally:
        assert small.stop() == 0, small.log_tail()


def test_a_failing_direct_read_falls_back_to_tcp(daemon, tmp_path):
    """Device paths that end where the data begins (a detached or shrunken
    namespace): every direct read fails with an I/O error, and the blocks come
    by TCP instead - the load neither fails nor hands over anything unverified."""
    ns = Namespace("direct-failing", LAYOUT)
    tokens = list(range(900, 900 + 16 * 6))
    kv = make_kv(len(tokens), seed=7)
    with KVCache(ns, daemon.data_addr, hot_pool_bytes=0) as plain:
        assert plain.store(tokens, kv) == 6
        plain.flush()
        data_offset = plain._warm.daemons[0].client.geometry().data_offset_bytes
    stubs = {}
    for dev, path in device_map_of(daemon).items():
        stub = tmp_path / f"{dev}.img"
        with open(path, "rb") as src, open(stub, "wb") as dst:
            dst.write(src.read(data_offset))
        stubs[dev] = str(stub)
    with KVCache(ns, daemon.data_addr, hot_pool_bytes=0, device_map=stubs, transport="direct") as cache:
        got = cache.load(tokens)
        assert got.num_tokens == len(tokens) and got.transports == {"tcp": 6}
        assert same_prefix(got.layers, kv, len(tokens))
        assert cache.statistics().warm.fallbacks == 6
