"""Keys and block content for the block workloads.

Keys: block ``i`` of clone ``c`` in key space ``K`` under seed ``S`` is
``BLAKE2b-128(K || c || i, key=S)`` -- deterministic, so a later job (or a
later run) with the same keyspace and seed reads exactly what an earlier one
wrote, like fio's ``filename=``.

Content (``verify``): the payload is the 64-byte BLAKE2b digest of the key,
repeated. A block stored under another key, a flipped byte, or a torn block
all differ from what the key predicts. Without ``verify`` every block of a
clone carries one fixed payload, so generating data costs no CPU in the timed
loop.
"""
from __future__ import annotations

import hashlib

import numpy as np

from kvtier.client.blockformat import BlockFormatError, encode_block, payload_of, verify_block
from kvtier.kernels.codec_ids import OPAQUE_CODEC_ID, codec_id

_KEY_PERSON = b"kvperf-key-v1"
_DATA_PERSON = b"kvperf-data-v1"
_NS_PERSON = b"kvperf-ns-v1"
_PATTERN_BYTES = 64


def block_key(seed: int, keyspace: str, clone: int, index: int) -> bytes:
    h = hashlib.blake2b(digest_size=16, key=seed.to_bytes(8, "little"), person=_KEY_PERSON)
    h.update(f"{keyspace}\0{clone}\0{index}".encode())
    return h.digest()


def keyspace_ns_id(keyspace: str) -> bytes:
    """The namespace id written in kvperf's block headers."""
    return hashlib.blake2b(keyspace.encode(), digest_size=16, person=_NS_PERSON).digest()


def payload_for(key: bytes, size_bytes: int) -> bytes:
    """The payload ``verify`` expects under ``key``."""
    pattern = np.frombuffer(hashlib.blake2b(key, digest_size=_PATTERN_BYTES, person=_DATA_PERSON).digest(),
                            dtype=np.uint8)
    reps = -(-size_bytes // _PATTERN_BYTES)
    return np.tile(pattern, reps)[:size_bytes].tobytes()


def header_codec_id(codec: str) -> int:
    return OPAQUE_CODEC_ID if codec == "opaque" else codec_id(codec)


class BlockMaker:
    """Builds the full blocks (header + payload) a clone puts."""

    def __init__(self, keyspace: str, codec: str, size_bytes: int, verify: bool):
        self.ns_id = keyspace_ns_id(keyspace)
        self.codec_id = header_codec_id(codec)
        self.size_bytes = size_bytes
        self.verify = verify
        self._fixed = None if verify else payload_for(self.ns_id, size_bytes)

    def block(self, key: bytes) -> bytes:
        payload = payload_for(key, self.size_bytes) if self.verify else self._fixed
        return encode_block(key, self.ns_id, self.codec_id, payload)


def check_block(block: bytes | None, key: bytes, size_bytes: int) -> str | None:
    """None when ``block`` is what ``key`` predicts; else what is wrong."""
    if block is None:
        return f"block {key.hex()} is missing (a miss of a block this run or an earlier one wrote)"
    try:
        verify_block(block, expected_key=key)
    except BlockFormatError as e:
        return f"block {key.hex()}: {e}"
    payload = payload_of(block)
    if payload.nbytes != size_bytes:
        return f"block {key.hex()}: payload is {payload.nbytes} bytes, expected {size_bytes}"
    if payload != payload_for(key, size_bytes):
        return f"block {key.hex()}: content differs from what its key predicts"
    return None
