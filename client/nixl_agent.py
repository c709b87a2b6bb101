"""This process's NIXL agent (:class:`ClientAgent`): created once, its destination buffers registered
and reused, its notifications kept per request, the memory a late WRITE may reach retired or
quarantined for its life (see :mod:`.nixl_transport`, which drives it). NIXL is imported only here,
when the first transport is opened.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import socket
import threading
import uuid
from contextlib import ExitStack, contextmanager

import numpy as np

from kvtier.common.ucx_env import TransportPlan, apply_ucx_environment
from kvtier.wire.nixl_frames import notification_prefix, parse_part_notification

from .block_client import _exported
from .nixl_held import HeldPutMemory
from .nixl_put_plan import joined_ranges

log = logging.getLogger("kvtier.client.nixl")

DESTINATION_BUFFERS_MAX = 8  # registered destination buffers kept; more requests at once wait or go to TCP
DESTINATION_BUFFER_BYTES_MIN = 16 << 20  # one arena's reply: smaller requests share this size (reuse)
DESTINATION_BYTES_MAX = 1 << 30  # all destination buffers of the process together
SLOT_ALIGN_BYTES = 4096  # each block starts on a page of its destination buffer
NOTES_KEPT_MAX = 4096  # requests whose notifications are kept, waiting to be taken (the oldest go first)


class NixlUnavailable(RuntimeError):
    """NIXL is not importable here, or its agent cannot be created; the message says which."""


class NixlFetchFailed(RuntimeError):
    """A NIXL_GET that delivered nothing usable (refused, failed, timed out): fetch over TCP."""


def load_nixl():
    try:
        from nixl_cu12 import _api
    except ImportError as exc:
        raise NixlUnavailable(f"NIXL is not importable ({exc}): pip install 'kvtier[nixl]' "
                              "(torch==2.13.0 first on machines without a GPU)") from None
    if "NIXL_LOG_LEVEL" not in os.environ:
        logging.getLogger("nixl").setLevel(logging.WARNING)  # its INFO lines go to stdout, not to our log
    return _api


def nixl_importable() -> bool:
    """Whether NIXL is installed here (asked without importing it)."""
    return importlib.util.find_spec("nixl_cu12") is not None


def buffer_address(buf) -> int:
    """The address of a bytes-like object's first byte."""
    return int(np.frombuffer(buf, np.uint8).ctypes.data)


