"""vLLM's KV-events wire format (``vllm/distributed/kv_events.py``), pure: no sockets.

A publisher sends each batch as a ZMQ multipart message on a PUB socket::

    frame 0  topic         UTF-8 ("" by default: subscribers match every topic)
    frame 1  seq           8 bytes, big-endian: one per batch, contiguous
    frame 2  payload       msgpack of KVEventBatch

    KVEventBatch  = [ts, [event, ...], data_parallel_rank]     (array_like: a msgpack array)
    event         = {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ...,
                     "token_ids": [...], "block_size": N, "lora_id": ..., "medium": ...,
                     "lora_name": ...}                          (tagged: a map with "type")
                  | {"type": "BlockRemoved", "block_hashes": [...], "medium": ...}
                  | {"type": "AllBlocksCleared"}

Fields with a default are omitted when they hold it (``omit_defaults``). The replay socket
(ROUTER) takes ``[b"", start_seq (8 bytes)]`` from a DEALER and answers every buffered batch
from ``start_seq`` on as ``[b"", topic, seq, payload]``, then ``[b"", b"", END_SEQ, b""]``.

kvtier fills the fields it knows: ``block_hashes`` are kvtier keys (16 bytes each, msgpack
bin), ``medium`` is ``"STORAGE"``. A daemon stores blocks by key and never sees their tokens
or block size: ``token_ids`` is empty, ``block_size`` 0 and ``parent_block_hash`` None.
"""
from __future__ import annotations

from typing import Any

import msgspec

SEQ_BYTES = 8  # the sequence frame: an unsigned 64-bit big-endian integer
END_SEQ = (-1).to_bytes(SEQ_BYTES, "big", signed=True)  # the replay's end marker
MEDIUM_STORAGE = "STORAGE"  # vLLM's name for a storage tier below GPU and CPU memory
ExternalBlockHash = bytes | int  # vLLM's type: kvtier always sends its 16-byte keys as bytes


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """The base of the three events: a tagged union (the tag is the class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class KVEventFormatError(ValueError):
    """A message that is not a KV-events batch; the message names what is wrong."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def stored(keys: list[bytes]) -> BlockStored:
    return BlockStored(block_hashes=keys, parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
                       medium=MEDIUM_STORAGE, lora_name=None)


def removed(keys: list[bytes]) -> BlockRemoved:
    return BlockRemoved(block_hashes=keys, medium=MEDIUM_STORAGE)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise KVEventFormatError(f"not a KVEventBatch: {exc}") from None


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big")


def decode_seq(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise KVEventFormatError(f"sequence frame of {len(frame)} bytes, expected {SEQ_BYTES}")
    return int.from_bytes(frame, "big")


def message_frames(topic: bytes, seq: int, payload: bytes) -> tuple[bytes, bytes, bytes]:
    """The PUB message of one batch (and the tail of its replay answer)."""
    return topic, encode_seq(seq), payload


def parse_message(frames: list[bytes]) -> tuple[bytes, int, KVEventBatch]:
    """(topic, seq, batch) of a PUB message; KVEventFormatError names a malformed one."""
    if len(frames) != 3:
        raise KVEventFormatError(f"a KV-events message has 3 frames (topic, seq, payload), got {len(frames)}")
    topic, seq, payload = frames
    return bytes(topic), decode_seq(bytes(seq)), decode_batch(bytes(payload))
