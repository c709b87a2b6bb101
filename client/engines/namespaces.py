"""Namespaces and keys the engine connectors derive (no framework imports).

Everything that makes two blocks interchangeable enters the namespace, so a
block can only ever be found by a request whose KV it really is:

    base      model, KV layout, codec, operator tenant      (from the config)
    + request tenant_salt <- the request's cache_salt        (per-user isolation)
              extra lora  <- the LoRA adapter's name and path (adapters change K and V; a name
                                                        re-pointed at other weights is another one)
    + shard   extra tp="rank/size" (and pp="rank/size")      each rank stores its own heads

Two namespaces are derived per request, for two jobs::

    tenant namespace  base + request              its id is what the daemon sees: the block
                      (request_namespace(base))   header's and the PUT/GET/LOOKUP frames' ns id,
                                                  so per-tenant statistics, eviction and
                                                  delete_namespace separate tenants and adapters
    key namespace     tenant + shard              the key chain starts from its id, so the TP
                      (key_namespace(tenant))     shards (whose KV differs) never share a key

Every shard of one tenant stores under the same namespace id: deleting a
tenant's namespace deletes all its shards' blocks.

SGLang names its pages with string hashes (already chained over the prefix);
:func:`page_key` maps one to a 16-byte key with BLAKE2b-128 keyed by the
namespace id, so the same page string in two namespaces gives unrelated keys.
"""
from __future__ import annotations

import hashlib
import json

from kvtier.common.keys import KEY_SIZE_BYTES, Namespace

_PAGE_PERSON = b"kvtier-page-v1"
PAGE_KEY_CHARS_MAX = 4096  # SGLang page hashes are 64 hex chars; refuse anything absurd


def shard_namespace(base: Namespace, tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1) -> Namespace:
    """``base`` for one tensor-parallel (and pipeline) shard."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp rank {tp_rank} outside 0..{tp_size - 1}")
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp rank {pp_rank} outside 0..{pp_size - 1}")
    extra = {"tp": f"{tp_rank}/{tp_size}"}
    if pp_size > 1:
        extra["pp"] = f"{pp_rank}/{pp_size}"
    return base.with_extra(**extra)


def request_namespace(shard: Namespace, cache_salt: str | None, lora_name: str | None) -> Namespace:
    """``shard`` narrowed to one request's cache salt and LoRA adapter.

    The operator's tenant salt and the request's salt are combined as a JSON
    pair, so no choice of either can collide with another combination."""
    ns = shard
    if cache_salt:
        salt = json.dumps([ns.tenant_salt, str(cache_salt)], separators=(",", ":"))
        ns = Namespace(ns.model, ns.layout, ns.codec, salt, dict(ns.extra))
    if lora_name:
        ns = ns.with_extra(lora=str(lora_name))
    return ns


def adapter_identity(lora_name: str | None, lora_path: str | None = None) -> str | None:
    """The part of a namespace that names one LoRA adapter: its name, with the path of its
    weights where the engine gives one (as a JSON pair: no choice of either collides with
    another combination). None without an adapter."""
    if not lora_name:
        return None
    return json.dumps([str(lora_name), str(lora_path)], separators=(",", ":")) if lora_path else str(lora_name)


def key_namespace(tenant: Namespace, tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1) -> Namespace:
    """The namespace whose id seeds a shard's keys (see the module doc); the
    same as :func:`shard_namespace` of the tenant namespace."""
    return shard_namespace(tenant, tp_rank, tp_size, pp_rank, pp_size)


def page_key(ns_id: bytes, page: str) -> bytes:
    """The 16-byte key of an engine's page-hash string within a namespace."""
    if len(ns_id) != KEY_SIZE_BYTES:
        raise ValueError(f"namespace id must be {KEY_SIZE_BYTES} bytes, got {len(ns_id)}")
    if not isinstance(page, str) or not page or len(page) > PAGE_KEY_CHARS_MAX:
        raise ValueError(f"page key must be a non-empty string of at most {PAGE_KEY_CHARS_MAX} chars, got {page!r}")
    return hashlib.blake2b(page.encode(), digest_size=KEY_SIZE_BYTES, key=ns_id, person=_PAGE_PERSON).digest()
