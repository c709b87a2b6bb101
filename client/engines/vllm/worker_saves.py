"""The vLLM worker's write-behind saves (torch and kvtier only; no vLLM imports).

A step's saves never wait for a PUT::

    save_kv_layer(i)   gather layer i of the step's save blocks out of vLLM's paged
                       cache into a reused host staging buffer [L, n, 2, H, T, D]
                       (layer-major: each layer's gather lands in one contiguous run)
    wait_for_save      the layers no hook gathered, then per request
                       KVCache.store_blocks_async(keys, blocks, copy=False): queued as
                       they lie in the staging buffer (the gather is the step's only
                       copy); LOOKUP-free PUTs run on the cache's background worker

A staging buffer is lent to its step's saves until they are all done; the next step
takes an idle one (or allocates one), so staging memory follows the saves in flight,
which the save queue bounds. When the cache's save queue is full (``save_queue_bytes``)
the save is dropped and counted (``SaveQueueStatistics.saves_dropped``): a later
miss, never a stalled step. The queue drains when the connector shuts down. vLLM may
reuse its blocks as soon as ``wait_for_save`` returns: only the staging copy is kept.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, wait
from typing import Callable, Sequence

import torch

from kvtier.kernels.paged import PagedLayout, gather_blocks

logger = logging.getLogger(__name__)

STAGING_IDLE_MAX = 2  # idle staging buffers kept for later steps; more are freed


class WorkerSaves:
    """One step's saves at a time; see the module doc."""

    def __init__(self, views: Sequence[torch.Tensor], layout: PagedLayout) -> None:
        self._views = list(views)
        self._layout = layout
        self._staging: torch.Tensor | None = None  # this step's
        self._lent: list[tuple[torch.Tensor, list[Future]]] = []  # earlier steps', until their saves are done
        self._idle: list[torch.Tensor] = []
        self._gathered: set[int] = set()
        self._block_ids: list[int] = []
        self.counters = {"saved_blocks": 0, "failed_saves": 0, "skipped_saves": 0}

    def begin(self, block_ids: list[int]) -> None:
        """The step's save blocks, in op order (call once per step, before any gather)."""
        self._block_ids = list(block_ids)
        self._gathered = set()

    def gather_layer(self, layer: int) -> None:
        """Copy layer ``layer`` of the step's save blocks out of vLLM's cache."""
        if not self._block_ids or layer in self._gathered:
            return
        view = self._views[layer]
        out = self._buffer(len(self._block_ids), view)[layer].unsqueeze(1)  # [n, 1, 2, H, T, D]
        if view.device.type == "cpu":
            gather_blocks([view], self._block_ids, self._layout, out=out)
        else:
            out.copy_(gather_blocks([view], self._block_ids, self._layout))
        self._gathered.add(layer)

    def submit(self, ops, cache_for: Callable, rank: int) -> None:
        """Gather what is left, then enqueue each op's blocks on its tenant's cache."""
        if not self._block_ids:
            return
        for layer in range(len(self._views)):
            self.gather_layer(layer)
        staging = self._staging
        step_saves: list[Future] = []
        row = 0
        for op in ops:
            blocks = list(staging[:, row:row + op.num_blocks].transpose(0, 1).unbind(0))  # [L, 2, H, T, D] each
            row += op.num_blocks
            try:
                step_saves.append(cache_for(op).store_blocks_async(list(op.keys[rank]), blocks, copy=False))
                self.counters["saved_blocks"] += op.num_blocks
            except (RuntimeError, OSError) as exc:  # a closed queue
                self.counters["failed_saves"] += op.num_blocks
                logger.warning("kvtier save of %d blocks not queued (%s); they will be misses", op.num_blocks, exc)
        self._lent.append((staging, step_saves))  # the saves read it until they are done
        self._staging = None
        self._block_ids = []

    def skip(self, ops) -> None:
        """Save none of the step's blocks (what was gathered stays in this step's staging buffer,
        which the next step reuses)."""
        blocks = sum(op.num_blocks for op in ops)
        self.counters["skipped_saves"] += blocks
        logger.warning("kvtier did not save %d blocks of a step whose load failed; they will be misses", blocks)
        self._block_ids = []

    def wait_stored(self, timeout_s: float | None = None) -> bool:
        """Wait until every save queued so far has finished (stored, failed or dropped);
        False on timeout. Steps never call this: it is for shutdown paths and tests."""
        _, not_done = wait([f for _, saves in self._lent for f in saves], timeout=timeout_s)
        return not not_done

    def _buffer(self, n: int, like: torch.Tensor) -> torch.Tensor:
        """The staging buffer ``[L, n, 2, H, T, D]`` (host memory, pinned where a GPU is in use)."""
        layers = len(self._views)
        # like: a 5-axis paged view ([B, H, 2, T, D] or [B, H, T, 2, D]); one staged block is [2, H, T, D]
        axes = self._layout.axes
        block = (2, like.shape[axes.index("head")], like.shape[axes.index("token")], like.shape[axes.index("dim")])
        staging = self._staging
        if staging is None or staging.shape[1] < n or tuple(staging.shape[2:]) != block:
            staging = self._idle_staging(n, block)
            if staging is None:
                staging = torch.empty((layers, max(n, 1), *block), dtype=like.dtype, pin_memory=like.device.type == "cuda")
            self._staging = staging
        return staging[:, :n]

    def _idle_staging(self, n: int, block: tuple) -> torch.Tensor | None:
        """A staging buffer of at least ``n`` blocks whose saves are all done, if one is idle."""
        lent = []
        for staging, saves in self._lent:
            if all(f.done() for f in saves):
                self._idle.append(staging)
            else:
                lent.append((staging, saves))
        self._lent = lent
        fits = [s for s in self._idle if s.shape[1] >= n and tuple(s.shape[2:]) == block]
        if not fits:
            del self._idle[STAGING_IDLE_MAX:]
            return None
        self._idle.remove(fits[0])
        return fits[0]
