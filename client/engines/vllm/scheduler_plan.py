"""Scheduler-side bookkeeping of the vLLM connector (no framework imports, no I/O).

Per request the scheduler side remembers where its tokens stand::

    tokens  |<- local hit ->|<---- loaded from kvtier ---->|<-- computed by vLLM -->|
    blocks  0 ........ local_blocks ............. hit_blocks ....................
                                                saved_blocks -> grows as vLLM computes

* a load covers blocks [local_blocks, ceil((local + external) / B)); the last
  block may hold the prompt's final token, which vLLM recomputes anyway (it
  needs its logits): the stored value for it is the same KV;
* a save covers the full blocks between ``saved_blocks`` and what vLLM has
  computed after this step, capped by the store policy (prompt or all tokens)
  and by the tokens the request really has (never speculative drafts).

Each request keeps one :class:`~kvtier.common.keys.KeyChain` per TP rank,
extended by the blocks completed since the last step: a step costs O(its new
blocks), never O(the request). Block operations travel to the workers as
:class:`BlockOp`, plain picklable data holding only what the worker needs for
this step: the keys (per TP rank) and vLLM block ids of the blocks to load or
save, and the request's cache salt and LoRA name (its tenant namespace).
"""
from __future__ import annotations

from dataclasses import dataclass, field

STORE_POLICIES = ("prompt", "all", "none")


@dataclass(frozen=True)
class BlockOp:
    """Blocks ``first_block ..`` of one request, at vLLM ``block_ids``.

    ``keys[rank]`` are the blocks' keys in that TP rank's key namespace (one
    per block id); ``cache_salt`` and ``lora_name`` pick the tenant namespace
    the blocks are stored under."""

    req_id: str
    first_block: int
    block_ids: tuple[int, ...]
    keys: tuple[tuple[bytes, ...], ...]
    cache_salt: str | None = None
    lora_name: str | None = None

    def __post_init__(self) -> None:
        if self.first_block < 0 or not self.block_ids:
            raise ValueError(f"BlockOp for {self.req_id}: first_block {self.first_block}, "
                             f"{len(self.block_ids)} block ids")
        if not self.keys or any(len(k) != len(self.block_ids) for k in self.keys):
            raise ValueError(f"BlockOp for {self.req_id}: {len(self.block_ids)} block ids but keys per rank "
                             f"{[len(k) for k in self.keys]}")

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def tenant(self) -> tuple[str | None, str | None]:
        return (self.cache_salt, self.lora_name)


def interleaved_keys(chains, first: int) -> list[bytes]:
    """The keys of blocks ``first ..`` of every TP rank's chain, block by block (``[r0 b0, r1 b0, ...,
    r0 b1, ...]``), for one LOOKUP of them all: its leading count divided by the ranks is the number
    of leading blocks that every rank holds (a block counts only where all of them do)."""
    return [key for block in zip(*(chain.keys[first:] for chain in chains)) for key in block]


@dataclass
class RequestState:
    """What the scheduler side knows of one live request."""

    req_id: str
    cache_salt: str | None
    lora_name: str | None
    prompt_len: int
    request: object = None  # the engine's request object (the scheduler side's own reference)
    local_tokens: int = 0  # tokens vLLM had computed locally at the last lookup (block aligned)
    hit_blocks: int = 0  # local hit + leading blocks present in kvtier past it (minimum over TP ranks)
    saved_blocks: int = 0  # leading blocks known to be stored
    pending_load: BlockOp | None = None  # planned by update_state_after_alloc, sent by build_connector_meta
    pending_async: bool = False  # the pending load is asynchronous (between steps)
    loaded: BlockOp | None = None  # the last load sent to the workers
    loading_async: bool = False  # an async load was sent and the workers have not reported it done
    chains: tuple = field(default_factory=tuple)  # per TP rank, the KeyChain of the request's full blocks

    @property
    def tenant(self) -> tuple[str | None, str | None]:
        return (self.cache_salt, self.lora_name)

    def extend_keys(self, tokens) -> None:
        """Hash the blocks of ``tokens`` (the whole sequence so far) completed since the last call."""
        for chain in self.chains:
            chain.extend(tokens)

    def keys_of(self, first: int, stop: int) -> tuple[tuple[bytes, ...], ...]:
        """Blocks ``first .. stop`` 's keys per TP rank (already hashed)."""
        out = tuple(tuple(chain.keys[first:stop]) for chain in self.chains)
        assert all(len(k) == stop - first for k in out), (self.req_id, first, stop, [len(c.keys) for c in self.chains])
        return out

    def matched_tokens(self, num_tokens: int, local_tokens: int, block_tokens: int) -> int:
        """Tokens beyond ``local_tokens`` that can be loaded: the hit, less the
        last token (vLLM must compute at least one token of the prompt)."""
        hit_tokens = min(self.hit_blocks * block_tokens, num_tokens - 1)
        return max(0, hit_tokens - local_tokens)


def load_range(state: RequestState, num_block_ids: int, local_tokens: int, external_tokens: int,
               block_tokens: int) -> tuple[int, int] | None:
    """Blocks ``(first, stop)`` of the load for ``external_tokens`` past ``local_tokens``, or None."""
    if external_tokens <= 0:
        return None
    if local_tokens % block_tokens:
        raise ValueError(f"local hit of {local_tokens} tokens is not block aligned ({block_tokens})")
    first = local_tokens // block_tokens
    stop = -(-(local_tokens + external_tokens) // block_tokens)
    if stop > num_block_ids:
        raise ValueError(f"request {state.req_id}: load of blocks {first}..{stop} but only "
                         f"{num_block_ids} blocks allocated")
    return first, stop


def save_range(state: RequestState, computed_after_step: int, num_tokens: int, block_tokens: int,
               policy: str) -> tuple[int, int] | None:
    """Blocks ``(first, stop)`` this step completes and the policy stores, or None;
    advances ``saved_blocks``. vLLM has allocated every block the step computes."""
    if policy not in STORE_POLICIES:
        raise ValueError(f"store policy must be one of {STORE_POLICIES}, got {policy!r}")
    if policy == "none":
        return None
    limit = num_tokens if policy == "all" else min(num_tokens, state.prompt_len)
    full = min(computed_after_step, limit) // block_tokens
    # hit_blocks counts vLLM's local hit too: those blocks were computed by an
    # earlier request, which stored them
    start = max(state.saved_blocks, state.hit_blocks)
    if full <= start:
        return None
    state.saved_blocks = full
    return start, full


def block_op(state: RequestState, first: int, block_ids, keys) -> BlockOp:
    return BlockOp(state.req_id, first, tuple(block_ids), keys, state.cache_salt, state.lora_name)
