"""Repair at open of a store left with no clean region (rescue.py, RegionManager.repair_at_open).

A store wedged as older versions left it -- every region sealed, each holding a pinned block, no
clean region for the reclaim worker to move them into -- serves durable PUTs again after one
restart: the sealed region with the fewest pinned bytes is compacted in place, its pinned blocks
and records kept in a journal beside the store while it is freed and opened again. A crash in the
middle leaves the journal, and the next open finishes the job; no pinned block is lost."""
from __future__ import annotations

import pytest

from kvtier.daemon.engine import Engine, NoSpaceError
from kvtier.daemon.engine import region_manager
from kvtier.daemon.engine.durability import Durability
from kvtier.daemon.engine.rescue import JOURNAL_NAME, Rescue, RescueFormatError, decode_rescue, encode_rescue

from test_engine import PAYLOAD_5_PER_REGION, block, key, mem_engine, present, same_block
from test_engine_atomic import crash_copy

PIN_PAYLOAD = 20_000


def wedged_store(tmp_path, monkeypatch):
    """A store as the landed code wedged it: writers took the reserve (RESERVE_REGIONS 0 then), every
    region holds a pinned block, and PUTs that need a new region are refused."""
    with monkeypatch.context() as old_code:
        old_code.setattr(region_manager, "RESERVE_REGIONS", 0)
        engine, cfg, devs = mem_engine(regions=6, pinned_fraction_max=1.0, rescue_dir=str(tmp_path))
        pinned, i = [], 0
        try:
            while True:
                engine.put_many([block(10_000 + i, PIN_PAYLOAD)], durable=True)
                engine.pin_many([key(10_000 + i)])
                pinned.append(10_000 + i)
                engine.put_many([block(i * 4 + j, PAYLOAD_5_PER_REGION) for j in range(4)])
                i += 1
                assert i < 100, "the old code never wedged"
        except NoSpaceError:
            pass
        with pytest.raises(NoSpaceError):
            for j in range(10):
                engine.put_many([block(90_000 + j, PAYLOAD_5_PER_REGION)], durable=True)
        with engine._lock:
            assert engine._table.free_count == 0
    pinned = [p for p in pinned if engine.block_info(key(p)) is not None]
    engine.close()
    return cfg, devs, pinned


def test_a_wedged_store_serves_durable_puts_after_one_restart(tmp_path, monkeypatch):
    cfg, devs, pinned = wedged_store(tmp_path, monkeypatch)
    assert pinned
    engine = Engine.open(cfg, devices=devs)
    try:
        assert engine.statistics().rescues == 1 and not (tmp_path / JOURNAL_NAME).exists()
        for j in range(60):  # several times the store: every region is reclaimed again
            engine.put_many([block(50_000 + j, PAYLOAD_5_PER_REGION)], durable=True)
        assert present(engine, pinned) == pinned
        assert all(same_block(engine.get(key(p)), block(p, PIN_PAYLOAD)) for p in pinned)
        assert all(engine.block_info(key(p))["pinned"] for p in pinned)
    finally:
        engine.close()
    again = Engine.open(cfg, devices=devs)  # and it lasts
    assert present(again, pinned) == pinned and again.statistics().rescues == 0
    again.close()


@pytest.mark.parametrize("crash_at", ["commit", "journal_removal"])
def test_a_crash_during_the_rescue_is_finished_at_the_next_open(tmp_path, monkeypatch, crash_at):
    cfg, devs, pinned = wedged_store(tmp_path, monkeypatch)

    def crash(*args, **kwargs):
        raise RuntimeError("power cut")
    with monkeypatch.context() as cut:
        if crash_at == "commit":
            cut.setattr(Durability, "commit", crash)
        else:
            cut.setattr(region_manager.RescueJournal, "remove", crash)
        with pytest.raises(RuntimeError, match="power cut"):
            Engine.open(cfg, devices=devs)
    assert (tmp_path / JOURNAL_NAME).exists()
    engine = Engine.open(cfg, devices=crash_copy(devs))
    try:
        assert engine.statistics().rescues == 1 and not (tmp_path / JOURNAL_NAME).exists()
        assert present(engine, pinned) == pinned
        assert all(same_block(engine.get(key(p)), block(p, PIN_PAYLOAD)) for p in pinned)
        for j in range(30):
            engine.put_many([block(60_000 + j, PAYLOAD_5_PER_REGION)], durable=True)
        assert present(engine, pinned) == pinned
    finally:
        engine.close()


def test_the_journal_format_round_trips_and_refuses_what_is_torn():
    rescue = Rescue(3, 77, [(b"x" * 100, True), (b"y" * 5, False)], [(2, 1, 2, bytes(16), 9)])
    data = encode_rescue(rescue)
    assert decode_rescue(data) == rescue
    for bad, why in ((data[:-1], "CRC"), (b"XXXX" + data[4:], "magic"), (data[:10], "shorter")):
        with pytest.raises(RescueFormatError, match=why):
            decode_rescue(bad)


def test_the_daemon_keeps_the_journal_in_its_data_directory(tmp_path):
    from kvtier.daemon.config import config_from_args

    cfg = config_from_args(["--data-dir", str(tmp_path / "d"), "--device-size", "64m"])
    assert cfg.engine_config().rescue_dir == str(tmp_path / "d")
