"""Content-addressed block keys.

A :class:`Namespace` pins everything that makes two KV blocks interchangeable:
the model, the KV layout, the codec and an optional tenant salt (plus any
extra fields an engine needs, such as a LoRA adapter or a tensor-parallel
shard). Its id is a BLAKE2b-128 digest of a canonical encoding of those fields.

Keys chain over full blocks of ``block_tokens`` tokens, as vLLM's prefix
caching does::

    key[0] = H(ns_id   || tokens[0:B])
    key[i] = H(key[i-1] || tokens[i*B:(i+1)*B])

Tokens are hashed as little-endian uint32. ``H`` is BLAKE2b with a 16-byte
digest: cryptographic, so one tenant cannot forge another's prefix, and with
no per-process seed, so every process on every machine computes the same keys.
"""
from __future__ import annotations

import array
import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np

KEY_SIZE_BYTES = 16  # also the NVMe Key-Value command set's maximum key size
_NS_PERSON = b"kvtier-ns-v1"
_BLOCK_PERSON = b"kvtier-blk-v1"
_GROUP_PERSON = b"kvtier-grp-v1"
TOKEN_ID_MAX = 2**32 - 1  # tokens are hashed as uint32
KV_DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV cache a block holds: every layer's K and V for
    ``block_tokens`` tokens.

    ``layer_groups`` > 1 stores each block as that many objects, one per group of
    consecutive layers, each under a key of its own (:func:`layer_group_key`): a
    reader hands layer group 0 of every block to the model while the later groups
    are still arriving::

        block i = [layers 0..a) [layers a..b) ... [layers ..L)    group g: key(i, g)
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    block_tokens: int = 16
    layer_groups: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "layer_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KVLayout.dtype must be one of {KV_DTYPES}, got {self.dtype!r}")
        if self.layer_groups > self.num_layers:
            raise ValueError(f"KVLayout.layer_groups {self.layer_groups} is more than its {self.num_layers} layers")

    def group_layers(self, group: int) -> range:
        """The layers of layer group ``group`` (groups differ in size by at most one layer)."""
        if not 0 <= group < self.layer_groups:
            raise ValueError(f"layer group {group} is outside 0..{self.layer_groups - 1}")
        return range(group * self.num_layers // self.layer_groups, (group + 1) * self.num_layers // self.layer_groups)

    def group_of_layer(self, layer: int) -> int:
        """The layer group holding ``layer``."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is outside 0..{self.num_layers - 1}")
        return ((layer + 1) * self.layer_groups - 1) // self.num_layers

    def group_shape(self, group: int) -> tuple[int, int, int, int, int]:
        """``block_shape`` of one layer group."""
        return (len(self.group_layers(group)), *self.block_shape[1:])

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "float32" else 2

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """``[layers, 2 (K, V), kv_heads, block_tokens, head_dim]``."""
        return (self.num_layers, 2, self.num_kv_heads, self.block_tokens, self.head_dim)

    @property
    def block_raw_bytes(self) -> int:
        """Bytes of one block's KV before any codec."""
        n = 1
        for d in self.block_shape:
            n *= d
        return n * self.itemsize


@dataclass(frozen=True)
class Namespace:
    """Everything that makes KV blocks interchangeable; see the module doc."""

    model: str
    layout: KVLayout
    codec: str = "raw"
    tenant_salt: str = ""
    extra: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("Namespace.model must be a non-empty string")
        if not isinstance(self.layout, KVLayout):
            raise ValueError("Namespace.layout must be a KVLayout")
        if not isinstance(self.codec, str) or not self.codec:
            raise ValueError("Namespace.codec must be a non-empty string")
        if not isinstance(self.tenant_salt, str):
            raise ValueError("Namespace.tenant_salt must be a string")
        for k, v in dict(self.extra).items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise ValueError(f"Namespace.extra must map str to str, got {k!r}: {v!r}")
        # A frozen, hashable copy so that callers cannot mutate it afterwards.
        object.__setattr__(self, "extra", _FrozenMapping(dict(self.extra)))

    def canonical(self) -> bytes:
        """The bytes the id is a digest of: sorted-key JSON, no whitespace."""
        doc = {
            "v": 1,
            "model": self.model,
            "layout": {
                "num_layers": self.layout.num_layers,
                "num_kv_heads": self.layout.num_kv_heads,
                "head_dim": self.layout.head_dim,
                "dtype": self.layout.dtype,
                "block_tokens": self.layout.block_tokens,
                # blocks stored whole keep the ids they had before layer groups existed
                **({"layer_groups": self.layout.layer_groups} if self.layout.layer_groups != 1 else {}),
            },
            "codec": self.codec,
            "tenant_salt": self.tenant_salt,
            "extra": dict(self.extra),
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @functools.cached_property
    def id(self) -> bytes:
        """The digest of :meth:`canonical`, computed once per namespace object."""
        return hashlib.blake2b(self.canonical(), digest_size=KEY_SIZE_BYTES, person=_NS_PERSON).digest()

    def with_extra(self, **extra: str) -> "Namespace":
        """A namespace with more extra fields (a LoRA id, a TP shard, ...)."""
        merged = dict(self.extra)
        merged.update(extra)
        return Namespace(self.model, self.layout, self.codec, self.tenant_salt, merged)

    def keys(self, tokens: Sequence[int] | np.ndarray) -> list[bytes]:
        return chain_keys(self.id, tokens, self.layout.block_tokens)

    def key_chain(self) -> "KeyChain":
        """An empty :class:`KeyChain` of this namespace, for a sequence that grows."""
        return KeyChain(self.id, self.layout.block_tokens)


class _FrozenMapping(dict):
    """A dict that refuses mutation and hashes by content."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("Namespace.extra is immutable")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))


def tokens_as_uint32(tokens: Sequence[int] | np.ndarray | Iterable[int]) -> np.ndarray:
    """Tokens as a little-endian uint32 array; ValueError for ids out of range."""
    if isinstance(tokens, (list, tuple)):
        try:
            return np.frombuffer(array.array("I", tokens), dtype="<u4")  # one C pass; range checked by array
        except OverflowError:
            raise ValueError("token ids must lie in [0, 2**32)") from None
        except TypeError:
            pass  # not plain ints (numpy scalars, floats): the checks below name the problem
    arr = np.asarray(tokens if not isinstance(tokens, (map, filter)) else list(tokens))
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > TOKEN_ID_MAX):
        raise ValueError("token ids must lie in [0, 2**32)")
    return arr.astype("<u4", copy=False)


def _check_chain(ns_id: bytes, block_tokens: int) -> None:
    if len(ns_id) != KEY_SIZE_BYTES:
        raise ValueError(f"namespace id must be {KEY_SIZE_BYTES} bytes, got {len(ns_id)}")
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")


def _extend_chain(prev: bytes, data: memoryview, stride: int, out: list[bytes]) -> None:
    """Append the chained key of every full ``stride``-byte block of ``data`` to ``out``."""
    for start in range(0, data.nbytes - stride + 1, stride):
        h = hashlib.blake2b(prev, digest_size=KEY_SIZE_BYTES, person=_BLOCK_PERSON)
        h.update(data[start:start + stride])
        prev = h.digest()
        out.append(prev)


def chain_keys(ns_id: bytes, tokens: Sequence[int] | np.ndarray, block_tokens: int) -> list[bytes]:
    """The chained key of every full block of ``tokens`` (a partial tail gets none)."""
    _check_chain(ns_id, block_tokens)
    keys: list[bytes] = []
    _extend_chain(ns_id, memoryview(tokens_as_uint32(tokens)).cast("B"), block_tokens * 4, keys)
    return keys


class KeyChain:
    """The keys of one growing token sequence (a request's prompt and output), extended
    by the blocks completed since the last call: O(new blocks) per step, not O(sequence).

    The sequence may only grow: the tokens already hashed are taken as unchanged."""

    def __init__(self, ns_id: bytes, block_tokens: int) -> None:
        _check_chain(ns_id, block_tokens)
        self._ns_id = ns_id
        self._block_tokens = block_tokens
        self._keys: list[bytes] = []

    @property
    def keys(self) -> list[bytes]:
        """The keys of every full block hashed so far (the list itself: do not modify it)."""
        return self._keys

    @property
    def tokens_hashed(self) -> int:
        return len(self._keys) * self._block_tokens

    def extend(self, tokens: Sequence[int] | np.ndarray) -> list[bytes]:
        """Hash the full blocks of ``tokens`` (the whole sequence so far) not hashed yet;
        returns :attr:`keys`."""
        done = self.tokens_hashed
        full = len(tokens) // self._block_tokens * self._block_tokens
        if full > done:
            prev = self._keys[-1] if self._keys else self._ns_id
            data = memoryview(tokens_as_uint32(tokens[done:full])).cast("B")
            _extend_chain(prev, data, self._block_tokens * 4, self._keys)
        return self._keys


def layer_group_key(block_key: bytes, group: int) -> bytes:
    """The key of layer group ``group`` of a block: the block's own key for group 0,
    a digest of the block key and the group number for the others."""
    if group == 0:
        return block_key
    return hashlib.blake2b(group.to_bytes(4, "little"), digest_size=KEY_SIZE_BYTES, person=_GROUP_PERSON,
                           key=block_key).digest()


def repeated_key(keys) -> str | None:
    """Which items of a batch that stores blocks name one key twice (the first such pair), or None:
    such a batch names each key once, as two blocks under one key in one request is a broken client."""
    keys = keys if isinstance(keys, list) else list(keys)
    if len(set(keys)) == len(keys):  # the common case, at C speed (keys are bytes)
        return None
    seen: dict[bytes, int] = {}
    for again, key in enumerate(keys):
        first = seen.setdefault(key, again)
        if first != again:
            return f"items {first} and {again} name the same key {bytes(key).hex()}"
    return None
