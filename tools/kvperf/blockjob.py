"""The block workloads: read, write, randread, randwrite, rw/randrw, lookup.

One clone runs ``iodepth`` requests at once on one event loop::

    connect + PING  ->  layout (untimed)  ->  ramp  ->  measured  ->  verify (untimed)

- layout: reads need blocks to read. As fio lays out a file before reading
  it, kvperf puts the clone's blocks that a LOOKUP says are missing. Skipped
  with ``verify_only`` -- then a missing block is a verify error.
- measured: sequential or random (each block once per pass, like fio's
  random map) over the clone's ``size // bs`` blocks, ``batch`` blocks per
  request (the last request of a pass takes the blocks left over, so a pass
  covers every block); ``time_based`` repeats passes until ``runtime``.
- verify: after a write job with ``verify``, every block written is read back
  and checked against its key.
"""
from __future__ import annotations

import asyncio
import time
from typing import Iterator

import numpy as np

from kvtier.client.routing import positions_by_owner

from .blockio import put_blocks, read_blocks
from .connect import Connections
from .content import BlockMaker, block_key
from .options import JobOptions
from .result import CloneLog, CloneResult
from .targets import Targets

LAYOUT_BATCH_BLOCKS = 32  # blocks per LOOKUP/PUT while laying out (bounds one request's bytes)
LAYOUT_BATCH_BYTES_MAX = 64 << 20  # ... and its size, so large blocks go fewer at a time
VERIFY_BATCH_BLOCKS = 32  # blocks per GET while verifying after a write job


class Progress:
    """Shared counter of bytes (or keys) done; a multiprocessing RawValue or a stand-in."""

    def __init__(self, value=None):
        self._value = value

    def add(self, n: int) -> None:
        if self._value is not None:
            self._value.value += n


class Clock:
    """When the ramp ends and when the run must stop, in perf_counter_ns."""

    def __init__(self, job: JobOptions):
        self.start_ns = time.perf_counter_ns()
        self.ramp_end_ns = self.start_ns + int(job.ramp_time * 1e9)
        self.deadline_ns = self.ramp_end_ns + int(job.runtime * 1e9) if job.runtime > 0 else None

    def expired(self) -> bool:
        return self.deadline_ns is not None and time.perf_counter_ns() >= self.deadline_ns


