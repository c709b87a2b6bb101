"""Soft pins (a TTL, memory only) and the pinned-bytes limit: the bookkeeping with a fake
clock, the engine on memory devices, the PIN_TTL wire form fed byte by byte, one real daemon."""
from __future__ import annotations

import asyncio
import hashlib
import json
import urllib.request

import numpy as np
import pytest

from daemon_proc import start_kvtierd
from kvtier.client import AsyncBlockClient, BlockClient, RemoteError
from kvtier.common.blockformat import encode_block
from kvtier.daemon.engine import Engine, EngineConfig, NoSpaceError
from kvtier.daemon.engine.devices import MemoryDevice
from kvtier.daemon.engine.errors import PinLimitError
from kvtier.daemon.engine.index import BlockIndex
from kvtier.daemon.engine.regionfmt import data_room_bytes
from kvtier.daemon.engine.region_manager import RESERVE_REGIONS
from kvtier.daemon.engine.no_space import REGIONS_NAMED_MAX, no_space_message
from kvtier.daemon.engine.soft_pins import SoftPins
from kvtier.daemon.engine.superblock import DATA_OFFSET_BYTES
from kvtier.wire import connection as p
from kvtier.wire import frames as f

MiB = 1 << 20
REGION = MiB
NS = bytes(range(16))
PAYLOAD_5_PER_REGION = 200_000  # 5 blocks fill one 1 MiB region


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def block(i: int, size: int = 1000) -> bytes:
    return encode_block(key(i), NS, 1, np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes())


def halves(i: int) -> tuple[int, int]:
    k = key(i)
    return int.from_bytes(k[:8], "little"), int.from_bytes(k[8:], "little")


