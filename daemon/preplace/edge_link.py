"""One push's connection to one edge: which blocks it lacks, PUT them, soft-pin the prefix.

Built on the upstream client's :class:`~kvtier.daemon.upstream.channel.Channel` (HELLO with
the edges' token, every exchange bounded by a deadline, an error reply raised with its
code). Frames follow the edge's HELLO limits: LOOKUPs and PINs of at most its batch count,
PUTs of at most PUT_FRAME_BYTES_MAX. An edge whose HELLO does not offer soft pins
(``pin_ttl``) is refused before anything is sent: a hard pin would never run out.

An edge that pulls through (``--upstream``, often this very region) answers this link's
LOOKUPs from its own blocks and never asks its upstream for what it lacks (it knows the link
by its HELLO name): asked there, the tail of a prefix being pushed would count as a request
that no client made.
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from kvtier.common.addresses import parse_address
from kvtier.common.cluster_url import PREPLACE_CLIENT_NAME
from kvtier.daemon.upstream.channel import Channel
from kvtier.daemon.upstream.errors import UpstreamError
from kvtier.wire import connection as p
from kvtier.wire.events import PIN_TTL_MS_MAX

from .edges import Edge

CLIENT_NAME = PREPLACE_CLIENT_NAME
CONNECT_TIMEOUT_S = 3.0  # connect and HELLO: an edge that is down is skipped this soon
EXCHANGE_TIMEOUT_S = 60.0  # one pipelined batch of frames (up to 8 x 16 MiB over a WAN link)
PUT_FRAME_BYTES_MAX = 16 << 20  # the edge receives a PUT payload up to this into a pooled arena
PIPELINE_BATCH_FRAMES = 8  # frames handed to one exchange (the channel pipelines them)


class EdgePushError(Exception):
    """This edge could not take the push; the message names the edge and what failed."""


def soft_pin_ttl_ms(ttl_s: float) -> int:
    """A TTL in seconds as the PIN frame's u32 of milliseconds (at least one)."""
    return min(PIN_TTL_MS_MAX, max(1, round(ttl_s * 1000)))


def describe(exc: UpstreamError) -> str:
    """The error as text, an error reply's code by its name (``NO_SPACE: ...``, not ``8: ...``)."""
    text, code = str(exc), getattr(exc, "code", None)
    if isinstance(code, int) and not isinstance(code, p.ErrorCode) and code in set(p.ErrorCode) \
            and text.startswith(f"{code}: "):
        return f"{p.ErrorCode(code).name}: {text[len(f'{code}: '):]}"
    return text


class EdgeLink:
    def __init__(self, edge: Edge, token: str | None):
        self.edge = edge
        host, port = parse_address(edge.address, what=f"edge {edge.name}")
        try:
            self._channel = Channel(host, port, token, CLIENT_NAME, time.monotonic() + CONNECT_TIMEOUT_S)
        except UpstreamError as exc:
            raise EdgePushError(f"edge {edge.name} ({edge.address}): {describe(exc)}") from None
        if p.FEATURE_PIN_TTL not in self._channel.features:
            self.close()
            raise EdgePushError(f"edge {edge.name} ({edge.address}) does not offer soft pins ({p.FEATURE_PIN_TTL!r} "
                                f"is not in its HELLO features)")
        limits = self._channel.info.get("limits", {})
        self._batch = min(p.BATCH_COUNT_MAX, int(limits.get("batch_count_max", p.BATCH_COUNT_MAX)))
        self._frame_bytes = min(PUT_FRAME_BYTES_MAX, int(limits.get("payload_bytes_max", PUT_FRAME_BYTES_MAX)))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "EdgeLink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _exchange(self, messages: list) -> list:
        replies = []
        for start in range(0, len(messages), PIPELINE_BATCH_FRAMES):
            batch = messages[start:start + PIPELINE_BATCH_FRAMES]
            try:
                replies += self._channel.exchange(batch, time.monotonic() + EXCHANGE_TIMEOUT_S)
            except UpstreamError as exc:
                raise EdgePushError(f"edge {self.edge.name} ({self.edge.address}): {describe(exc)}") from None
        return replies

    def present(self, keys: Sequence[bytes], ns_id: bytes | None) -> np.ndarray:
        """Per key, whether the edge holds it now (LOOKUP with locations)."""
        chunks = [tuple(keys[i:i + self._batch]) for i in range(0, len(keys), self._batch)]
        replies = self._exchange([p.Lookup(0, c, True, ns_id) for c in chunks])
        return np.array([loc is not None for r in replies for loc in r.locations], dtype=bool)

    def put(self, keys: Sequence[bytes], blocks: Sequence, ns_id: bytes | None) -> int:
        """Store whole verified blocks under their keys; returns the bytes sent."""
        frames, fk, fb, size, total = [], [], [], 0, 0
        for key, block in zip(keys, blocks):
            view = memoryview(block).cast("B")
            if fk and (len(fk) == self._batch or size + view.nbytes > self._frame_bytes):
                frames.append(p.Put(0, tuple(fk), tuple(fb), False, ns_id))
                fk, fb, size = [], [], 0
            fk.append(key)
            fb.append(view)
            size += view.nbytes
            total += view.nbytes
        if fk:
            frames.append(p.Put(0, tuple(fk), tuple(fb), False, ns_id))
        self._exchange(frames)
        return total

    def soft_pin(self, keys: Sequence[bytes], ns_id: bytes | None, ttl_s: float) -> list[bool]:
        """Soft-pin ``keys`` for ``ttl_s``; per key, whether the edge holds it (and so pinned it)."""
        chunks = [tuple(keys[i:i + self._batch]) for i in range(0, len(keys), self._batch)]
        ttl_ms = soft_pin_ttl_ms(ttl_s)
        replies = self._exchange([p.Pin(0, c, ns_id, ttl_ms) for c in chunks])
        return [ok for r in replies for ok in r.results]
