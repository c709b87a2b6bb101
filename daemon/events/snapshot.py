"""A subscriber's starting point: every key a daemon stores and the sequence number of the
newest batch that state includes.

Taken under the engine lock (``Engine.stored_keys``) with the sink's position read in the
same hold, so applying the batches numbered above ``seq`` to ``keys`` gives the daemon's
state from then on. Keys carry their namespace already (a chain starts from the namespace
id), so one set serves every namespace.

The admin API serves it as JSON (``GET /v1/kv-events/snapshot``)::

    {"seq": S, "first_seq": F, "block_count": N, "keys": "<base64 of N x 16 bytes, packed>"}
"""
from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

from kvtier.common.keys import KEY_SIZE_BYTES

from .event_sink import KVEventSink


@dataclass(frozen=True)
class KVSnapshot:
    seq: int
    first_seq: int  # the first number of this daemon run: a subscriber older than that missed a restart
    packed_keys: bytes  # N x 16 bytes

    @property
    def block_count(self) -> int:
        return len(self.packed_keys) // KEY_SIZE_BYTES

    def keys(self) -> list[bytes]:
        p = self.packed_keys
        return [p[i:i + KEY_SIZE_BYTES] for i in range(0, len(p), KEY_SIZE_BYTES)]

    def as_document(self) -> dict:
        return {"seq": self.seq, "first_seq": self.first_seq, "block_count": self.block_count,
                "keys": base64.b64encode(self.packed_keys).decode()}


def take_snapshot(engine, sink: KVEventSink) -> KVSnapshot:
    k0, k1, seq = engine.stored_keys(then=sink.position)
    packed = np.stack([k0, k1], axis=1).astype("<u8").tobytes() if len(k0) else b""
    return KVSnapshot(seq=seq, first_seq=sink.first_seq, packed_keys=packed)


def snapshot_from_document(doc: dict) -> KVSnapshot:
    """The inverse of :meth:`KVSnapshot.as_document`; ValueError names a malformed field."""
    try:
        seq, first_seq, packed = int(doc["seq"]), int(doc["first_seq"]), base64.b64decode(doc["keys"], validate=True)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a KV-events snapshot: {type(exc).__name__}: {exc}") from None
    if len(packed) % KEY_SIZE_BYTES:
        raise ValueError(f"snapshot keys: {len(packed)} bytes is not a whole number of {KEY_SIZE_BYTES}-byte keys")
    return KVSnapshot(seq, first_seq, packed)
