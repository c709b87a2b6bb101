"""A region found open at restart whose summary the device refused is served read-only, and
its last page still holds the trailer of its previous use: what reads its summary (a namespace
delete, reclaim) must not take that trailer for this use's."""
from __future__ import annotations

from kvtier.daemon.engine import Engine
from kvtier.daemon.engine.devices import FaultyDevice

from test_engine import NS, PAYLOAD_5_PER_REGION, block, key, mem_engine


def reused_open_region_with_a_durable_block():
    """An engine whose open region is one used and sealed before, holding one durable block."""
    engine, cfg, devs = mem_engine(regions=6)
    used, i = set(), 0
    while True:
        engine.put(block(i, PAYLOAD_5_PER_REGION))
        i += 1
        region = engine._allocator.open.region
        if region in used and engine._allocator.open.entry_count == 1:
            break
        used.add(region)
    engine.put(block(10_000, 1000), durable=True)
    return cfg, devs


def reopened_refusing_writes(cfg, devs) -> Engine:
    """Restart after a crash on devices that refuse the recovered region's summary write."""
    faulty = [FaultyDevice(d) for d in devs]
    for d in faulty:
        d.fail_writes = True
    engine = Engine.open(cfg, devices=faulty)
    for d in faulty:
        d.fail_writes = False
    return engine


def test_a_namespace_delete_reaches_the_blocks_of_a_region_recovered_without_its_summary():
    cfg, devs = reused_open_region_with_a_durable_block()
    engine = reopened_refusing_writes(cfg, devs)
    assert engine.lookup([key(10_000)]) == 1
    engine.delete_namespace(NS)
    assert engine.lookup([key(10_000)]) == 0
    assert engine.statistics().blocks == 0


def test_the_summary_read_for_reclaim_is_this_uses_not_the_previous_ones():
    from kvtier.daemon.engine import regionfmt as fmt
    from kvtier.daemon.engine.recovery import read_region_entries

    cfg, devs = reused_open_region_with_a_durable_block()
    engine = reopened_refusing_writes(cfg, devs)
    location = engine.locate_many([key(10_000)])[0]
    region = location.logical_offset // engine.region_size_bytes
    entries = read_region_entries(engine._array, region, engine.region_size_bytes, int(engine._table.base_seq[region]))
    k0, k1 = fmt.keys_to_halves([key(10_000)])
    assert ((entries["k0"] == k0[0]) & (entries["k1"] == k1[0]) & (entries["seq"] == location.seq)).sum() == 1
