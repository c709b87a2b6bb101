"""The prefix workload: what a prefix cache saves on a chat/RAG trace.

For each prompt (synthetic or replayed, see :mod:`.trace`), as an engine
would::

    keys = chained block keys of the prompt        (kvtier.common.keys)
    n    = LOOKUP(keys)                            -> the lookup section
    GET keys[:n], verify                           -> the read section (hits)
    PUT keys[n:]                                   -> the write section (what was recomputed)

Each step is split per owner as :class:`~kvtier.client.kvcache.KVCache`
splits it (one request per daemon and batch, :mod:`kvtier.client.routing`):
the prefix ends at the first block missing or bad on any of them.

``iodepth`` prompts are in flight per clone. The report's ``prefix``
section gives the block hit ratio, the KV bytes and tokens that did not have
to be recomputed, and the per-prompt latency of that lookup/get/put cycle.
"""
from __future__ import annotations

import asyncio
import itertools
import time

import numpy as np

from kvtier.common.keys import chain_keys

from .blockio import read_blocks, write_blocks
from .blockjob import Clock, Progress
from .connect import Connections
from .content import BlockMaker, keyspace_ns_id
from .options import JobOptions
from .result import CloneLog, CloneResult
from .targets import Targets
from .trace import SyntheticTrace, replay

REQUEST_BYTES_MAX = 64 << 20  # one GET/PUT batch; a long prompt's blocks go in several


class PrefixClone:
    def __init__(self, job: JobOptions, clone: int, clones: int, conns: Connections, progress: Progress):
        self.job = job
        self.conns = conns
        self.progress = progress
        self.log = CloneLog()
        self.ns_id = keyspace_ns_id(job.keyspace)
        self.maker = BlockMaker(job.keyspace, job.codec, job.bs, True)  # content always follows the key
        prompts = replay(job.trace, clone, clones) if job.trace else SyntheticTrace(job, clone).prompts()
        limit = None if (job.time_based or job.trace) else job.prefix_requests
        self.prompts = itertools.islice(prompts, limit)
        self.step = max(1, REQUEST_BYTES_MAX // job.bs)

    def _record(self, direction: str, clock: Clock, t0: int, t1: int, nbytes: int) -> None:
        if t1 >= clock.ramp_end_ns:
            getattr(self.log, direction).add(t1 - clock.ramp_end_ns, t1 - t0, nbytes)

    async def _lookup(self, keys: list[bytes]) -> int:
        """Leading blocks present: one LOOKUP per owner, the prefix ends at the first miss of any."""
        present = len(keys)
        for client, idx in self.conns.by_owner(keys):
            found = await client.lookup([keys[i] for i in idx])
            if found < len(idx):
                present = min(present, idx[found])
        return present

    async def _read_prefix(self, keys: list[bytes], clock: Clock) -> int:
        """GET ``keys`` from their owners; the hits are the leading good blocks.
        A read request counts the bytes it delivered to that prefix."""
        ok = np.zeros(len(keys), dtype=bool)
        cut = len(keys)  # the first block known not to have come back good
        requests = []  # (t0, t1, positions) per GET
        for client, idx in self.conns.by_owner(keys):
            for s in range(0, len(idx), self.step):
                part = idx[s:s + self.step]
                if part[0] >= cut:
                    break  # past the end of the prefix
                t0 = time.perf_counter_ns()
                ok[part] = await read_blocks(self.conns, client, [keys[i] for i in part], self.job.bs,
                                             self.job.verify, self.log)
                requests.append((t0, time.perf_counter_ns(), part))
                bad = np.flatnonzero(~ok[part])
                if bad.size:
                    cut = min(cut, part[int(bad[0])])
        for t0, t1, part in requests:
            self._record("read", clock, t0, t1, int(ok[part][np.asarray(part) < cut].sum()) * self.job.bs)
        return cut

    async def _write(self, keys: list[bytes], clock: Clock) -> None:
        for client, idx in self.conns.by_owner(keys):
            for s in range(0, len(idx), self.step):
                chunk = [keys[i] for i in idx[s:s + self.step]]
                blocks = self.maker.blocks(chunk)  # built before the clock starts, in reused buffers
                t0 = time.perf_counter_ns()
                try:
                    await write_blocks(client, chunk, blocks, self.job.durable)
                finally:
                    self.maker.release(blocks)
                self._record("write", clock, t0, time.perf_counter_ns(), len(chunk) * self.job.bs)

    async def one(self, tokens, clock: Clock) -> None:
        keys = chain_keys(self.ns_id, tokens, self.job.block_tokens)
        if not keys:
            return
        start = t0 = time.perf_counter_ns()
        present = await self._lookup(keys)
        self._record("lookup", clock, t0, time.perf_counter_ns(), len(keys) * 16)
        hits = await self._read_prefix(keys[:present], clock) if present else 0
        await self._write(keys[hits:], clock)
        end = time.perf_counter_ns()
        if end >= clock.ramp_end_ns:
            self.log.requests += 1
            self.log.blocks += len(keys)
            self.log.hit_blocks += hits
            self.log.request_lat_ns.append(end - start)
        self.progress.add(1)

    async def run(self, clock: Clock) -> None:
        async def worker() -> None:
            for tokens in self.prompts:  # shared iterator: each prompt is sent once
                await self.one(tokens, clock)
                if clock.expired():
                    return

        await asyncio.gather(*(worker() for _ in range(self.job.iodepth)))


async def run_prefix_clone(job: JobOptions, clone: int, clones: int, targets: Targets, token: str | None,
                           progress: Progress, start_together=None) -> CloneResult:
    async with Connections(targets, token, job.iodepth, job.ioengine) as conns:
        pc = PrefixClone(job, clone, clones, conns, progress)
        if start_together is not None:
            start_together()  # every clone connected: start the clocks together
        clock = Clock(job)
        await pc.run(clock)
        end_ns = time.perf_counter_ns()
    return pc.log.finish(max(0, end_ns - clock.ramp_end_ns))
