"""Request bodies of the admin API: pydantic models that validate themselves.

A key travels as 32 hex digits. A set of blocks is named either by its keys or
by a namespace and a token list, which the daemon turns into the chained keys
with :mod:`kvtier.common.keys` (the same keys every engine computes).
"""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from kvtier.common.keys import KEY_SIZE_BYTES, KV_DTYPES, KVLayout, Namespace

KEYS_PER_REQUEST_MAX = 65536  # one pin/evict call stays a bounded batch (1 MiB of keys)
TOKENS_PER_REQUEST_MAX = 4 << 20  # a 4M-token prefix is far past any context window
PIN_TTL_S_MAX = (2**32 - 1) / 1000  # a soft pin's TTL, as the data protocol's u32 of milliseconds allows
NAMESPACE_FIELD_CHARS_MAX = 1024  # model names and salts are short; bound the hashing work

KeyHex = Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{%d}$" % (2 * KEY_SIZE_BYTES))]


def key_from_hex(text: str) -> bytes:
    """32 hex digits -> 16 bytes; ValueError naming the problem otherwise."""
    if len(text) != 2 * KEY_SIZE_BYTES:
        raise ValueError(f"a key is {2 * KEY_SIZE_BYTES} hex digits, got {len(text)} characters")
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"key {text!r} is not hexadecimal") from None


class _Strict(BaseModel):
    """Unknown fields refused, and JSON values of the declared type only (``"yes"`` is not true, nor
    ``true`` a token id)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class LayoutSpec(_Strict):
    num_layers: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    dtype: str = "float16"
    block_tokens: int = Field(default=16, gt=0)

    @model_validator(mode="after")
    def _known_dtype(self) -> "LayoutSpec":
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"layout.dtype must be one of {list(KV_DTYPES)}, got {self.dtype!r}")
        return self


class NamespaceSpec(_Strict):
    """The fields of :class:`kvtier.common.keys.Namespace`, as JSON."""

    model: str = Field(min_length=1, max_length=NAMESPACE_FIELD_CHARS_MAX)
    layout: LayoutSpec
    codec: str = Field(default="raw", min_length=1, max_length=NAMESPACE_FIELD_CHARS_MAX)
    tenant_salt: str = Field(default="", max_length=NAMESPACE_FIELD_CHARS_MAX)
    extra: dict[str, str] = Field(default_factory=dict)

    def to_namespace(self) -> Namespace:
        layout = KVLayout(**self.layout.model_dump())
        return Namespace(self.model, layout, self.codec, self.tenant_salt, dict(self.extra))


class KeySelection(_Strict):
    """Either ``keys`` or ``namespace`` + ``tokens`` (their full blocks' chained keys)."""

    keys: list[KeyHex] | None = Field(default=None, max_length=KEYS_PER_REQUEST_MAX)
    namespace: NamespaceSpec | None = None
    tokens: list[Annotated[int, Field(ge=0, lt=2**32)]] | None = Field(
        default=None, max_length=TOKENS_PER_REQUEST_MAX)

    @model_validator(mode="after")
    def _one_form(self) -> "KeySelection":
        by_keys = self.keys is not None
        by_tokens = self.namespace is not None or self.tokens is not None
        if by_keys == by_tokens:
            raise ValueError("give either 'keys' or 'namespace' with 'tokens'")
        if by_tokens and (self.namespace is None or self.tokens is None):
            raise ValueError("'namespace' and 'tokens' go together")
        return self

    def resolve(self) -> list[bytes]:
        """The keys this selection names, in chain order."""
        if self.keys is not None:
            return [bytes.fromhex(k) for k in self.keys]
        assert self.namespace is not None and self.tokens is not None
        return self.namespace.to_namespace().keys(self.tokens)


class PinSelection(KeySelection):
    """A :class:`KeySelection` to pin; ``ttl_s``: a soft pin that expires by itself after that many
    seconds (memory only, gone at a restart); omitted: a hard pin, kept until unpinned."""

    ttl_s: float | None = Field(default=None, gt=0, le=PIN_TTL_S_MAX, strict=True)  # true is not 1 s


class EvictRequest(_Strict):
    """Exactly one of: ``keys``, ``namespace_id`` (hex), ``namespace`` (its fields), ``all``."""

    keys: list[KeyHex] | None = Field(default=None, max_length=KEYS_PER_REQUEST_MAX)
    namespace_id: KeyHex | None = None
    namespace: NamespaceSpec | None = None
    all: bool = False

    @model_validator(mode="after")
    def _one_form(self) -> "EvictRequest":
        given = [self.keys is not None, self.namespace_id is not None, self.namespace is not None, self.all]
        if sum(given) != 1:
            raise ValueError("give exactly one of 'keys', 'namespace_id', 'namespace' or 'all': true")
        return self

    def namespace_id_bytes(self) -> bytes | None:
        if self.namespace_id is not None:
            return bytes.fromhex(self.namespace_id)
        if self.namespace is not None:
            return self.namespace.to_namespace().id
        return None
