"""A daemon's NIXL transport, set up off the caller's path: ``KVCache`` opens one
:class:`NixlSetup` per daemon whose blocks may come through NIXL, and its loads go over
TCP until the transport is ready::

    NixlSetup(address)  -> a background thread opens NixlTransport(address): connect, HELLO,
                           NIXL_METADATA, each within NIXL_SETUP_TIMEOUT_S (a stopped daemon)
    ready()             -> the transport once set up; None while the setup runs or after it
                           failed (fetch over TCP). A failed or timed-out setup is tried again
                           NIXL_SETUP_RETRY_S later, from the ready() that finds it due; a
                           daemon (or host) without NIXL is never asked again (``offered`` False)
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Sequence

from .nixl_agent import NixlUnavailable, nixl_importable
from .nixl_transport import NIXL_SETUP_TIMEOUT_S, NixlTransport

log = logging.getLogger(__name__)

NIXL_SETUP_RETRY_S = 30.0  # after a setup failed or timed out, the next one: loads use TCP meanwhile
READY_POLL_S = 0.01  # wait_ready's look at the setups (each ends on a thread of its own)


def open_nixl_setup(address: str, required: bool, token: str | None, pool_size: int,
                    timeout_s: float) -> "NixlSetup | None":
    """A :class:`NixlSetup` of the daemon at ``address``; None where NIXL is not importable here and
    it is not ``required``. ``required`` (``transport="nixl"``): ValueError where this host or the
    daemon lacks NIXL, learnt within NIXL_SETUP_TIMEOUT_S (a daemon that does not answer by then is
    not refused: its loads go over TCP until a later setup succeeds)."""
    if not nixl_importable():
        if not required:
            return None
        raise ValueError("transport='nixl': NIXL is not importable here: pip install 'kvtier[nixl]' "
                         "(torch==2.13.0 first on machines without a GPU)")
    setup = NixlSetup(address, token=token, pool_size=pool_size, timeout_s=timeout_s,
                      setup_timeout_s=min(NIXL_SETUP_TIMEOUT_S, timeout_s))
    if required and (why := setup.wait_unavailable(setup.setup_timeout_s)) is not None:
        setup.close()
        raise ValueError(f"transport='nixl': {why}")
    return setup


def wait_ready(setups: Sequence[NixlSetup | None], timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for every setup's transport (loads go over TCP before). False where
    one is not ready by then, or there is none to wait for: no setups, a daemon without one
    (transport tcp or direct, NIXL not importable here), or one that lacks NIXL."""
    deadline = time.monotonic() + timeout_s
    while True:
        if not setups or any(s is None or not s.offered for s in setups):
            return False
        if all(s.ready() is not None for s in setups):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(READY_POLL_S)


@dataclass(frozen=True)
class NixlSetupStatistics:
    state: str  # "pending", "ready", "failed" (tried again later) or "unavailable" (never again)
    attempts: int
    failures: int  # setups that failed or timed out
    last_error: str | None


class NixlSetup:
    """One daemon's :class:`~.nixl_transport.NixlTransport`, opened on a background thread."""

    def __init__(self, address: str, token: str | None = None, pool_size: int = 4, timeout_s: float = 30.0,
                 setup_timeout_s: float = NIXL_SETUP_TIMEOUT_S, retry_s: float | None = None):
        self.address = address
        self.setup_timeout_s = setup_timeout_s
        self.retry_s = NIXL_SETUP_RETRY_S if retry_s is None else retry_s
        self._open = functools.partial(NixlTransport, address, token=token, pool_size=pool_size, timeout_s=timeout_s,
                                       setup_timeout_s=setup_timeout_s)
        self._lock = threading.Lock()
        self._ended = threading.Event()  # the latest setup has ended, one way or the other
        self._transport: NixlTransport | None = None
        self._unavailable: str | None = None
        self._error: str | None = None
        self._retry_at = 0.0
        self._attempts = self._failures = 0
        self._closed = False
        with self._lock:
            self._start()

    def _start(self) -> None:
        """Begin a setup (lock held)."""
        self._attempts += 1
        self._ended.clear()
        threading.Thread(target=self._set_up, name="kvtier-nixl-setup", daemon=True).start()

    def _set_up(self) -> None:
        transport = unavailable = error = None
        try:
            transport = self._open()
        except NixlUnavailable as exc:
            unavailable = str(exc)
        except Exception as exc:  # a timeout, a refusal, a lost connection, NIXL's own errors: TCP, and later again
            error = f"{type(exc).__name__}: {exc}"
        with self._lock:
            if transport is not None and self._closed:
                transport.close()
            elif transport is not None:
                self._transport = transport
            elif unavailable is not None:
                self._unavailable = unavailable
                log.info("event=nixl_unavailable daemon=%s reason=%s", self.address, unavailable)
            else:
                self._failures += 1
                self._error = error
                self._retry_at = time.monotonic() + self.retry_s
                log.warning("event=nixl_setup_failed daemon=%s retry_s=%s error=%s", self.address, self.retry_s,
                            error)
            self._ended.set()

    def ready(self) -> NixlTransport | None:
        """The transport, or None (not set up yet, failed, or unavailable): never waits."""
        with self._lock:
            if self._transport is None and self._unavailable is None and not self._closed and self._ended.is_set() \
                    and time.monotonic() >= self._retry_at:
                self._start()
            return self._transport

    @property
    def offered(self) -> bool:
        """False once this host or the daemon turned out not to have NIXL (it is not asked again)."""
        return self._unavailable is None

    @property
    def failed(self) -> bool:
        """A setup failed or timed out and none has succeeded since: its blocks are TCP fallbacks."""
        with self._lock:
            return self._transport is None and self._unavailable is None and self._failures > 0

    def wait_unavailable(self, timeout_s: float) -> str | None:
        """Wait up to ``timeout_s`` for the first setup to end; why NIXL is unavailable (this
        host or the daemon lacks it), or None (ready, failed for now, or still running)."""
        self._ended.wait(timeout_s)
        return self._unavailable

    def statistics(self) -> NixlSetupStatistics:
        with self._lock:
            state = "ready" if self._transport is not None else "unavailable" if self._unavailable is not None \
                else "pending" if not self._ended.is_set() else "failed"
            return NixlSetupStatistics(state, self._attempts, self._failures, self._error)

    def close(self) -> None:
        """Close the transport; a setup still running closes its own once it ends (never waited for)."""
        with self._lock:
            self._closed = True
            transport, self._transport = self._transport, None
        if transport is not None:
            transport.close()


def lent_for_puts(daemons, spans) -> ExitStack:
    """The memory ``spans`` (``(address, length)``: an engine's KV a store sends from) lent to
    this process's NIXL agent while the returned stack is open, where a daemon takes NIXL_PUT:
    it then READs the blocks where they lie. Memory NIXL will not register is not lent (the
    blocks are staged, or go over TCP)."""
    stack = ExitStack()
    agents = {}
    for daemon in daemons:
        transport = None if daemon.nixl is None else daemon.nixl.ready()
        if transport is not None and transport.puts:
            agents[id(transport.agent)] = transport.agent
    for agent in agents.values():
        stack.enter_context(agent.lend_all(spans))
    return stack
