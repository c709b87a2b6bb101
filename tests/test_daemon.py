"""kvtierd as a process: concurrency, restarts, signals, config, sd_notify."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from daemon_proc import start_kvtierd
from kvtier.client import BlockClient, RemoteError
from kvtier.common.blockformat import HEADER_SIZE, encode_block, verify_block

NS = b"\x0a" * 16


def key_of(tag: int, i: int) -> bytes:
    return tag.to_bytes(2, "little") + i.to_bytes(14, "little")


def block_of(key: bytes, size: int) -> bytes:
    return encode_block(key, NS, 0, os.urandom(size))


def test_64_concurrent_clients_byte_exact(kvtierd):
    errors, stored = [], {}
    lock = threading.Lock()

    def client(tag):
        try:
            with BlockClient(kvtierd.data_addr, pool_size=1) as c:
                for round_ in range(2):
                    keys = [key_of(tag, round_ * 4 + i) for i in range(4)]
                    blocks = [block_of(k, 1000 + 997 * ((tag + i) % 9)) for i, k in enumerate(keys)]
                    with lock:  # before the put: a neighbour may read them as soon as the daemon has them
                        stored.update(zip(keys, blocks))
                    seqs = c.put_many(list(zip(keys, blocks)))
                    for k, b, s, got in zip(keys, blocks, seqs, c.get_many(keys)):
                        verify_block(got, expected_key=k, expected_seq=s)
                        assert got[HEADER_SIZE:] == b[HEADER_SIZE:]
                    other = key_of((tag + 1) % 64, 0)  # a neighbour's block, maybe not there yet
                    got = c.get(other)
                    with lock:
                        expect = stored.get(other)
                    assert got is None or got[HEADER_SIZE:] == expect[HEADER_SIZE:]
        except Exception as exc:  # noqa: BLE001 - collected and reported
            errors.append((tag, repr(exc)))

    threads = [threading.Thread(target=client, args=(t,)) for t in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    with BlockClient(kvtierd.data_addr) as c:
        keys = list(stored)
        got = c.get_many(keys)
        assert all(g is not None and g[HEADER_SIZE:] == stored[k][HEADER_SIZE:] for k, g in zip(keys, got))
        server = c.stats()["server"]
        assert server["total_connections"] >= 65 and server["errors"] == {}


def test_restart_between_put_and_get(kvtierd):
    keys = [key_of(1, i) for i in range(20)]
    blocks = [block_of(k, 50_000) for k in keys]  # ~1 MiB: stays in the open region until shutdown
    with BlockClient(kvtierd.data_addr) as c:
        seqs = c.put_many(list(zip(keys, blocks)))  # buffered, not durable: SIGTERM must seal it
    kvtierd.restart()
    with BlockClient(kvtierd.data_addr) as c:
        for k, b, s, got in zip(keys, blocks, seqs, c.get_many(keys)):
            verify_block(got, expected_key=k, expected_seq=s)
            assert got[HEADER_SIZE:] == b[HEADER_SIZE:]
        assert c.lookup(keys) == 20


def test_kill_9_keeps_what_was_acknowledged_durable(tmp_path):
    d = start_kvtierd(tmp_path)
    keys = [key_of(2, i) for i in range(10)]
    blocks = [block_of(k, 20_000) for k in keys]
    with BlockClient(d.data_addr) as c:
        c.put_many(list(zip(keys, blocks)), durable=True)
    d.kill()
    d.start()
    try:
        with BlockClient(d.data_addr) as c:
            assert [g[HEADER_SIZE:] for g in c.get_many(keys)] == [b[HEADER_SIZE:] for b in blocks]
    finally:
        assert d.stop() == 0


def test_sigterm_finishes_in_flight_requests(tmp_path):
    d = start_kvtierd(tmp_path)
    keys = [key_of(3, i) for i in range(24)]
    blocks = [block_of(k, 1 << 20) for k in keys]
    result = {}
    c = BlockClient(d.data_addr, pool_size=1)
    c.ping()

    def put():
        try:
            result["seqs"] = c.put_many(list(zip(keys, blocks)))
        except Exception as exc:  # noqa: BLE001
            result["error"] = exc

    t = threading.Thread(target=put)
    t.start()
    time.sleep(0.05)  # the 24 MiB batch is on its way
    d.signal(signal.SIGTERM)
    t.join(60)
    code = d.proc.wait(60)
    c.close()
    assert code == 0, d.log_tail()
    d.proc.stdout.close()
    d.start()
    try:
        with BlockClient(d.data_addr) as c2:
            got = c2.get_many(keys)
        if "seqs" in result:  # acknowledged: every block must have survived
            assert [g[HEADER_SIZE:] for g in got] == [b[HEADER_SIZE:] for b in blocks]
        else:  # refused or cut off: whatever is there is intact
            assert all(g is None or g[HEADER_SIZE:] == b[HEADER_SIZE:] for g, b in zip(got, blocks))
    finally:
        assert d.stop() == 0
    assert "event=stopped" in d.log_tail(20000)


def run_kvtierd(args, timeout=60):
    return subprocess.run([sys.executable, "-m", "kvtier.daemon.main", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("toml, fragment", [
    ('listen = "127.0.0.1:0"\nbogus_key = 1\n', "unknown key 'bogus_key'"),
    ('region_size = [1]\n', "region_size"),
    ('max_connections = "many"\n', "max_connections: expected an integer"),
    ('log_level = "loud"\n', "log_level"),
    ('listen = "0.0.0.0:7410"\n', "non-loopback"),
    ('listen = "127.0.0.1:99999"\n', "out of range"),
    ('this is not toml', "not valid TOML"),
])
def test_bad_config_names_the_key(tmp_path, toml, fragment):
    cfg = tmp_path / "kvtierd.toml"
    cfg.write_text(toml)
    out = run_kvtierd(["--config", str(cfg), "--data-dir", str(tmp_path / "d"), "--admin", "none"])
    assert out.returncode == 2 and fragment in out.stderr, out.stderr


def test_bad_flags(tmp_path):
    out = run_kvtierd(["--data-dir", str(tmp_path), "--device-size", "12q", "--admin", "none"])
    assert out.returncode == 2 and "--device-size" in out.stderr
    out = run_kvtierd(["--data-dir", str(tmp_path), "--listen", "10.1.2.3:7410", "--admin", "none"])
    assert out.returncode == 2 and "without token_file" in out.stderr


def test_config_file_and_explicit_devices_created_with_their_space_reserved(tmp_path):
    devs = [tmp_path / f"nvme{i}.img" for i in range(2)]
    cfg = tmp_path / "kvtierd.toml"
    cfg.write_text(f'device = ["{devs[0]}", "{devs[1]}"]\ndevice_size = "128m"\nregion_size = "2m"\n'
                   f'stripe_size = "1m"\nlisten = "127.0.0.1:0"\nadmin = "none"\n')
    # explicit devices are created only by --format (a start without it names the missing ones)
    d = start_kvtierd(tmp_path / "data", "--config", str(cfg), "--region-size", "2m", "--stripe-size", "1m",
                      "--format")
    try:
        for dev in devs:
            st = dev.stat()
            # start_kvtierd passes --device-size 64m: the flag wins over the file's 128m
            assert st.st_size == 64 << 20 and st.st_blocks * 512 >= 64 << 20  # and its space reserved
        with BlockClient(d.data_addr) as c:
            assert len(c.geometry().device_ids) == 2 and c.geometry().stripe_size_bytes == 1 << 20
    finally:
        assert d.stop() == 0
    # the same devices in another order are refused with a clear error
    out = run_kvtierd(["--device", str(devs[1]), "--device", str(devs[0]), "--region-size", "2m",
                       "--stripe-size", "1m", "--listen", "127.0.0.1:0", "--admin", "none"])
    assert out.returncode == 1 and "GeometryError" in out.stderr


def test_sd_notify_ready_watchdog_stopping(tmp_path):
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(30)
    env = dict(os.environ, NOTIFY_SOCKET=path, WATCHDOG_USEC="200000")
    d = start_kvtierd(tmp_path / "d", env=env)
    try:
        assert sock.recv(4096).decode().startswith("STATUS=opening devices")
        messages = [sock.recv(4096).decode()]
        assert messages[0].startswith("READY=1") and "STATUS=serving data=" in messages[0]
        assert sock.recv(4096).decode() == "WATCHDOG=1"
    finally:
        assert d.stop() == 0
    rest = []
    sock.settimeout(0.2)
    try:
        while True:
            rest.append(sock.recv(4096).decode())
    except socket.timeout:
        pass
    assert "STOPPING=1" in rest
    sock.close()


def test_sighup_reloads_the_token_and_keeps_connections(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("first")
    cfg = tmp_path / "kvtierd.toml"
    cfg.write_text(f'token_file = "{token_file}"\nlog_level = "info"\n')
    d = start_kvtierd(tmp_path / "d", "--config", str(cfg))
    try:
        old = BlockClient(d.data_addr, token="first", pool_size=1)
        old.ping()
        token_file.write_text("second")
        cfg.write_text(f'token_file = "{token_file}"\nlog_level = "debug"\n')
        d.signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while True:
            try:
                BlockClient(d.data_addr, token="second").ping()
                break
            except RemoteError:
                assert time.monotonic() < deadline, d.log_tail()
                time.sleep(0.05)
        with pytest.raises(RemoteError, match="wrong token"):
            BlockClient(d.data_addr, token="first").ping()
        assert old.ping() > 0 and old.statistics().reconnects == 0  # the old connection was kept
        old.close()
        assert "event=reloaded log_level=debug" in d.log_tail()
    finally:
        assert d.stop() == 0


def test_sighup_keeps_what_the_command_line_gave_over_the_file(tmp_path):
    token_file, flag_token = tmp_path / "token", tmp_path / "flag-token"
    token_file.write_text("from-file")
    flag_token.write_text("from-flag")
    cfg = tmp_path / "kvtierd.toml"
    cfg.write_text(f'token_file = "{token_file}"\nlog_level = "info"\n')
    d = start_kvtierd(tmp_path / "d", "--config", str(cfg), "--log-level", "debug", "--token-file", str(flag_token))
    try:
        cfg.write_text(f'token_file = "{token_file}"\nlog_level = "error"\n')
        d.signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while "event=reloaded" not in d.log_tail():
            assert time.monotonic() < deadline, d.log_tail()
            time.sleep(0.05)
        assert "event=reloaded log_level=debug" in d.log_tail()  # the flag's, not the file's error
        assert BlockClient(d.data_addr, token="from-flag").ping() >= 0
        with pytest.raises(RemoteError, match="wrong token"):
            BlockClient(d.data_addr, token="from-file").ping()
    finally:
        assert d.stop() == 0


def test_embedded_default_is_four_reserved_1g_files(tmp_path):
    from daemon_proc import KvtierdProcess
    d = KvtierdProcess(tmp_path / "data", ["--listen", "127.0.0.1:0", "--admin", "none"])
    try:
        files = sorted((tmp_path / "data").glob("device*.img"))
        assert [f.name for f in files] == [f"device{i}.img" for i in range(4)]
        assert all(f.stat().st_size == 1 << 30 and f.stat().st_blocks * 512 >= 1 << 30 for f in files)
        with BlockClient(d.data_addr) as c:
            info = c.server_info()
            assert info["region_size_bytes"] == 64 << 20 and info["geometry"]["stripe_size_bytes"] == 1 << 20
    finally:
        assert d.stop() == 0
