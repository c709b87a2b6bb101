"""A PUT that is a copy (read-repair, re-replication: FLAG_SKIP_DELETED) does not bring back a key
the daemon deleted lately; a client's own PUT of that key stores it as always. The engine, the frame
and a real kvtierd."""
from __future__ import annotations

import struct
import urllib.request

from daemon_proc import start_kvtierd
from kvtier.client import BlockClient
from kvtier.wire import connection as p
from kvtier.wire import frames as f

from test_engine import block, key, mem_engine, present, same_block

FLAGS_AT = 6  # the frame header's u16 flags


def test_the_engine_skips_a_key_deleted_lately_only_when_asked():
    engine, _, _ = mem_engine()
    engine.put_many([block(1), block(2)])
    assert engine.delete_many([key(1)]) == [True]
    seqs = engine.put_many([block(1), block(2), block(3)], skip_deleted=True)
    assert seqs[0] == 0 and seqs[1] > 0 and seqs[2] > 0
    assert present(engine, (1, 2, 3)) == [2, 3]
    assert engine.statistics().puts_skipped_deleted == 1
    (seq,) = engine.put_many([block(1)])  # the engine's own client stores it again
    assert seq > 0 and present(engine, (1,)) == [1]
    assert engine.put_many([block(1)], skip_deleted=True)[0] == seq  # stored since: no longer deleted here
    engine.close()


def test_a_skip_deleted_put_crosses_the_wire_with_its_flag():
    msg = p.Put(9, (key(1),), (block(1),), False, None, skip_deleted=True)
    wire = p.Connection(p.Role.CLIENT).send(msg)
    assert struct.unpack_from("<H", wire, FLAGS_AT)[0] == f.FLAG_SKIP_DELETED
    server = p.Connection(p.Role.SERVER)
    server.receive_data(wire)
    event = server.next_event()
    assert isinstance(event, p.Put) and event.skip_deleted and bytes(event.blocks[0]) == block(1)


def test_a_daemon_declines_a_repair_of_a_key_it_deleted_and_serves_everyone_else(tmp_path):
    daemon = start_kvtierd(tmp_path, admin="127.0.0.1:0")
    try:
        with BlockClient(daemon.data_addr) as client:
            assert p.FEATURE_PUT_SKIP_DELETED in client.server_info()["features"]
            client.put_many([(key(i), block(i)) for i in (1, 2)])
            assert client.delete_many([key(1)]) == [True]
            seqs = client.put_many([(key(i), block(i)) for i in (1, 2, 3)], repair=True)
            assert seqs[0] == 0 and min(seqs[1:]) > 0
            assert [b is not None for b in client.get_many([key(i) for i in (1, 2, 3)])] == [False, True, True]
            assert client.stats()["engine"]["puts_skipped_deleted"] == 1
        with urllib.request.urlopen(f"http://{daemon.admin_addr}/metrics", timeout=10) as reply:
            assert "kvtier_puts_skipped_deleted_total 1.0" in reply.read().decode()
        with BlockClient(daemon.data_addr) as client:
            assert client.put_many([(key(1), block(1))])[0] > 0
            assert same_block(client.get(key(1)), block(1))
    finally:
        assert daemon.stop() == 0, daemon.log_tail()
