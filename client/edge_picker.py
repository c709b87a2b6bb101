"""Which edge to send a request to: the one the router says holds its longest stored prefix,
or, when the router cannot say, the prefix's rendezvous owner among the edges.

    picker = EdgePicker(["10.0.0.1:7410", "10.0.0.2:7410"], router_url="http://10.0.0.9:7420")
    choice = picker.pick_for_tokens(namespace, prompt_tokens)   # or picker.pick(keys)
    choice.address, choice.prefix_blocks, choice.source          # "router" or "rendezvous"

Keys are computed with the namespace's own chain (:mod:`kvtier.common.keys`), as
``KVCache`` computes them. A router that fails (down, slow past ``timeout_s``, an error
reply) is not asked again for ``retry_after_s``: the picks meanwhile are rendezvous
picks, without a wait. When the router names no node (no edge holds the first block) the
rendezvous owner of the first key is the pick, so a new prefix keeps going to one edge.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable, Sequence

from kvtier.common.keys import Namespace

from .routing import Rendezvous

ROUTER_TIMEOUT_S_DEFAULT = 0.2  # a route answer is one in-memory walk: a slower router is treated as down
ROUTER_RETRY_AFTER_S_DEFAULT = 5.0  # after a router failure, picks go by rendezvous this long


@dataclass(frozen=True)
class EdgeChoice:
    address: str
    prefix_blocks: int  # blocks the router said the edge holds (0 for a rendezvous pick)
    source: str  # "router" or "rendezvous"


@dataclass(frozen=True)
class EdgePickerStatistics:
    router_picks: int
    rendezvous_picks: int
    router_failures: int


class EdgePicker:
    def __init__(self, edges: Sequence[str], router_url: str | None = None, token: str | None = None,
                 timeout_s: float = ROUTER_TIMEOUT_S_DEFAULT, retry_after_s: float = ROUTER_RETRY_AFTER_S_DEFAULT,
                 clock: Callable[[], float] = time.monotonic):
        self._rendezvous = Rendezvous(edges)
        self._url = None if router_url is None else router_url.rstrip("/") + "/v1/route"
        self._token = token
        self._timeout_s = timeout_s
        self._retry_after_s = retry_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._down_until = float("-inf")
        self._router = self._rendezvous_picks = self._failures = 0

    def pick_for_tokens(self, namespace: Namespace, tokens) -> EdgeChoice:
        return self.pick(namespace.keys(tokens))

    def pick(self, keys: Sequence[bytes]) -> EdgeChoice:
        if not keys:
            raise ValueError("pick needs at least one full block's key")
        answer = self._ask_router(keys)
        if answer is not None and answer.get("data"):
            with self._lock:
                self._router += 1
            return EdgeChoice(answer["data"], int(answer["prefix_blocks"]), "router")
        with self._lock:
            self._rendezvous_picks += 1
        owner = self._rendezvous.members[int(self._rendezvous.owners([bytes(keys[0])])[0])]
        return EdgeChoice(owner, 0, "rendezvous")

    def _ask_router(self, keys: Sequence[bytes]) -> dict | None:
        if self._url is None:
            return None
        with self._lock:
            if self._clock() < self._down_until:
                return None
        body = json.dumps({"keys": [bytes(k).hex() for k in keys]}).encode()
        request = urllib.request.Request(self._url, data=body, headers={"Content-Type": "application/json"})
        if self._token is not None:
            request.add_header("Authorization", f"Bearer {self._token}")
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as reply:
                return json.loads(reply.read())
        except (OSError, ValueError):  # down, slow, refused, an error reply or not JSON: a rendezvous pick
            with self._lock:
                self._failures += 1
                self._down_until = self._clock() + self._retry_after_s
            return None

    def statistics(self) -> EdgePickerStatistics:
        with self._lock:
            return EdgePickerStatistics(self._router, self._rendezvous_picks, self._failures)
