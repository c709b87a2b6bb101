"""The client's side of a NIXL_PUT the daemon gave up on: the memory it pointed at stays mapped.

Over UCX TCP the daemon's READ of a client's memory is served by the client's own agent when it
next progresses. A client that gave the memory of a failed PUT back to its caller, who freed it,
crashed (SIGSEGV) at its next NIXL request: tests/nixl_held_put_child.py is that client.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nixl_cu12._api", reason="NIXL is not installed (pip install 'kvtier[nixl]')")

from nixl_daemon import LOOPBACK_ENV  # noqa: E402
from test_nixl_transport import NS, put_blocks, start_nixl_daemon  # noqa: E402
from kvtier.client import BlockClient  # noqa: E402
from kvtier.client.nixl_held import HELD_PUT_BYTES_MAX, HeldPutMemory, may_have_posted  # noqa: E402
from kvtier.wire import events as m  # noqa: E402

CHILD_TIMEOUT_S = 120.0  # the daemon's TRANSFER_TIMEOUT_S (5 s), a drain of 3 s, and room on a loaded machine


@pytest.fixture
def daemon(tmp_path):
    d = start_nixl_daemon(tmp_path / "kvtierd", "--nixl-tls", "self,tcp")
    yield d
    assert d.stop() == 0, d.log_tail()


@pytest.mark.slow  # waits out a NIXL timeout or bound
def test_the_memory_of_a_put_read_given_up_on_stays_mapped_until_that_read_is_served(daemon):
    warm_keys, _, warm = put_blocks(daemon.data_addr, 1, 10_000, seed=0x61)
    key = bytes([0x62]) * 16
    child = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("nixl_held_put_child.py")), daemon.data_addr, NS.hex(),
         key.hex(), str((8 << 20) - 64), warm_keys[0].hex(), str(warm[0].length), str(warm[0].seq)],
        capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env={**os.environ, **LOOPBACK_ENV})
    out = child.stdout
    assert child.returncode == 0, f"the client died ({child.returncode}): {out}\n{child.stderr[-2000:]}"
    assert "failed" in out and "TIMEOUT" in out, out  # the daemon gave the READ up
    assert "held" in out and "freed" not in out, out  # its memory could not be unmapped under the READ
    assert "drained puts_held=1" in out, out
    with BlockClient(daemon.data_addr) as client:
        assert client.get(key) is None  # the PUT that answered an error stored nothing
        assert client.stats()["nixl"]["parked_now"] == 0  # the late READ was served and ended


def test_only_failures_after_the_daemon_may_have_posted_hold_memory():
    assert may_have_posted(m.RemoteError(m.ErrorCode.TIMEOUT, "READ timed out"))
    assert may_have_posted(m.RemoteError(m.ErrorCode.INTERNAL, "transfer failed"))
    assert may_have_posted(RuntimeError("a NIXL error while waiting"))
    assert may_have_posted(m.ConnectionLost("the daemon closed the connection"))
    for refused in (m.ErrorCode.BUSY, m.ErrorCode.LIMIT, m.ErrorCode.BAD_REQUEST, m.ErrorCode.BAD_BLOCK):
        assert not may_have_posted(m.RemoteError(refused, "refused"))


def test_held_memory_is_referenced_and_bounded():
    held = HeldPutMemory(bytes_max=3 << 20)
    piece = bytearray(2 << 20)
    held.hold([memoryview(piece), b"header"])
    with pytest.raises(BufferError):
        piece.clear()  # still exported: the memory cannot go while the READ may read it
    assert (held.puts, held.nbytes, held.puts_stopped) == (1, (2 << 20) + 6, False)
    held.hold([memoryview(bytearray(1 << 20))])
    assert held.puts_stopped  # past the bound this process PUTs over TCP
    assert HeldPutMemory().bytes_max == HELD_PUT_BYTES_MAX
