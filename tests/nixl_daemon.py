"""A kvtierd with its NIXL agent for the NIXL tests, and the UCX environment that keeps them on
loopback (set it in the test process before its client agent exists)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from daemon_proc import start_kvtierd
from kvtier.common.ucx_env import rdma_devices

LOOPBACK_ENV = {"UCX_NET_DEVICES": "lo", **({} if rdma_devices() else {"UCX_MODULES": "^ib*"})}


def start_nixl_daemon(path, *args, **kw):
    return start_kvtierd(path, "--nixl", "on", "--region-size", "64m", "--device-size", "256m", *args,
                         env={**os.environ, **LOOPBACK_ENV}, **kw)


def start_misbehaving_peer(addr: str, action: str, ns: bytes, keys, lengths) -> subprocess.Popen:
    """``nixl_peer_child.py`` doing ``action`` (kill, stop, put-kill, put-stop) once its request is sent."""
    child = subprocess.Popen([sys.executable, str(Path(__file__).with_name("nixl_peer_child.py")), addr, action,
                              ns.hex(), *(f"{k.hex()}:{n}" for k, n in zip(keys, lengths))],
                             stdout=subprocess.PIPE, env={**os.environ, **LOOPBACK_ENV})
    line = child.stdout.readline()
    assert line.startswith(b"sent"), line + child.stdout.read()
    return child
