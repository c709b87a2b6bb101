"""The pinned-bytes limit is checked against what pins cost the cache: their bytes in a region a
reclaim can still compact, the whole room of a region pinned past half its room (it is never
reclaimed, so its unpinned rest is lost to the cache as well)."""
from __future__ import annotations

import pytest

from kvtier.daemon.engine import NoSpaceError
from kvtier.daemon.engine.errors import PinLimitError

from test_engine import PAYLOAD_5_PER_REGION, block, key, mem_engine, seal


def test_a_region_pinned_past_half_its_room_costs_all_of_it():
    engine, _, _ = mem_engine(regions=6, pinned_fraction_max=0.25)
    try:
        room = engine._table.region_capacity_bytes
        limit = engine.statistics().pinned_bytes_max
        assert room < limit < 1.5 * room
        first = list(range(5))  # one region's worth: five blocks
        engine.put_many([block(i, PAYLOAD_5_PER_REGION) for i in first])
        seal(engine)
        second = list(range(5, 10))
        engine.put_many([block(i, PAYLOAD_5_PER_REGION) for i in second])
        seal(engine)
        assert engine.pin_many([key(i) for i in first[:3]]) == [True] * 3  # 3/5 of a region: never reclaimed
        stats = engine.statistics()
        assert stats.pinned_cost_bytes == room and stats.pinned_bytes < room
        assert engine.pin_many([key(second[0])]) == [True]  # a compactable region: its bytes
        with pytest.raises(PinLimitError, match="what pins cost the cache") as refused:
            engine.pin_many([key(second[1])])  # bytes: 5 blocks, under the limit; cost: a room and 2 blocks, over
        assert isinstance(refused.value, NoSpaceError)
        assert engine.statistics().pinned_bytes + PAYLOAD_5_PER_REGION < limit
        assert not engine.block_info(key(second[1]))["pinned"]
    finally:
        engine.close()
