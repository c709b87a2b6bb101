"""The keys a node deleted lately (daemon/engine/deleted_keys.py): bounds, expiry and paging
(pure, a fake clock), and the engine's bookkeeping of them: a DELETE or delete_namespace that
succeeded records its keys, a key stored again leaves, a failed delete records nothing."""
from __future__ import annotations

import numpy as np
import pytest

from kvtier.daemon.engine.deleted_keys import DeletedKeys
from kvtier.daemon.engine.errors import DeviceError

from test_engine import NS, block, key, mem_engine
from test_engine_atomic import faulty_engine


def halves(*ids: int) -> tuple[np.ndarray, np.ndarray]:
    pairs = np.frombuffer(b"".join(key(i) for i in ids), "<u8").reshape(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def listed(raw: bytes) -> list[bytes]:
    return [raw[i:i + 16] for i in range(0, len(raw), 16)]


def all_pages(deleted, limit: int) -> tuple[list[bytes], int]:
    out, cursor, pages = [], 0, 0
    while True:
        raw, cursor = deleted.page(cursor, limit)
        out += listed(raw)
        pages += 1
        if not cursor:
            return out, pages


def test_keys_are_kept_oldest_first_up_to_the_bound_and_for_the_age():
    now = [100.0]
    deleted = DeletedKeys(keys_max=3, age_s=10.0, clock=lambda: now[0])
    deleted.record(*halves(1, 2))
    now[0] = 105.0
    deleted.record(*halves(3, 1))  # 1 again: it moves to the newest
    assert all_pages(deleted, 10)[0] == [key(2), key(3), key(1)]
    deleted.record(*halves(4))  # past the bound: the oldest delete goes
    assert all_pages(deleted, 2) == ([key(3), key(1), key(4)], 2)
    deleted.forget(*halves(1, 9))
    assert all_pages(deleted, 10)[0] == [key(3), key(4)]
    now[0] = 115.5  # 3 was deleted at 105, 4 at 105 too: both older than 10 s
    assert all_pages(deleted, 10) == ([], 1) and len(deleted) == 0
    with pytest.raises(ValueError, match="cursor -1 and limit 1"):
        deleted.page(-1, 1)


def test_the_engine_records_what_a_delete_named_and_forgets_a_key_stored_again():
    engine, _, _ = mem_engine()
    try:
        for i in range(6):
            engine.put(block(i))
        assert engine.delete_many([key(1), key(2), key(50)]) == [True, True, False]
        raw, cursor = engine.deleted_keys_page(0, 100)
        assert listed(raw) == [key(1), key(2), key(50)] and cursor == 0  # absent ones too: a replica may hold them
        engine.put(block(2))
        assert listed(engine.deleted_keys_page(0, 100)[0]) == [key(1), key(50)]
        assert engine.delete_namespace(NS) == 5
        assert set(listed(engine.deleted_keys_page(0, 100)[0])) == {key(i) for i in (0, 1, 2, 3, 4, 5, 50)}
        engine.delete_all()
        assert engine.deleted_keys_page(0, 100) == (b"", 0)  # a local reset: the cluster refills this node
    finally:
        engine.close()


def test_a_delete_that_failed_records_nothing():
    engine, _, devs = faulty_engine()
    try:
        for dev in devs:
            dev.fail_syncs = True
        with pytest.raises(DeviceError, match="injected"):
            engine.delete_many([key(2)])
        assert engine.deleted_keys_page(0, 100) == (b"", 0)
        for dev in devs:
            dev.fail_syncs = False
        assert engine.delete_many([key(2)]) == [True]
        assert listed(engine.deleted_keys_page(0, 100)[0]) == [key(2)]
    finally:
        engine.close()