def _batch_blocks(job: JobOptions, batch: int) -> int:
    return max(1, min(batch, LAYOUT_BATCH_BYTES_MAX // job.bs))


def _index_order(job: JobOptions, rng: np.random.Generator) -> np.ndarray:
    return rng.permutation(job.blocks) if job.random else np.arange(job.blocks)


def _ops(job: JobOptions, rng: np.random.Generator) -> Iterator[tuple[str, list[int]]]:
    """(direction, block indexes) for each request, in issue order."""
    while True:
        order = _index_order(job, rng)
        for start in range(0, len(order), job.batch):  # the last request of a pass may be short
            chunk = [int(i) for i in order[start:start + job.batch]]
            if job.rw in ("rw", "randrw"):
                yield ("read" if rng.random() * 100 < job.rwmixread else "write"), chunk
            else:
                yield ("write" if job.writes else "read"), chunk
        if not job.time_based:
            return


def _lookup_ops(job: JobOptions, rng: np.random.Generator, target_blocks: list[int]) -> Iterator[tuple[int, int, int]]:
    """Chains of keys that live on one target, ``lookup_keys`` long at most, as
    (target, first, end): positions ``first <= j < end`` in the list of the
    keys that target owns (``target_blocks[t]`` long). A chain's target is
    drawn in proportion to the keys it owns."""
    counts = np.asarray(target_blocks)
    ntargets = len(counts)
    per_target = -(-job.blocks // ntargets)
    length = min(job.lookup_keys, job.blocks // ntargets or 1)
    weights = counts / counts.sum()
    highs = np.maximum(1, counts - length + 1)
    while True:
        n = max(1, per_target // length)  # drawn a pass at a time: one numpy call, not two per chain
        targets = rng.choice(ntargets, size=n, p=weights) if ntargets > 1 else np.zeros(n, dtype=np.intp)
        firsts = rng.integers(0, highs[targets])
        for t, first in zip(targets.tolist(), firsts.tolist()):
            yield t, first, min(first + length, int(counts[t]))
        if not job.time_based:
            return


class BlockClone:
    def __init__(self, job: JobOptions, clone: int, conns: Connections, progress: Progress):
        self.job = job
        self.conns = conns
        self.progress = progress
        self.log = CloneLog()
        self.keys = [block_key(job.seed, job.keyspace, clone, i) for i in range(job.blocks)]
        self.maker = BlockMaker(job.keyspace, job.codec, job.bs, job.verify)
        self.rng = np.random.default_rng([job.seed, clone])
        self.written = np.zeros(job.blocks, dtype=bool)
        self.owner = conns.owners(self.keys)  # target index per block
        self.keys_by_target = [[self.keys[i] for i in np.flatnonzero(self.owner == t)]
                               for t in range(len(conns.clients))]  # a LOOKUP chain is a slice of one

    def _by_target(self, indexes: list[int]) -> dict[int, list[int]]:
        """``{target: the blocks of indexes it owns}``, in the order given."""
        idx = np.asarray(indexes, dtype=np.intp)
        return {t: idx[pos].tolist() for t, pos in positions_by_owner(self.owner[idx]).items()}

    async def layout(self) -> None:
        step = _batch_blocks(self.job, LAYOUT_BATCH_BLOCKS)
        for t, indexes in self._by_target(list(range(self.job.blocks))).items():
            client = self.conns.clients[t]
            for s in range(0, len(indexes), step):
                chunk = indexes[s:s + step]
                keys = [self.keys[i] for i in chunk]
                present = await client.lookup(keys)
                missing = keys[present:]
                if missing:
                    await put_blocks(client, self.maker, missing, self.job.durable)
                    self.log.laid_out_blocks += len(missing)

    async def verify_written(self) -> None:
        step = _batch_blocks(self.job, VERIFY_BATCH_BLOCKS)
        for t, indexes in self._by_target([int(i) for i in np.flatnonzero(self.written)]).items():
            for s in range(0, len(indexes), step):
                keys = [self.keys[i] for i in indexes[s:s + step]]
                ok = await read_blocks(self.conns, self.conns.clients[t], keys, self.job.bs, True, self.log)
                self.log.verified_blocks += sum(ok)

    async def _request(self, direction: str, indexes: list[int]) -> int:
        """One batch per target it touches; returns bytes moved."""
        moved = 0
        groups = {0: indexes} if len(self.conns.clients) == 1 else self._by_target(indexes)
        for t, idx in groups.items():
            client = self.conns.clients[t]
            keys = [self.keys[i] for i in idx]
            if direction == "write":
                await put_blocks(client, self.maker, keys, self.job.durable)
                self.written[idx] = True
                moved += len(keys) * self.job.bs
            else:
                ok = await read_blocks(self.conns, client, keys, self.job.bs, self.job.verify, self.log)
                moved += sum(ok) * self.job.bs
        return moved

    async def _lookup(self, chain: tuple[int, int, int]) -> int:
        t, first, end = chain
        found = await self.conns.clients[t].lookup(self.keys_by_target[t][first:end])
        n = end - first
        log = self.log
        log.lookup_keys += n
        log.lookup_found += found
        log.misses += n - found
        return n

    async def measured(self, clock: Clock) -> None:
        if self.job.rw == "lookup":
            target_blocks = [len(keys) for keys in self.keys_by_target]
            ops = (("lookup", chain) for chain in _lookup_ops(self.job, self.rng, target_blocks))
        else:
            ops = _ops(self.job, self.rng)
        now = time.perf_counter_ns
        ramp_end = clock.ramp_end_ns
        deadline = clock.deadline_ns
        progress = self.progress.add
        oplogs = {d: getattr(self.log, d).add for d in ("read", "write", "lookup")}

        async def worker() -> None:
            for direction, what in ops:  # one shared iterator: each request is issued once
                t0 = now()
                if direction == "lookup":
                    done = await self._lookup(what)
                    nbytes = done * 16
                else:
                    nbytes = done = await self._request(direction, what)
                t1 = now()
                if t1 >= ramp_end:
                    oplogs[direction](t1 - ramp_end, t1 - t0, nbytes)
                progress(done)
                if deadline is not None and t1 >= deadline:
                    return

        await asyncio.gather(*(worker() for _ in range(self.job.iodepth)))


async def run_block_clone(job: JobOptions, clone: int, targets: Targets, token: str | None,
                          progress: Progress, start_together=None) -> CloneResult:
    """``start_together``: called after layout; returns when every clone is
    ready, so that clones measure the same interval (a multiprocessing Barrier's wait)."""
    async with Connections(targets, token, job.iodepth, job.ioengine) as conns:
        bc = BlockClone(job, clone, conns, progress)
        if (job.reads or job.rw == "lookup") and not job.verify_only:
            await bc.layout()
        if start_together is not None:
            start_together()  # blocks this clone's loop on purpose: nothing else runs in it yet
        clock = Clock(job)
        await bc.measured(clock)
        end_ns = time.perf_counter_ns()
        if job.writes and job.verify:
            await bc.verify_written()
    return bc.log.finish(max(0, end_ns - clock.ramp_end_ns))
