"""Bad input sent to a real kvtierd over raw sockets: each gets a clear error,
the daemon keeps serving every other client, and nothing stored is lost."""
import os
import select
import socket
import struct
import subprocess
import sys
import time

import pytest

from daemon_proc import start_kvtierd
from kvtier.client import BlockClient, RemoteError
from kvtier.wire import connection as p
from kvtier.wire import frames as f
from kvtier.common.blockformat import HEADER_SIZE, encode_block

NS = b"\x05" * 16
KEEP_KEYS = [bytes([0xEE]) + i.to_bytes(15, "little") for i in range(4)]
KEEP_BLOCKS = [encode_block(k, NS, 0, os.urandom(4000)) for k in KEEP_KEYS]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_kvtierd(tmp_path_factory.mktemp("bad"), "--frame-timeout", "1", "--max-connections", "8")
    with BlockClient(d.data_addr) as c:
        c.put_many(list(zip(KEEP_KEYS, KEEP_BLOCKS)))
    yield d
    assert d.stop() == 0, d.log_tail()


def raw(daemon, hello: bool = True, token: str = "") -> socket.socket:
    """A raw connection; past its HELLO unless ``hello`` is False (HELLO must come first)."""
    host, _, port = daemon.data_addr.rpartition(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    if hello:
        s.sendall(p.Connection(p.Role.CLIENT).send(p.Hello(1, "raw-test", token)))
        (reply,) = read_replies(s)
        assert isinstance(reply, p.HelloReply), reply
    return s


def read_replies(sock, n=1):
    """The next ``n`` replies (ErrorReply or others), or fewer if the daemon closes."""
    conn = p.Connection(p.Role.CLIENT, check_replies=False)  # replies to raw frames this connection did not send
    out = []
    while len(out) < n:
        ev = conn.next_event()
        if ev is p.NEED_DATA:
            conn.receive_data(sock.recv(65536))
            continue
        if ev is p.CONNECTION_CLOSED:
            break
        out.append(ev)
    return out


def closed_by_daemon(sock) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def assert_still_serving(daemon):
    with BlockClient(daemon.data_addr) as c:
        got = c.get_many(KEEP_KEYS)
        assert [g[HEADER_SIZE:] for g in got] == [b[HEADER_SIZE:] for b in KEEP_BLOCKS]


def frame(op, rid=1, count=0, meta=b"", payload=b"", flags=0, version=p.PROTOCOL_VERSION, magic=f.MAGIC):
    return f.pack_header(op, flags, rid, count, len(meta), len(payload), version=version, magic=magic) + meta + payload


@pytest.mark.parametrize("wire, code, fragment", [
    (bytes(range(200, 216)) + b"garbage" * 10, p.ErrorCode.BAD_FRAME, "magic"),
    (frame(p.Op.PING, magic=b"HTTP"), p.ErrorCode.BAD_FRAME, "magic"),
    (frame(p.Op.PING, version=7), p.ErrorCode.BAD_VERSION, "version 7"),
    (f.pack_header(p.Op.PUT, 0, 1, 1, p.META_BYTES_MAX + 1, 0), p.ErrorCode.LIMIT, "meta section"),
    (f.pack_header(p.Op.PUT, 0, 1, 1, 20, 2**32 - 1), p.ErrorCode.LIMIT, "payload of 4294967295"),
], ids=["no-magic", "http", "version-7", "meta-too-large", "payload-too-large"])
def test_broken_framing_gets_an_error_frame_and_a_close(daemon, wire, code, fragment):
    with raw(daemon) as s:
        s.sendall(wire)
        (reply,) = read_replies(s)
        assert isinstance(reply, p.ErrorReply) and reply.code == code and fragment in reply.message
        assert closed_by_daemon(s)
    assert_still_serving(daemon)


@pytest.mark.parametrize("wire, code, fragment", [
    (frame(0x42, meta=b"xyz"), p.ErrorCode.UNKNOWN_OP, "unknown op 0x42"),
    (frame(p.Op.GET, count=p.BATCH_COUNT_MAX + 1), p.ErrorCode.LIMIT, "over the limit"),
    (frame(p.Op.GET, count=2, meta=b"k" * 24), p.ErrorCode.BAD_REQUEST, "wrong key size"),
    (frame(p.Op.PUT, count=1, meta=struct.pack("<12sI", b"k" * 12, 100), payload=b"x" * 100),
     p.ErrorCode.BAD_REQUEST, "PUT item table"),
    (frame(p.Op.LOOKUP, count=1, meta=b"k" * 16, payload=b"extra"), p.ErrorCode.BAD_REQUEST, "no payload"),
    (frame(p.Op.HELLO, meta=b"\xff\xff"), p.ErrorCode.BAD_REQUEST, "HELLO"),
])
def test_refused_requests_keep_the_connection(daemon, wire, code, fragment):
    with raw(daemon) as s:
        s.sendall(wire + frame(p.Op.PING, rid=99, meta=b"alive"))
        error, pong = read_replies(s, 2)
        assert isinstance(error, p.ErrorReply) and error.code == code and fragment in error.message, error
        assert pong == p.PingReply(99, b"alive")
    assert_still_serving(daemon)


def test_a_block_with_a_bad_crc_is_refused(daemon):
    key = b"\x01" * 16
    block = bytearray(encode_block(key, NS, 0, os.urandom(1000)))
    block[HEADER_SIZE + 10] ^= 1
    with BlockClient(daemon.data_addr) as c:
        with pytest.raises(RemoteError, match="CRC") as info:
            c.put(key, bytes(block))
        assert info.value.code == p.ErrorCode.BAD_BLOCK
        assert c.lookup([key]) == 0
    assert_still_serving(daemon)


def test_a_put_larger_than_a_region_is_refused_before_its_payload(daemon):
    size = 5 << 20  # regions are 4 MiB
    key = b"\x02" * 16
    meta = struct.pack("<16sI", key, size)
    with raw(daemon) as s:
        s.sendall(f.pack_header(p.Op.PUT, 0, 7, 1, len(meta), size) + meta)  # no payload sent yet
        (error,) = read_replies(s)
        assert error.code == p.ErrorCode.TOO_LARGE and "region" in error.message and str(size) in error.message
        s.sendall(b"\0" * size + frame(p.Op.PING, rid=8))  # the skipped payload, then more work
        assert read_replies(s) == [p.PingReply(8)]
    assert_still_serving(daemon)


def test_a_client_that_stalls_mid_frame_is_timed_out(daemon):
    with raw(daemon) as s:
        s.sendall(frame(p.Op.PING, meta=b"0123456789")[:20])
        started = time.monotonic()
        (error,) = read_replies(s)
        assert error.code == p.ErrorCode.TIMEOUT and "header and meta did not arrive within" in error.message
        assert 0.5 < time.monotonic() - started < 10
        assert closed_by_daemon(s)
    assert_still_serving(daemon)


def test_a_truncated_frame_then_close(daemon):
    with raw(daemon) as s:
        s.sendall(frame(p.Op.GET, count=1, meta=b"k" * 16)[:40])
    assert_still_serving(daemon)


def test_more_connections_than_the_limit_evict_the_one_longest_without_work(daemon):
    held = [raw(daemon) for _ in range(8)]  # the limit is 8
    try:
        for i, s in enumerate(held):  # each is admitted; all but the first have done work since
            s.sendall(frame(p.Op.PING, rid=1) if i == 0 else frame(p.Op.GET, rid=1, count=1, meta=KEEP_KEYS[0]))
            assert len(read_replies(s)) == 1
        held[0].sendall(frame(p.Op.PING, rid=2))  # PINGs are not work: it stays the longest idle
        assert read_replies(held[0]) == [p.PingReply(2)]
        with raw(daemon) as extra:  # a ninth client that greets gets in
            extra.sendall(frame(p.Op.PING, rid=3, meta=b"in"))
            assert read_replies(extra) == [p.PingReply(3, b"in")]
        (error,) = read_replies(held[0])
        assert error.code == p.ErrorCode.BUSY and "max_connections 8" in error.message
        assert "longest without a request other than PING" in error.message
        assert closed_by_daemon(held[0])
        held[1].sendall(frame(p.Op.PING, rid=4))  # the others are served on
        assert read_replies(held[1]) == [p.PingReply(4)]
        with raw(daemon, hello=False) as silent:  # one over the limit that never greets takes nothing
            (error,) = read_replies(silent)
            assert error.code == p.ErrorCode.TIMEOUT and "HELLO" in error.message
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while True:  # the daemon notices the closes asynchronously
        try:
            assert_still_serving(daemon)
            break
        except RemoteError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_wrong_or_missing_token(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("correct horse battery staple\n")
    d = start_kvtierd(tmp_path / "d", "--token-file", str(token_file))
    try:
        with pytest.raises(RemoteError, match="wrong token") as info:
            BlockClient(d.data_addr, token="nope").ping()
        assert info.value.code == p.ErrorCode.AUTH
        with pytest.raises(RemoteError, match="missing token"):
            BlockClient(d.data_addr).ping()
        with raw(d, hello=False) as s:  # no HELLO at all
            s.sendall(frame(p.Op.GET, count=1, meta=b"k" * 16))
            (error,) = read_replies(s)
            assert error.code == p.ErrorCode.AUTH and closed_by_daemon(s)
        with BlockClient(d.data_addr, token="correct horse battery staple") as c:
            key = b"\x03" * 16
            c.put(key, encode_block(key, NS, 0, b"secret kv"))
            assert c.get(key)[HEADER_SIZE:] == b"secret kv"
            assert c.server_info()["auth_required"] is True
    finally:
        assert d.stop() == 0


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident set (VmHWM): catches an allocation even if it was freed again."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def test_unauthenticated_put_headers_allocate_nothing(tmp_path):
    """The reviewer's attack: PUT headers announcing 240 MiB payloads, no HELLO.
    Each is refused from its header, before anything is allocated for it."""
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    d = start_kvtierd(tmp_path / "d", "--token-file", str(token_file))
    try:
        items, item_bytes = 80, 3 << 20  # under the 4 MiB region and, in all, the 256 MiB payload limit
        meta = b"".join(struct.pack("<16sI", bytes([i]) * 16, item_bytes) for i in range(items))
        attack = f.pack_header(p.Op.PUT, 0, 5, items, len(meta), items * item_bytes) + meta + b"x" * 4096
        with BlockClient(d.data_addr, token="s3cret") as c:
            c.ping()  # the daemon's baseline: one connection served
        before = peak_rss_mib(d.pid)
        socks = [raw(d, hello=False) for _ in range(4)]  # ~1 GiB if the payloads were allocated
        try:
            for s in socks:
                s.sendall(attack)
            for s in socks:
                (error,) = read_replies(s)
                assert error.code == p.ErrorCode.AUTH and "first frame must be HELLO" in error.message, error
                assert error.request_id == 5 and closed_by_daemon(s)
        finally:
            for s in socks:
                s.close()
        assert peak_rss_mib(d.pid) - before < 64, "the daemon allocated for an unauthenticated peer"
        with BlockClient(d.data_addr, token="s3cret") as c:  # still serving others
            key = b"\x04" * 16
            c.put(key, encode_block(key, NS, 0, b"after the attack"))
            assert c.get(key)[HEADER_SIZE:] == b"after the attack"
    finally:
        assert d.stop() == 0, d.log_tail()


@pytest.mark.parametrize("wire, code, fragment", [
    (frame(p.Op.PING, meta=b"no hello"), p.ErrorCode.AUTH, "first frame must be HELLO, got op 0x0a"),
    (f.pack_header(p.Op.PUT, 0, 1, 1, 20, 3 << 20), p.ErrorCode.AUTH, "first frame must be HELLO"),
    (f.pack_header(p.Op.HELLO, 0, 1, 0, 6, 1 << 20), p.ErrorCode.LIMIT, "before-HELLO limit"),
    (f.pack_header(p.Op.HELLO, 0, 1, 0, p.HELLO_META_BYTES_MAX + 1, 0), p.ErrorCode.LIMIT, "before-HELLO limit"),
    (frame(p.Op.HELLO, meta=b"\xff\xff") + frame(p.Op.PING), p.ErrorCode.BAD_REQUEST, "valid HELLO"),
])
def test_without_a_token_hello_still_comes_first(daemon, wire, code, fragment):
    with raw(daemon, hello=False) as s:
        s.sendall(wire)
        (reply,) = read_replies(s)
        assert isinstance(reply, p.ErrorReply) and reply.code == code and fragment in reply.message, reply
        assert closed_by_daemon(s)
    assert_still_serving(daemon)


def test_a_silent_or_trickling_peer_without_hello_is_timed_out(daemon):
    """The daemon runs with --frame-timeout 1, so a peer has 1 s to complete
    its HELLO (HELLO_TIMEOUT_S, 5 s, is the longest), however it trickles;
    a peer past its HELLO may idle as long as it likes."""
    greeted = raw(daemon)
    try:
        for trickle in (False, True):
            with raw(daemon, hello=False) as s:
                started = time.monotonic()
                if trickle:  # a byte every 0.2 s never stalls a single receive for a whole second
                    for byte in p.Connection(p.Role.CLIENT).send(p.Hello(1, "slow", ""))[:25]:
                        s.sendall(bytes([byte]))
                        if select.select([s], [], [], 0.2)[0]:  # the daemon's answer: stop sending
                            break
                (error,) = read_replies(s)
                assert error.code == p.ErrorCode.TIMEOUT and "no HELLO within 1" in error.message, error
                assert 0.8 < time.monotonic() - started < 5
                assert closed_by_daemon(s)
        greeted.sendall(frame(p.Op.PING, rid=3, meta=b"still here"))  # idle 3 s past its HELLO
        assert read_replies(greeted) == [p.PingReply(3, b"still here")]
    finally:
        greeted.close()
    assert_still_serving(daemon)


@pytest.fixture
def small_filesystem(tmp_path):
    """A 24 MiB tmpfs: sparse device files on it run out of space when written."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    if os.system(f"mount -t tmpfs -o size=24m tmpfs {mnt} 2>/dev/null") != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield mnt
    os.system(f"umount -l {mnt}")


@pytest.mark.root
def test_no_room_to_create_a_device_is_an_error_naming_it(tmp_path, small_filesystem):
    out = subprocess.run([sys.executable, "-m", "kvtier.daemon.main", "--data-dir", str(tmp_path / "d"),
                          "--device", str(small_filesystem / "d0.img"), "--device", str(small_filesystem / "d1.img"),
                          "--device-size", "16m", "--listen", "127.0.0.1:0", "--admin", "none", "--format"],
                         capture_output=True, text=True, timeout=60)  # --format: only it creates explicit devices
    assert out.returncode == 1, out.stderr
    assert "cannot reserve 16777216 bytes for device" in out.stderr and "d1.img: No space left" in out.stderr
    # d0.img fit and was created by this start: removed again, its space given back
    assert "Traceback" not in out.stderr and not list(small_filesystem.glob("*.img")), out.stderr


@pytest.mark.root
def test_a_full_disk_is_a_device_error_naming_the_device_and_the_daemon_serves_on(tmp_path, small_filesystem):
    devices = [str(small_filesystem / f"d{i}.img") for i in range(2)]
    for path in devices:  # sparse files the daemon finds: they fill up as it writes
        os.truncate(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600), 32 << 20)
    d = start_kvtierd(tmp_path / "d", "--device", devices[0], "--device", devices[1], "--device-size", "32m",
                      "--region-size", "4m", "--stripe-size", "256k")
    try:
        with BlockClient(d.data_addr) as c:
            stored, error = [], None
            for i in range(64):  # 64 MiB of durable puts on a 24 MiB filesystem
                key = i.to_bytes(16, "little")
                block = encode_block(key, bytes(16), 0, os.urandom(1 << 20))
                try:
                    c.put(key, block, durable=True)
                except RemoteError as exc:
                    error = exc
                    break
                stored.append((key, block))
            assert error is not None, "the filesystem never filled"
            assert error.code == p.ErrorCode.DEVICE_ERROR
            assert "No space left on device" in str(error) and "d" in str(error) and ".img" in str(error)
            assert stored, "not one durable put fit"
            # every block acknowledged as durable is still served, byte-exact
            served = c.get_many([k for k, _ in stored])
            assert [bytes(b[HEADER_SIZE:]) for b in served] == [b[HEADER_SIZE:] for _, b in stored]
            c.ping()
    finally:
        code = d.stop()
    # SIGTERM cannot seal the open region on a full disk: a clear line and exit 3, no traceback
    assert code == 3 and "event=stopped_unclean" in d.log_tail() and "Traceback" not in d.log_tail(), d.log_tail()


@pytest.mark.root
def test_buffered_puts_on_a_full_disk_are_device_errors_logged_once_not_no_space(tmp_path, small_filesystem):
    devices = [str(small_filesystem / f"d{i}.img") for i in range(2)]
    for path in devices:
        os.truncate(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600), 32 << 20)
    d = start_kvtierd(tmp_path / "d", "--device", devices[0], "--device", devices[1], "--device-size", "32m",
                      "--region-size", "4m", "--stripe-size", "256k")
    codes = []
    try:
        with BlockClient(d.data_addr) as c:
            for i in range(120):  # 120 MiB of buffered puts: the seals and reclaims hit the full filesystem
                key = i.to_bytes(16, "little")
                try:
                    c.put(key, encode_block(key, bytes(16), 0, os.urandom(1 << 20)))
                except RemoteError as exc:
                    codes.append(exc.code)
                    assert "No space left on device" in str(exc) and ".img" in str(exc), exc
            assert codes, "the filesystem never filled"
            assert set(codes) == {p.ErrorCode.DEVICE_ERROR}, codes  # not NO_SPACE: no pin fills this store
            c.ping()
    finally:
        d.stop()
    log = d.log_tail(200_000)
    assert "Traceback" not in log and log.count("event=reclaim_device_errors_began") <= 2, log[-4000:]
