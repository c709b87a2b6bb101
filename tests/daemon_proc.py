"""Start real kvtierd processes for tests (and benchmarks).

    d = start_kvtierd(tmp_path, "--region-size", "4m")
    d.data_addr    # "127.0.0.1:PORT"
    d.stop()       # SIGTERM, waits, checks exit 0 ; d.kill() is SIGKILL ; d.restart()
    with d.stopped():  # SIGSTOP for the block, SIGCONT after (or by a timer: resume_after_s=)

Small, fast devices by default: 4 files of 64 MiB, 4 MiB regions, 256 KiB
stripes, data port and admin port chosen by the kernel (``--admin none``
until told otherwise by ``admin=`` in ``extra_args``).
"""
from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

READY_TIMEOUT_S = 60.0  # first start formats 4 device files; CI machines are slow
STOP_TIMEOUT_S = 60.0  # seal + sync of a region on a loaded machine
READY_RE = re.compile(r"^kvtierd ready data=(\S+)(?: admin=(\S+))?")

DEFAULT_ARGS = ("--device-size", "64m", "--region-size", "4m", "--stripe-size", "256k",
                "--listen", "127.0.0.1:0", "--nixl", "off")  # tests of the nixl transport turn it on


class KvtierdProcess:
    def __init__(self, data_dir: Path, args: list[str], env: dict | None = None):
        self.data_dir = Path(data_dir)
        self.args = list(args)
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.data_addr = ""
        self.admin_addr: str | None = None
        self.log_path = self.data_dir / "kvtierd.log"
        self.start()

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "kvtier.daemon.main", "--data-dir", str(self.data_dir), *self.args]

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=log, env=env)
        log.close()
        line = self.ready_line = self._read_ready_line()
        m = READY_RE.match(line)
        self.data_addr, self.admin_addr = m.group(1), m.group(2)

    def _read_ready_line(self) -> str:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + READY_TIMEOUT_S
        buf = b""
        while time.monotonic() < deadline:
            if not sel.select(timeout=deadline - time.monotonic()):
                break
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                break
            buf += chunk
            for line in buf.decode(errors="replace").splitlines():
                if READY_RE.match(line):
                    sel.close()
                    return line
        sel.close()
        self.proc.kill()
        self.proc.wait()
        raise RuntimeError(f"kvtierd did not become ready (exit {self.proc.returncode}); stdout {buf!r}; "
                           f"log tail:\n{self.log_tail()}")

    def log_tail(self, nbytes: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-nbytes:].decode(errors="replace")
        except OSError:
            return ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    @contextmanager
    def stopped(self, resume_after_s: float | None = None):
        """The process stopped (SIGSTOP) for the body and continued (SIGCONT) at its end, or, with
        ``resume_after_s``, by a timer that long after (the body may still be waiting then); the
        block ends once it has been continued."""
        self.signal(signal.SIGSTOP)
        timer = None if resume_after_s is None else threading.Timer(resume_after_s, self.signal, (signal.SIGCONT,))
        if timer is not None:
            timer.start()
        try:
            yield
        finally:
            if timer is None:
                self.signal(signal.SIGCONT)
            else:
                timer.join()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM and wait; returns the exit code."""
        if not self.alive():
            return self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"kvtierd ignored SIGTERM for {timeout_s} s; log tail:\n{self.log_tail()}")
        finally:
            self.proc.stdout.close()

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()

    def restart(self) -> None:
        """Graceful stop, then start on the same store and the same data port."""
        port = self.data_addr.rpartition(":")[2]
        self.stop()
        self.args = _replace_flag(self.args, "--listen", f"127.0.0.1:{port}")
        self.start()


def _replace_flag(args: list[str], flag: str, value: str) -> list[str]:
    out, i = [], 0
    while i < len(args):
        if args[i] == flag:
            i += 2
            continue
        out.append(args[i])
        i += 1
    return out + [flag, value]


def start_kvtierd(tmp_path, *extra_args: str, admin: str = "none", env: dict | None = None) -> KvtierdProcess:
    """A kvtierd on small device files in ``tmp_path``; later flags override the defaults."""
    merged = _merge(list(DEFAULT_ARGS) + ["--admin", admin], list(extra_args))
    return KvtierdProcess(Path(tmp_path), merged, env)


def _merge(defaults: list[str], extra: list[str]) -> list[str]:
    """``extra`` wins over ``defaults`` for each ``--flag value`` pair it sets."""
    out = list(defaults)
    i = 0
    single = {"--format", "--force"}
    while i < len(extra):
        flag = extra[i]
        if flag in single or i + 1 >= len(extra) or flag == "--device":
            if flag == "--device":
                out += extra[i:i + 2]
                i += 2
                continue
            out.append(flag)
            i += 1
            continue
        out = _replace_flag(out, flag, extra[i + 1]) if flag in out else out + [flag, extra[i + 1]]
        i += 2
    return out


def device_map_of(daemon) -> dict[str, str]:
    """{device id: path} of a daemon's device files, from their superblocks."""
    from kvtier.daemon.engine.superblock import decode_superblock

    out = {}
    for path in sorted(daemon.data_dir.glob("device*.img")):
        with open(path, "rb") as f:
            out[decode_superblock(f.read(4096)).device_uuid.hex()] = str(path)
    assert out, f"no device files in {daemon.data_dir}"
    return out
