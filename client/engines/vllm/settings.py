"""``kv_connector_extra_config``: kvtier's settings for the vLLM connector, validated
(no framework imports; every key is described in docs/vllm.md)."""
from __future__ import annotations

from dataclasses import dataclass

from kvtier.client.engines.vllm.scheduler_plan import STORE_POLICIES
from kvtier.client.save_queue import SAVE_QUEUE_BYTES_MAX
from kvtier.common.tokens import read_token_file

DEFAULT_ADDRESS = "127.0.0.1:7410"
DEFAULT_WORKER_HOT_POOL_BYTES = 0  # vLLM's own prefix cache is the hot tier


@dataclass(frozen=True)
class KVTierSettings:
    """``kv_connector_extra_config``, validated (see docs/vllm.md)."""

    addresses: tuple[str, ...]
    token: str | None
    codec: str
    tenant: str
    model_id: str | None
    store: str
    hot_pool_bytes: int
    transport: str
    device_map: dict | None
    load_async: bool = False  # True: loads run between steps (the request waits, the batch goes on)
    save_queue_bytes: int = SAVE_QUEUE_BYTES_MAX  # per tenant cache: write-behind bytes queued at most

    KEYS = frozenset({"address", "token", "token_file", "codec", "tenant", "model_id", "store",
                      "hot_pool_bytes", "transport", "device_map", "load_async", "save_queue_bytes"})

    @classmethod
    def from_extra(cls, extra: dict) -> "KVTierSettings":
        unknown = set(extra) - cls.KEYS
        if unknown:
            raise ValueError(f"unknown kvtier settings {sorted(unknown)} in kv_connector_extra_config; "
                             f"known: {sorted(cls.KEYS)}")
        get = extra.get
        address = get("address", DEFAULT_ADDRESS)
        addresses = (address,) if isinstance(address, str) else tuple(address)
        token = get("token", None)
        token_file = get("token_file", None)
        if token is None and token_file:
            token = read_token_file(token_file)
        store = get("store", "prompt")
        if store not in STORE_POLICIES:
            raise ValueError(f"kvtier store must be one of {STORE_POLICIES}, got {store!r}")
        hot = int(get("hot_pool_bytes", DEFAULT_WORKER_HOT_POOL_BYTES))
        load_async = get("load_async", False)
        if not isinstance(load_async, bool):
            raise ValueError(f"kvtier load_async must be true or false, got {load_async!r}")
        queue_bytes = int(get("save_queue_bytes", SAVE_QUEUE_BYTES_MAX))
        if queue_bytes <= 0:
            raise ValueError(f"kvtier save_queue_bytes must be positive, got {queue_bytes}")
        return cls(addresses, token, str(get("codec", "raw")), str(get("tenant", "")),
                   get("model_id", None), store, hot, str(get("transport", "auto")), get("device_map", None),
                   load_async, queue_bytes)