def mem_engine(regions: int = 6, clock=None, **extra):
    cfg = EngineConfig(device_paths=("mem0", "mem1"), stripe_size_bytes=REGION // 4, region_size_bytes=REGION,
                       **extra)
    devs = [MemoryDevice(DATA_OFFSET_BYTES + regions * REGION // 2, f"mem{i}") for i in range(2)]
    Engine.format(cfg, devices=devs)
    engine = Engine.open(cfg, devices=devs)
    if clock is not None:
        engine.soft_pin_clock = clock
    return engine, cfg, devs


def present(engine, ids) -> list[int]:
    return [i for i in ids if engine.lookup([key(i)]) == 1]


# -- SoftPins: pure bookkeeping ----------------------------------------------
def test_soft_pins_expire_by_the_clock_and_are_dropped_lazily():
    clock = FakeClock()
    soft = SoftPins(clock)
    soft.pin([halves(1), halves(2)], ttl_s=10)
    clock.now += 5
    soft.pin([halves(3)], ttl_s=10)
    assert soft.contains(halves(1)) and soft.contains(halves(3)) and len(soft) == 3
    clock.now += 5  # 1 and 2 are due: expired as read, dropped at the next look
    assert not soft.contains(halves(1)) and soft.contains(halves(3))
    assert len(soft) == 3 and soft.expired == 0
    assert soft.expire() == 2
    assert len(soft) == 1 and soft.expired == 2
    clock.now += 5
    assert soft.expire() == 1 and len(soft) == 0


def test_soft_pin_renewal_keeps_the_later_deadline():
    clock = FakeClock()
    soft = SoftPins(clock)
    soft.pin([halves(1)], ttl_s=10)
    soft.pin([halves(1)], ttl_s=2)  # shorter: the first deadline stands
    clock.now += 5
    assert soft.expire() == 0 and soft.contains(halves(1))
    soft.pin([halves(1)], ttl_s=20)  # longer: extends it
    clock.now += 10
    assert soft.expire() == 0 and soft.contains(halves(1))
    clock.now += 10
    assert soft.expire() == 1 and not soft.contains(halves(1))


def test_soft_pins_discard_and_live_slots_against_an_index():
    clock = FakeClock()
    soft = SoftPins(clock)
    index = BlockIndex()
    slots = {i: index.insert(*halves(i), addr=i * REGION + 4096, length=1000 + i, meta=0) for i in range(4)}
    soft.pin([halves(0), halves(2), halves(9)], ttl_s=1)  # 9 is not in the index
    assert soft.live_slots(index).tolist() == sorted([slots[0], slots[2]])
    assert soft.bytes_by_region(index, REGION, 4).tolist() == [1000, 0, 1002, 0]
    assert soft.discard([halves(2), halves(3)]) == 1
    assert soft.live_slots(index).tolist() == [slots[0]]
    clock.now += 1
    assert soft.live_slots(index).tolist() == [] and soft.expired == 2


@pytest.mark.parametrize("ttl", [0, -1, float("nan"), float("inf"), True, "5", 2**33])
def test_soft_pin_ttl_is_checked(ttl):
    with pytest.raises(ValueError, match="ttl_s"):
        SoftPins().pin([halves(1)], ttl_s=ttl)


# -- the engine ------------------------------------------------------------
def test_soft_pin_keeps_a_block_through_reclaim_until_it_expires():
    clock = FakeClock()
    engine, _, _ = mem_engine(regions=4, clock=clock)
    for i in range(5):  # region 0, full
        engine.put(block(i, PAYLOAD_5_PER_REGION))
    assert engine.pin_many([key(1), key(99)], ttl_s=60) == [True, False]
    info = engine.block_info(key(1))
    assert info["pinned"] and info["soft_pinned"]
    st = engine.statistics()
    assert st.soft_pins == 1 and st.soft_pinned_bytes == st.pinned_bytes == len(block(1, PAYLOAD_5_PER_REGION))
    for i in range(5, 25):  # four more regions' worth: region 0 is reclaimed (and again)
        engine.put(block(i, PAYLOAD_5_PER_REGION))
    assert engine.statistics().evicted_regions >= 2
    assert 0 not in present(engine, range(5)) and 1 in present(engine, range(5))
    assert engine.get(key(1))[64:] == block(1, PAYLOAD_5_PER_REGION)[64:]
    clock.now += 61  # expired: the next reclaim of its region drops it
    for i in range(25, 45):
        engine.put(block(i, PAYLOAD_5_PER_REGION))
    assert 1 not in present(engine, range(5))
    st = engine.statistics()
    assert st.soft_pins == 0 and st.soft_pins_expired == 1 and st.pinned_bytes == 0
    engine.close()


def test_soft_pins_do_not_survive_a_restart_and_write_no_record():
    clock = FakeClock()
    engine, cfg, devs = mem_engine(regions=4, clock=clock)
    for i in range(5):
        engine.put(block(i, PAYLOAD_5_PER_REGION))
    engine.pin_many([key(2)], ttl_s=3600)
    for i in range(5, 12):  # region 0 reclaimed: key 2 moved (as unpinned on flash)
        engine.put(block(i, PAYLOAD_5_PER_REGION))
    assert engine.block_info(key(2))["soft_pinned"]
    engine.close()
    engine = Engine.open(cfg, devices=devs)
    info = engine.block_info(key(2))
    assert info is not None and not info["pinned"] and not info["soft_pinned"]
    assert engine.statistics().pinned_bytes == 0
    engine.close()


def test_hard_pin_on_a_soft_pinned_block_makes_it_hard_and_soft_on_hard_changes_nothing():
    clock = FakeClock()
    engine, cfg, devs = mem_engine(clock=clock)
    for i in range(3):
        engine.put(block(i))
    engine.pin_many([key(0)], ttl_s=5)
    assert engine.pin_many([key(0)]) == [True]  # hard now
    assert engine.block_info(key(0))["pinned"] and not engine.block_info(key(0))["soft_pinned"]
    engine.pin_many([key(1)])
    engine.pin_many([key(1)], ttl_s=5)  # stays hard, no soft entry
    clock.now += 10
    st = engine.statistics()
    assert st.soft_pins == 0 and st.soft_pinned_bytes == 0 and st.pinned_bytes == 2 * len(block(0))
    engine.close()
    engine = Engine.open(cfg, devices=devs)  # both hard pins were made durable
    assert engine.block_info(key(0))["pinned"] and engine.block_info(key(1))["pinned"]
    engine.close()


def test_unpin_drops_soft_pins_and_delete_forgets_them():
    clock = FakeClock()
    engine, _, _ = mem_engine(clock=clock)
    for i in range(3):
        engine.put(block(i))
    engine.pin_many([key(0), key(1)], ttl_s=30)
    assert engine.unpin_many([key(0)]) == [True]
    assert engine.delete_many([key(1)]) == [True]
    engine.put(block(1))  # the same key stored again is not soft-pinned
    assert not engine.block_info(key(0))["pinned"] and not engine.block_info(key(1))["pinned"]
    assert engine.statistics().soft_pins == 0
    engine.close()


def test_soft_pin_with_a_bad_ttl_is_refused_and_pins_nothing():
    engine, _, _ = mem_engine()
    engine.put(block(0))
    for ttl in (0, -2, float("nan")):
        with pytest.raises(ValueError, match="ttl_s"):
            engine.pin_many([key(0)], ttl_s=ttl)
    assert not engine.block_info(key(0))["pinned"]
    engine.close()


def test_pin_past_the_limit_is_refused_naming_it_and_changes_nothing():
    clock = FakeClock()
    engine, cfg, devs = mem_engine(regions=6, clock=clock, pinned_fraction_max=0.25)
    limit = engine.statistics().pinned_bytes_max
    assert limit == int(0.25 * (6 - RESERVE_REGIONS) * data_room_bytes(REGION))  # of the regions that hold blocks
    size = PAYLOAD_5_PER_REGION
    for i in range(10):
        engine.put(block(i, size))
    each = len(block(0, size))
    fit = limit // each
    engine.pin_many([key(i) for i in range(fit - 1)])  # hard
    engine.pin_many([key(fit - 1)], ttl_s=60)  # soft pins count too
    with pytest.raises(PinLimitError, match=r"pinned_bytes_max=\d+ \(pinned_fraction_max=0.25") as info:
        engine.pin_many([key(fit), key(fit + 1)])  # a hard pin past the limit: refused whole
    assert f"pinned now: {fit * each} bytes ({(fit - 1) * each} hard, {each} soft)" in str(info.value)
    with pytest.raises(NoSpaceError, match="pin refused"):  # a soft one too
        engine.pin_many([key(fit)], ttl_s=5)
    assert not engine.block_info(key(fit))["pinned"] and not engine.block_info(key(fit + 1))["pinned"]
    st = engine.statistics()
    assert st.pins_refused == 2 and st.pinned_bytes == fit * each
    assert engine.pin_many([key(0)]) == [True]  # already pinned: adds nothing, allowed
    engine.close()
    engine = Engine.open(cfg, devices=devs)  # the refused hard pin wrote no record
    assert not engine.block_info(key(fit))["pinned"] and not engine.block_info(key(fit + 1))["pinned"]
    assert engine.block_info(key(0))["pinned"]
    engine.close()


def test_a_store_full_of_pins_refuses_pins_never_puts():
    engine, _, _ = mem_engine(regions=4)  # the default limit: half the capacity
    size = PAYLOAD_5_PER_REGION
    pinned = []
    for i in range(200):  # 10x the capacity, pinning every block it lets us
        engine.put(block(i, size))  # never refused
        try:
            engine.pin_many([key(i)])
            pinned.append(i)
        except PinLimitError:
            pass
    st = engine.statistics()
    assert st.pins_refused > 0 and st.pinned_bytes <= st.pinned_bytes_max
    assert present(engine, pinned) == pinned  # every pin granted held
    assert st.puts == 200
    engine.close()


def test_no_space_message_names_each_reason_once():
    causes = {"pinned blocks unreadable (device errors)": list(range(100)), "no room to stage": [7]}
    text = no_space_message(causes, 101, 4096, 1 << 30)
    assert text.count("unreadable") == 1 and text.count("no room to stage") == 1
    assert "100 regions (0, 1, 2, 3, 4, 5, 6, 7, ... (92 more))" in text and "1 region (7)" in text
    assert "pinned bytes: 4096 of 1073741824" in text and len(text) < 400
    assert REGIONS_NAMED_MAX == 8


# -- the wire form, no sockets -------------------------------------------------
K1, K2 = b"\x01" * 16, b"\x02" * 16


@pytest.mark.parametrize("ns", [None, b"\x07" * 16])
def test_pin_ttl_frame_round_trips_byte_by_byte(ns):
    client, server = p.Connection(p.Role.CLIENT), p.Connection(p.Role.SERVER)
    requests = [p.Pin(5, (K1, K2), ns, ttl_ms=1500), p.Pin(6, (K2,), ns)]
    wire = b"".join(client.send(r) for r in requests)
    events = []
    for i in range(len(wire)):
        server.receive_data(wire[i:i + 1])
        while (ev := server.next_event()) is not p.NEED_DATA:
            events.append(ev)
    assert events == requests
    head = f.FRAME_HEADER.unpack_from(wire)
    assert head[3] & f.FLAG_PIN_TTL and head[6] == (16 if ns else 0) + 4 + 32  # meta: [ns] u32 ttl_ms, keys
    assert wire[f.FRAME_HEADER_SIZE + (16 if ns else 0):][:4] == (1500).to_bytes(4, "little")


def test_pin_ttl_frame_without_a_ttl_or_with_zero_is_refused_naming_it():
    for meta, why in ((b"\x00\x00", "holds no ttl_ms"), ((0).to_bytes(4, "little") + K1, "ttl_ms is 0")):
        server = p.Connection(p.Role.SERVER)
        count = 0 if len(meta) < 4 else 1
        server.receive_data(f.pack_header(p.Op.HELLO, 0, 1, 0, 4, 0) + b"\x00\x00\x00\x00")
        assert isinstance(server.next_event(), p.Hello)
        server.send(p.HelloReply(1, {}))
        server.receive_data(f.pack_header(p.Op.PIN, f.FLAG_PIN_TTL, 2, count, len(meta), 0) + meta)
        ev = server.next_event()
        assert isinstance(ev, p.Rejected) and ev.code == p.ErrorCode.BAD_REQUEST and why in ev.message


def test_pin_ttl_is_checked_when_sent():
    with pytest.raises(ValueError, match="ttl_ms"):
        p.Connection(p.Role.CLIENT).send(p.Pin(1, (K1,), ttl_ms=0))


# -- one real daemon -------------------------------------------------------------
def test_daemon_soft_pins_limit_and_metrics(tmp_path):
    d = start_kvtierd(tmp_path / "d", "--pinned-fraction-max", "0.01", admin="127.0.0.1:0")
    try:
        with BlockClient(d.data_addr) as c:
            assert "pin_ttl" in c.server_info()["features"]
            blocks = [block(i, 100_000) for i in range(40)]
            c.put_many(zip([key(i) for i in range(40)], blocks))
            assert c.pin([key(0), key(99)], ttl_s=30) == [True, False]
            with pytest.raises(ValueError, match="ttl_s"):
                c.pin([key(0)], ttl_s=-1)
            engine = c.stats()["engine"]
            assert engine["soft_pins"] == 1 and engine["soft_pinned_bytes"] == len(blocks[0])
            limit = engine["pinned_bytes_max"]  # 1% of 256 MiB: about 26 blocks of 100 kB
            with pytest.raises(RemoteError, match="pinned_bytes_max") as info:
                c.pin([key(i) for i in range(40)])
            assert info.value.code == p.ErrorCode.NO_SPACE and "no space: no space" not in str(info.value)
            assert c.stats()["engine"]["pinned_bytes"] == len(blocks[0]) <= limit
            c.put(key(50), block(50))  # PUTs go on

        async def soft_pin_async():
            async with AsyncBlockClient(d.data_addr) as ac:
                return await ac.pin([key(2)], ttl_s=30)
        assert asyncio.run(soft_pin_async()) == [True]
        with BlockClient(d.data_addr) as c:
            assert c.unpin([key(2)]) == [True]  # a soft pin dropped
        status, doc = _post(d.admin_addr, "/v1/pin", {"keys": [key(1).hex()], "ttl_s": 30})
        assert status == 200 and doc["pinned"] == 1
        status, doc = _post(d.admin_addr, "/v1/pin", {"keys": [key(i).hex() for i in range(40)]})
        assert status == 507 and "pinned_bytes_max" in doc["message"]
        status, doc = _post(d.admin_addr, "/v1/pin", {"keys": [key(1).hex()], "ttl_s": 0})
        assert status == 422
        with urllib.request.urlopen(f"http://{d.admin_addr}/v1/blocks/{key(1).hex()}") as resp:
            assert json.load(resp)["soft_pinned"] is True
        with urllib.request.urlopen(f"http://{d.admin_addr}/metrics") as resp:
            metrics = resp.read().decode()
        values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                  if line and not line.startswith("#")}
        assert values["kvtier_pins_refused_total"] == 2
        assert values["kvtier_soft_pinned_bytes"] == values["kvtier_pinned_bytes"] == 2 * len(blocks[0])
        assert values["kvtier_pinned_bytes_max"] == limit
    finally:
        assert d.stop() == 0, d.log_tail()


def _post(addr: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://{addr}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)
