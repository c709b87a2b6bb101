"""Replays a ``cdn_trace`` trace against a running ``cdn_cluster.Cdn``: one simulated engine per
edge (a thread with its own ``KVCache`` at that edge), requests sent to the edge of their
user (session affinity, as a router hashing the session does).

Per request the engine loads the longest stored prefix through its edge (``KVCache.load``:
blocks the edge holds are warm, blocks the edge fetched from the region are cold, the rest
is recomputed), then stores the blocks it had to compute at its edge and at the region
(``KVCache.store`` to each, synthetic KV), as an engine publishing its KV to the regional
tier would.
"""
from __future__ import annotations

import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from cdn_trace import Request, edge_of_user, render, tokenize
from kvtier.client.kvcache import KVCache
from prompt_normalize import COMMON_MARKER_PATTERNS, NormalizeConfig, Normalizer
from kvtier.common.keys import KVLayout, Namespace

# 2 layers x (K, V) x 1 KV head x 16 tokens x head_dim 16 x fp16 = 2 KiB of raw KV per block
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=16, dtype="float16", block_tokens=16)
NAMESPACE = Namespace(model="cdn-bench", layout=LAYOUT, codec="raw")
MAX_PROMPT_TOKENS = 4096  # longer than any trace prompt; the synthetic KV is sliced from one tensor


@dataclass
class EdgeTally:
    """One edge's counts over its requests; written by its thread only."""

    requests: int = 0
    blocks_asked: int = 0  # full blocks of the prompts
    blocks_shareable: int = 0  # full blocks before the user's own question: what a cache can ever serve
    blocks_edge: int = 0  # served by the edge itself (warm)
    blocks_cold: int = 0  # fetched by the edge from the region (cold)
    blocks_computed: int = 0  # found nowhere: the engine prefills them
    blocks_stored_edge: int = 0
    blocks_stored_region: int = 0
    second_requests: int = 0  # requests reaching the end of a prefix this edge fetched cold earlier
    second_warm: int = 0  # ... that the edge served itself up to that end
    load_s: list = field(default_factory=list)
    _cold_ends: dict = field(default_factory=dict)  # last key of a cold-fetched prefix -> its depth

    def merge(self, other: "EdgeTally") -> None:
        for name in ("requests", "blocks_asked", "blocks_shareable", "blocks_edge", "blocks_cold", "blocks_computed",
                     "blocks_stored_edge", "blocks_stored_region", "second_requests", "second_warm"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.load_s += other.load_s


def note_second_requests(tally: EdgeTally, keys: Sequence[bytes], edge_blocks: int, cold_blocks: int) -> None:
    """Score this request against the cold-fetched prefixes it reaches the end of, then remember
    the prefix it fetched cold itself. The edge's blocks lead a load, its upstream's follow."""
    for depth, key in enumerate(keys):
        if key in tally._cold_ends:
            del tally._cold_ends[key]  # only the second request counts
            tally.second_requests += 1
            tally.second_warm += depth < edge_blocks
    if cold_blocks:
        tally._cold_ends[keys[edge_blocks + cold_blocks - 1]] = edge_blocks + cold_blocks


def synthetic_kv(seed: int = 0) -> list:
    generator = torch.Generator().manual_seed(seed)
    shape = (1, LAYOUT.num_kv_heads, MAX_PROMPT_TOKENS, LAYOUT.head_dim)
    return [(torch.randn(shape, generator=generator, dtype=torch.float32).to(torch.float16),
             torch.randn(shape, generator=generator, dtype=torch.float32).to(torch.float16))
            for _ in range(LAYOUT.num_layers)]


def prompt_tokens(request: Request, normalizer: Normalizer | None) -> tuple[list[int], int]:
    """The prompt's tokens, and how many of them come before the user's own question (the part
    another request can share)."""
    messages = list(request.messages)
    if normalizer is not None:
        messages = normalizer.normalize_messages(messages)
    text = render(messages)
    return tokenize(text), len(tokenize(text[:text.index(request.question_marker)]))


def serve(edge: KVCache, region: KVCache, kv: list, tokens: list[int], shareable_tokens: int,
          tally: EdgeTally) -> None:
    started = time.perf_counter()
    loaded = edge.load(tokens)
    tally.load_s.append(time.perf_counter() - started)
    full = len(tokens) // LAYOUT.block_tokens
    cold = loaded.transports.get("upstream", 0)
    tally.requests += 1
    tally.blocks_asked += full
    tally.blocks_shareable += shareable_tokens // LAYOUT.block_tokens
    tally.blocks_edge += loaded.num_blocks - cold
    tally.blocks_cold += cold
    tally.blocks_computed += full - loaded.num_blocks
    note_second_requests(tally, edge.keys_for(tokens), loaded.num_blocks - cold, cold)
    if loaded.num_blocks < full:
        computed = [(k[:, :, :len(tokens)], v[:, :, :len(tokens)]) for k, v in kv]
        tally.blocks_stored_edge += edge.store(tokens, computed)
        tally.blocks_stored_region += region.store(tokens, computed)


def replay(requests: Sequence[Request], edge_addrs: Sequence[str], region_addr: str, region_token: str,
           normalize: bool, progress: Callable[[int, int], None] | None = None,
           progress_every_s: float = 5.0, concurrent: bool = True) -> tuple[list[EdgeTally], list]:
    """Run the trace; returns each edge's tally and each edge engine's ``KVCache.statistics()``.
    ``concurrent``: the edges' engines run at once, each in its own thread; otherwise one thread
    serves the requests in trace order (reproducible, for tests)."""
    normalizer = Normalizer(NormalizeConfig(marker_patterns=COMMON_MARKER_PATTERNS)) if normalize else None
    edge_of = [edge_of_user(r.user, len(edge_addrs)) for r in requests]
    tallies = [EdgeTally() for _ in edge_addrs]
    kv = synthetic_kv()
    with ExitStack() as stack:
        caches = [(stack.enter_context(KVCache(NAMESPACE, addr, hot_pool_bytes=0, transport="tcp")),
                   stack.enter_context(KVCache(NAMESPACE, region_addr, token=region_token, hot_pool_bytes=0,
                                               transport="tcp")))
                  for addr in edge_addrs]

        def run_edge(i: int | None) -> None:
            for request, edge in zip(requests, edge_of):
                if i is None or edge == i:
                    serve(*caches[edge], kv, *prompt_tokens(request, normalizer), tallies[edge])

        if concurrent:
            _in_threads(run_edge, len(edge_addrs), lambda: progress and progress(
                sum(tally.requests for tally in tallies), len(requests)), progress_every_s)
        else:
            run_edge(None)
        return tallies, [edge.statistics() for edge, _ in caches]


def _in_threads(work: Callable[[int], None], count: int, tick: Callable[[], None], tick_every_s: float) -> None:
    """``work(i)`` for each i in its own thread, ``tick()`` every ``tick_every_s`` until all are done;
    the first exception raised in a thread is raised here."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), name=f"edge-engine-{i}") for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(tick_every_s)
            tick()
    if errors:
        raise errors[0]


__all__ = ["EdgeTally", "LAYOUT", "NAMESPACE", "note_second_requests", "prompt_tokens", "replay", "serve",
           "synthetic_kv"]
