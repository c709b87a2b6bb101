"""The vLLM worker's loads: fetches in the background, scatters into the paged cache
(torch and kvtier only; no vLLM imports).

``start`` submits one fetch per request (``KVCache.load_blocks`` on a worker
thread) and returns at once. What happens next depends on how vLLM was told
the load runs (``get_num_new_matched_tokens``' second value)::

    sync load   (the forward of this step needs it)
      wait_for_layer_load(i) -> layer_blocks(i): the blocks of layer i, verified
                             -> scatter layer i into vLLM's paged cache
      wait_for_save / load errors: the layers no attention hook asked for
    async load  (the request waits in WAITING_FOR_REMOTE_KVS, the step goes on)
      get_finished -> poll(): each fetch that is done scatters every layer and
                      its request is reported as finished receiving

:meth:`PendingLoad.layer_blocks` is the one place that waits: today a block
holds every layer, so layer i waits for the whole fetch; per-layer readiness
in ``KVCache`` slots in there. A block that is missing or fails verification
is never written into vLLM's cache: its block id becomes a load error
(``get_block_ids_with_load_errors``), vLLM recomputes from it, and the bad
block is deleted so that the recomputed one can be stored in its place.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from kvtier.client import ClientError
from kvtier.kernels.paged import PagedLayout, scatter_blocks

logger = logging.getLogger(__name__)

IO_ERRORS = (ClientError, OSError)  # the daemon unreachable or refusing: a miss, never a crash
LOAD_WORKERS_MAX = 4  # fetches in flight at once; each is one batched GET per daemon


@dataclass
class PendingLoad:
    """One request's load on the worker."""

    req_id: str
    cache: object  # the tenant's KVCache the blocks are fetched from
    keys: list[bytes]
    block_ids: list[int]
    future: Future
    is_async: bool
    layers_left: set[int]
    ready: bool = False
    good_ids: list[int] = field(default_factory=list)
    buffer: torch.Tensor | None = None  # [good blocks, L, 2, H, T, D]
    bad_ids: list[int] = field(default_factory=list)
    bad_keys: list[bytes] = field(default_factory=list)
    reachable: bool = True

    def layer_blocks(self, layer: int) -> torch.Tensor | None:
        """The verified blocks' layer ``layer`` ``[n, 1, 2, H, T, D]`` (None if none), waiting
        for what that layer needs: today the whole fetch."""
        self._resolve()
        return None if self.buffer is None else self.buffer[:, layer:layer + 1]

    def _resolve(self) -> None:
        if self.ready:
            return
        try:
            blocks = self.future.result()
        except IO_ERRORS as exc:
            logger.warning("kvtier load of %d blocks failed (%s); vLLM recomputes them", len(self.block_ids), exc)
            blocks, self.reachable = [None] * len(self.block_ids), False
        except Exception:  # noqa: BLE001 -- e.g. its tenant's cache closed under it: never the step's crash
            logger.exception("kvtier load of %d blocks failed; vLLM recomputes them", len(self.block_ids))
            blocks, self.reachable = [None] * len(self.block_ids), False
        good, seen = [], set()
        for key, block_id, block in zip(self.keys, self.block_ids, blocks):
            if block is None:
                self.bad_ids.append(block_id)
                self.bad_keys.append(key)
            elif block_id not in seen:
                seen.add(block_id)
                good.append((block_id, block))
        self.good_ids = [b for b, _ in good]
        self.buffer = torch.stack([blk for _, blk in good]) if good else None
        self.ready = True


class WorkerLoads:
    """The loads in flight on one worker; see the module doc."""

    def __init__(self, views: Sequence[torch.Tensor], layout: PagedLayout,
                 discard: Callable[[object, list[bytes]], None], workers: int = LOAD_WORKERS_MAX) -> None:
        self._views = list(views)
        self._layout = layout
        self._discard = discard
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtier-vllm-load")
        self._sync: list[PendingLoad] = []
        self._async: dict[str, PendingLoad] = {}
        self._errors: set[int] = set()
        self.counters = {"loaded_blocks": 0, "failed_blocks": 0}

    def start(self, req_id: str, cache, keys: list[bytes], block_ids: list[int], is_async: bool) -> None:
        """Start the fetch of ``keys`` (into ``block_ids``); never waits."""
        load = PendingLoad(req_id, cache, list(keys), list(block_ids), self._executor.submit(cache.load_blocks, keys),
                           is_async, set(range(len(self._views))))
        if is_async:
            assert req_id not in self._async, f"second async load for request {req_id}"
            self._async[req_id] = load
        else:
            self._sync.append(load)

    def wait_layer(self, layer: int) -> None:
        """Scatter layer ``layer`` of every sync load of this step (waits for its blocks)."""
        for load in self._sync:
            self._scatter(load, layer)

    def finish_sync(self) -> bool:
        """Complete this step's sync loads: the layers no hook asked for, and their errors.
        Whether any of them failed (a block was not written into vLLM's cache)."""
        loads, self._sync = self._sync, []
        for load in loads:
            self._complete(load)
        return any(load.bad_ids for load in loads)

    def poll(self) -> set[str]:
        """Requests whose async fetch is done: scattered, errors recorded (never waits)."""
        done = {r for r, load in self._async.items() if load.future.done()}
        for req_id in done:
            self._complete(self._async.pop(req_id))
        return done

    def take_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def _scatter(self, load: PendingLoad, layer: int) -> None:
        if layer not in load.layers_left:
            return
        blocks = load.layer_blocks(layer)
        load.layers_left.discard(layer)
        if blocks is not None:
            scatter_blocks(blocks.contiguous(), [self._views[layer]], load.good_ids, self._layout)

    def _complete(self, load: PendingLoad) -> None:
        for layer in sorted(load.layers_left):
            self._scatter(load, layer)
        load.layer_blocks(0)  # resolved even with no layers
        self._errors.update(load.bad_ids)
        self.counters["loaded_blocks"] += len(load.good_ids)
        self.counters["failed_blocks"] += len(load.block_ids) - len(load.good_ids)
        if load.bad_keys and load.reachable:
            self._discard(load.cache, load.bad_keys)

    def wait_fetched(self, timeout_s: float | None = None) -> bool:
        """Wait until every fetch in flight has its blocks (not scattered yet); False on
        timeout. Steps never call this: it is for shutdown paths and tests."""
        futures = [load.future for load in (*self._sync, *self._async.values())]
        _, not_done = wait(futures, timeout=timeout_s)
        return not not_done

    @property
    def in_flight(self) -> int:
        return len(self._sync) + len(self._async)

    def close(self) -> None:
        """Wait for the fetches in flight (their results are dropped)."""
        self._executor.shutdown(wait=True)
        self._sync, self._async = [], {}
