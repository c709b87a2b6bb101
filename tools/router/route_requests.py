"""The body of ``POST /v1/route``, parsed into a key chain (pure).

One of::

    {"keys": ["<32 hex digits>", ...]}                               the chain itself
    {"namespace": {"model": ..., "layout": {...}, ...}, "tokens": [...]}   its fields (as the admin API takes them)
    {"ns_id": "<32 hex digits>", "block_tokens": 16, "tokens": [...]}      its id and block size

Keys are computed with :mod:`kvtier.common.keys`, as every engine computes them.
"""
from __future__ import annotations

from kvtier.common.keys import KEY_SIZE_BYTES, chain_keys
from kvtier.daemon.admin.models import KEYS_PER_REQUEST_MAX, TOKENS_PER_REQUEST_MAX, NamespaceSpec, key_from_hex

FORMS = "give 'keys', or 'namespace' and 'tokens', or 'ns_id', 'block_tokens' and 'tokens'"


class RouteRequestError(ValueError):
    """A route request that cannot be answered; the message names the problem."""


def route_keys(doc) -> list[bytes]:
    if not isinstance(doc, dict):
        raise RouteRequestError(f"the body must be a JSON object: {FORMS}")
    forms = [name for name in ("keys", "namespace", "ns_id") if name in doc]
    if len(forms) != 1:
        raise RouteRequestError(FORMS)
    allowed = {"keys": {"keys"}, "namespace": {"namespace", "tokens"}, "ns_id": {"ns_id", "block_tokens", "tokens"}}
    unknown = set(doc) - allowed[forms[0]]
    if unknown:
        raise RouteRequestError(f"unknown fields {sorted(unknown)}: {FORMS}")
    try:
        if forms[0] == "keys":
            keys = doc["keys"]
            if not isinstance(keys, list) or len(keys) > KEYS_PER_REQUEST_MAX:
                raise RouteRequestError(f"'keys' must be a list of at most {KEYS_PER_REQUEST_MAX} hex keys")
            return [key_from_hex(k) if isinstance(k, str) else _not_hex(k) for k in keys]
        tokens = _tokens(doc)
        if forms[0] == "namespace":
            try:
                namespace = NamespaceSpec.model_validate(doc["namespace"]).to_namespace()
            except ValueError as exc:
                raise RouteRequestError(f"namespace: {exc}") from None
            return namespace.keys(tokens)
        ns_id = key_from_hex(doc["ns_id"]) if isinstance(doc["ns_id"], str) else _not_hex(doc["ns_id"])
        block_tokens = doc.get("block_tokens")
        if not isinstance(block_tokens, int) or isinstance(block_tokens, bool) or block_tokens <= 0:
            raise RouteRequestError(f"'block_tokens' must be a positive integer, got {block_tokens!r}")
        return chain_keys(ns_id, tokens, block_tokens)
    except RouteRequestError:
        raise
    except ValueError as exc:
        raise RouteRequestError(str(exc)) from None


def _tokens(doc: dict) -> list[int]:
    tokens = doc.get("tokens")
    if not isinstance(tokens, list) or len(tokens) > TOKENS_PER_REQUEST_MAX:
        raise RouteRequestError(f"'tokens' must be a list of at most {TOKENS_PER_REQUEST_MAX} token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise RouteRequestError("'tokens' must hold integers")
    return tokens


def _not_hex(value) -> bytes:
    raise RouteRequestError(f"a key is {2 * KEY_SIZE_BYTES} hex digits, got {type(value).__name__} {value!r}")
