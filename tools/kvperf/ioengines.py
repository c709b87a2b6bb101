"""How a clone issues requests (``ioengine=``, as in fio).

- ``sync`` (default): the blocking :class:`kvtier.client.BlockClient` -- zero
  copy (``sendmsg`` of header + payload, replies received into buffers) --
  driven from the clone's event loop through ``iodepth`` threads. With
  ``iodepth=1`` only one request is ever in flight, so requests are made on
  the loop's own thread: no hand-off to a thread and back per request.
- ``asyncio``: :class:`kvtier.client.AsyncBlockClient` on the event loop
  itself (asyncio streams copy each payload once more).

Both expose the same coroutines, so the workloads do not care which runs.
"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

IOENGINES = ("sync", "asyncio")
THREADS_MAX = 64  # threads per clone for ioengine=sync; deeper queues wait for a thread


class ThreadedClient:
    """The blocking client, its calls run on a thread pool, awaited from the loop."""

    def __init__(self, address: str, token: str | None, pool_size: int, timeout_s: float, threads: int):
        from kvtier.client import BlockClient

        self._client = BlockClient(address, token=token, pool_size=pool_size, timeout_s=timeout_s,
                                   client_name="kvperf")
        self._threads = ThreadPoolExecutor(max_workers=max(1, min(threads, THREADS_MAX)),
                                           thread_name_prefix="kvperf-io")
        if threads <= 1:  # one request at a time: block the loop's thread, nothing else waits on it
            self._call = self._call_inline

    async def _call_threaded(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._threads,
                                                                functools.partial(fn, *args, **kwargs))

    _call = _call_threaded

    async def _call_inline(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)

    async def ping(self):  # on a thread, so that the caller's wait_for can time it out
        return await self._call_threaded(self._client.ping)

    async def geometry(self):
        return await self._call_threaded(self._client.geometry)

    async def put(self, key, block, durable: bool = False):
        return await self._call(self._client.put, key, block, durable=durable)

    async def put_many(self, items, durable: bool = False):
        return await self._call(self._client.put_many, items, durable=durable)

    async def get(self, key):
        return await self._call(self._client.get, key, copy=False)

    async def get_many(self, keys):
        return await self._call(self._client.get_many, keys, copy=False)

    async def lookup(self, keys):
        return await self._call(self._client.lookup, keys)

    async def lookup_locations(self, keys):
        return await self._call(self._client.lookup_locations, keys)

    async def close(self) -> None:
        self._threads.shutdown(wait=True)
        self._client.close()


class AsyncClient:
    """AsyncBlockClient, with the client_name set."""

    def __new__(cls, address: str, token: str | None, pool_size: int, timeout_s: float, threads: int):
        from kvtier.client import AsyncBlockClient

        return AsyncBlockClient(address, token=token, pool_size=pool_size, timeout_s=timeout_s,
                                client_name="kvperf")


def make_client(ioengine: str, address: str, token: str | None, pool_size: int, timeout_s: float, iodepth: int):
    cls = {"sync": ThreadedClient, "asyncio": AsyncClient}[ioengine]
    return cls(address, token, pool_size, timeout_s, iodepth)
