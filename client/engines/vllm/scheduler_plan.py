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

Block operations travel to the workers as :class:`BlockOp`, plain picklable
data: the worker derives the keys itself, in its own shard's namespace.
"""
from __future__ import annotations

from dataclasses import dataclass

STORE_POLICIES = ("prompt", "all", "none")


@dataclass(frozen=True)
class BlockOp:
    """Blocks ``first_block ..`` of one request, at vLLM ``block_ids``.

    ``tokens`` is the request's token prefix up to the end of the last block,
    so that the worker can chain the keys; ``cache_salt`` and ``lora_name``
    pick the request's namespace."""

    req_id: str
    tokens: tuple[int, ...]
    first_block: int
    block_ids: tuple[int, ...]
    cache_salt: str | None = None
    lora_name: str | None = None

    def __post_init__(self) -> None:
        if self.first_block < 0 or not self.block_ids:
            raise ValueError(f"BlockOp for {self.req_id}: first_block {self.first_block}, "
                             f"{len(self.block_ids)} block ids")

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


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
    loaded: BlockOp | None = None  # the last load sent to the workers
    keys: tuple = ()  # per TP rank, the chained keys of the request's full blocks
    keys_tokens: int = -1  # the token count ``keys`` was computed for

    def matched_tokens(self, num_tokens: int, local_tokens: int, block_tokens: int) -> int:
        """Tokens beyond ``local_tokens`` that can be loaded: the hit, less the
        last token (vLLM must compute at least one token of the prompt)."""
        hit_tokens = min(self.hit_blocks * block_tokens, num_tokens - 1)
        return max(0, hit_tokens - local_tokens)


def load_op(state: RequestState, tokens, block_ids, local_tokens: int, external_tokens: int,
            block_tokens: int) -> BlockOp | None:
    """The load for ``external_tokens`` past ``local_tokens`` (block aligned), or None."""
    if external_tokens <= 0:
        return None
    if local_tokens % block_tokens:
        raise ValueError(f"local hit of {local_tokens} tokens is not block aligned ({block_tokens})")
    first = local_tokens // block_tokens
    last = -(-(local_tokens + external_tokens) // block_tokens)
    if last > len(block_ids):
        raise ValueError(f"request {state.req_id}: load of blocks {first}..{last} but only "
                         f"{len(block_ids)} blocks allocated")
    return BlockOp(state.req_id, tuple(tokens[:last * block_tokens]), first, tuple(block_ids[first:last]),
                   state.cache_salt, state.lora_name)


def save_op(state: RequestState, tokens, block_ids, computed_after_step: int, num_tokens: int,
            block_tokens: int, policy: str) -> BlockOp | None:
    """The save of the blocks this step completes, or None; advances ``saved_blocks``."""
    if policy not in STORE_POLICIES:
        raise ValueError(f"store policy must be one of {STORE_POLICIES}, got {policy!r}")
    if policy == "none":
        return None
    limit = num_tokens if policy == "all" else min(num_tokens, state.prompt_len)
    full = min(computed_after_step, limit) // block_tokens
    full = min(full, len(block_ids))
    # hit_blocks counts vLLM's local hit too: those blocks were computed by an
    # earlier request, which stored them
    start = max(state.saved_blocks, state.hit_blocks)
    if full <= start:
        return None
    state.saved_blocks = full
    return BlockOp(state.req_id, tuple(tokens[:full * block_tokens]), start, tuple(block_ids[start:full]),
                   state.cache_salt, state.lora_name)

