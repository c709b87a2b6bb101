"""kvtierd's side of the ``nixl`` transport (docs/nixl.md): a NIXL agent with the UCX backend
that WRITEs GET replies into clients' registered buffers. NIXL is imported only when the
daemon starts one (``--nixl auto|on``): a daemon without NIXL installed runs as before.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import sys

from kvtier.daemon.nixl.trust import DEFAULT_TRUST

log = logging.getLogger("kvtier.daemon.nixl")

NIXL_MODES = ("auto", "on", "off")


def start_nixl(mode: str, loopback_only: bool, tls_override: str | None = None, trust=DEFAULT_TRUST):
    """A :class:`~.service.NixlService` serving the clients ``trust`` (a :class:`~.trust.NixlTrust`)
    trusts, or None when ``mode`` is off or NIXL is not importable (auto). ``on``
    creates the agent now (NixlUnavailable says why it cannot be); ``auto`` when the first client
    asks for it, so a daemon no client uses NIXL with pays nothing."""
    if mode == "off":
        return None
    if mode == "auto" and importlib.util.find_spec("nixl_cu12") is None:
        log.info("event=nixl_off reason=nixl_cu12 is not installed (pip install 'kvtier[nixl]')")
        return None
    from kvtier.daemon.nixl.agent import DaemonAgent
    from kvtier.daemon.nixl.service import NixlService
    service = NixlService(lambda: DaemonAgent(loopback_only, tls_override), trust=trust)
    if mode == "on":
        service.agent()
    return service


def exit_process(code: int) -> None:
    """End a process that created a UCX backend without running its teardown, which can crash
    (SIGSEGV) at interpreter exit: flush what was written, then ``os._exit``."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