class ClientAgent:
    """This process's NIXL agent, its registered destination buffers and the notifications it got."""

    _instance: "ClientAgent | None" = None
    _instance_lock = threading.Lock()

    @classmethod
    def shared(cls, loopback_only: bool) -> "ClientAgent":
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls(loopback_only)
            return cls._instance

    def __init__(self, loopback_only: bool):
        api = load_nixl()
        self.plan: TransportPlan = apply_ucx_environment(True, loopback_only)
        self.name = f"kvtier-client-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                       sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        try:
            self._agent = api.nixl_agent(self.name, config)
        except Exception as exc:
            raise NixlUnavailable(f"the NIXL agent could not be created: {type(exc).__name__}: {exc}") from None
        if "UCX" not in self._agent.backends:
            raise NixlUnavailable("NIXL's UCX backend is not available here")
        self._lock = threading.Lock()
        self._buffers: list[bytearray] = []
        self._registrations: list = []
        self._retired: list[bytearray] = []  # buffers a late WRITE may still reach: never reused nor freed
        self._quarantined: list[memoryview] = []  # callers' memory a late WRITE may still reach: kept referenced
        self._lent: dict[tuple[int, int], list] = {}  # the callers' regions (lend): address, length -> [descs, lenders]
        self.held = HeldPutMemory()  # the memory of failed NIXL_PUTs whose READ may be pending
        self.generation = 0  # bumped whenever the registered buffers change
        self._notes_lock = threading.Lock()
        self._notes: dict[tuple[str, bytes], list[bytes]] = {}  # (sender, request prefix) -> notifications
        self._notes_max = NOTES_KEPT_MAX

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def regions(self) -> tuple[tuple[int, int], ...]:
        """The memory declared to daemons: the registered buffers and every lent range, joined where
        they overlap or touch (two stores may lend overlapping views of one KV tensor; a daemon
        refuses overlapping regions)."""
        with self._lock:
            return tuple(joined_ranges([(buffer_address(b), len(b)) for b in self._buffers] + list(self._lent)))

    @contextmanager
    def lend(self, region: memoryview):
        """``region`` (the caller's memory: an engine's KV) registered, and declared with the others,
        while the block runs; a second lender of the same region shares its registration."""
        with self.lend_range(buffer_address(region), region.nbytes):
            yield

    def lend_all(self, ranges) -> ExitStack:
        """Every one of ``ranges`` (``(address, length)``; joined where they touch) lent while the
        returned stack is open; from the first NIXL will not register on, none (logged)."""
        stack = ExitStack()
        try:
            for address, nbytes in joined_ranges(ranges):
                stack.enter_context(self.lend_range(address, nbytes))
        except NixlFetchFailed as exc:
            log.warning("event=nixl_lend_failed error=%s", exc)
        return stack

    @contextmanager
    def lend_range(self, address: int, nbytes: int):
        """:meth:`lend` of the ``nbytes`` at ``address`` (memory the caller keeps alive meanwhile)."""
        key = (int(address), int(nbytes))
        with self._lock:
            if key not in self._lent:
                try:
                    descs = self._agent.register_memory([(key[0], key[1], 0, "")], "DRAM", backends=["UCX"])
                except Exception as exc:
                    raise NixlFetchFailed(f"NIXL cannot register {key[1]} bytes of the caller's memory: "
                                          f"{type(exc).__name__}: {exc}") from None
                self._lent[key] = [descs, 0]
                self.generation += 1
            self._lent[key][1] += 1
        try:
            yield
        finally:
            with self._lock:
                self._lent[key][1] -= 1
                if not self._lent[key][1]:
                    self._agent.deregister_memory(self._lent.pop(key)[0], backends=["UCX"])
                    self.generation += 1

    def add_daemon(self, metadata: bytes) -> str:
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            raise NixlUnavailable(f"the daemon's NIXL agent metadata does not load: {type(exc).__name__}: {exc}") \
                from None
        return name.decode() if isinstance(name, bytes) else str(name)

    def take_buffer(self, nbytes: int) -> memoryview | None:
        """A view of a registered buffer of at least ``nbytes`` that no other view references (None:
        none free and no room for another). The buffer is the caller's while this view, or any view
        made from it, lives: that is what marks it taken."""
        with self._lock:
            for buf in self._buffers:
                if len(buf) >= nbytes and not _exported(buf):
                    return memoryview(buf)
            size = max(DESTINATION_BUFFER_BYTES_MIN, -(-nbytes // (1 << 20)) << 20)
            total = sum(len(b) for b in self._buffers) + sum(len(b) for b in self._retired)
            if len(self._buffers) >= DESTINATION_BUFFERS_MAX or total + size > DESTINATION_BYTES_MAX:
                idle = [i for i, b in enumerate(self._buffers) if not _exported(b)]
                if not idle:
                    return None
                self._agent.deregister_memory(self._registrations.pop(idle[0]), backends=["UCX"])
                self._buffers.pop(idle[0])
            buf = bytearray(size)
            try:
                registered = self._agent.register_memory([(buffer_address(buf), size, 0, "")], "DRAM", backends=["UCX"])
            except Exception as exc:  # NIXL's own errors (out of pinnable memory, ...)
                raise NixlFetchFailed(f"NIXL cannot register a {size}-byte destination buffer: "
                                      f"{type(exc).__name__}: {exc}") from None
            self._registrations.append(registered)
            self._buffers.append(buf)
            self.generation += 1
            return memoryview(buf)

    def retire(self, view: memoryview) -> None:
        """Take the buffer under ``view`` (from :meth:`take_buffer`) out of use: a NIXL_GET into it ended
        before its reply. Deregistered now; its memory (a WRITE over shared memory or TCP needs no
        registration to land) is kept for the agent's life, within DESTINATION_BYTES_MAX, and never
        handed out again."""
        with self._lock:
            i = next(i for i, b in enumerate(self._buffers) if b is view.obj)
            self._agent.deregister_memory(self._registrations.pop(i), backends=["UCX"])
            self._retired.append(self._buffers.pop(i))
            self.generation += 1

    def quarantine(self, region: memoryview) -> None:
        """The caller's ``region`` may still take a late WRITE: keep a reference to it for the agent's
        life, so it is never freed to anyone else (and a pooled output, still exported, is never
        handed out again)."""
        with self._lock:
            self._quarantined.append(region)

    def quarantined_bytes(self) -> int:
        with self._lock:
            return sum(v.nbytes for v in self._quarantined)

    def progress(self) -> None:
        """Progress the agent (transfers into our buffers) and keep the notifications that came.
        NixlFetchFailed: NIXL itself failed (the request that waits goes to TCP)."""
        with self._notes_lock:
            try:
                notifications = self._agent.get_new_notifs()
            except Exception as exc:
                raise NixlFetchFailed(f"NIXL could not progress: {type(exc).__name__}: {exc}") from None
            for sender, messages in notifications.items():
                sender = sender.decode() if isinstance(sender, bytes) else sender
                for msg in messages:
                    msg = bytes(msg)
                    self._notes.setdefault((sender, msg[:len(notification_prefix(0))]), []).append(msg)
            while len(self._notes) > self._notes_max:  # of requests that failed before taking them all
                del self._notes[next(iter(self._notes))]

    def take_parts(self, daemon: str, request_id: int) -> list[tuple[int, int, int]]:
        """The ``(item, offset, length)`` ranges ``daemon`` has notified for request ``request_id``
        since the last call (each is handed out once; a malformed notification is dropped)."""
        with self._notes_lock:
            mine = self._notes.pop((daemon, notification_prefix(request_id)), [])
        ranges = []
        for message in mine:
            try:
                ranges += parse_part_notification(message)[1]
            except ValueError as exc:
                log.warning("event=nixl_notification_dropped daemon=%s error=%s", daemon, exc)
        return ranges
