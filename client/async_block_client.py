"""AsyncBlockClient: BlockClient's methods as coroutines (asyncio).

Same ops (:mod:`kvtier.client.transport_ops`), same pool-and-retry behaviour
(a DELETE whose request went out is not repeated after a failure either),
same verification; the socket work uses asyncio streams. Payloads are copied
once out of the stream buffer (asyncio streams offer no ``recv_into``); use
the blocking client from a thread where every copy counts.
"""
from __future__ import annotations

import asyncio
import time

from kvtier.wire import connection as p
from kvtier.client import transport_ops as ops
from kvtier.client.block_client import (ClientBase, ClientStatistics, _lost, _not_repeated, geometry_from_info,
                                        pin_request)
from kvtier.wire.channel import AsyncChannel
from kvtier.common.stripe import StripeGeometry

class AsyncBlockClient(ClientBase):
    """The asyncio twin of :class:`kvtier.client.BlockClient`."""

    def __init__(self, address: str = "127.0.0.1:7410", token: str | None = None, pool_size: int = 4,
                 timeout_s: float = 30.0, client_name: str = "kvtier-async-client"):
        super().__init__(address, token, pool_size, timeout_s, client_name)
        self._pool: list[AsyncChannel] = []
        self._slots: asyncio.Semaphore | None = None
        self._pool_size = pool_size

    async def __aenter__(self) -> "AsyncBlockClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the idle connections now; one still serving a request is closed when it ends
        (never pooled again), and a request made after this raises ClientError."""
        self._closed = True
        pool, self._pool = self._pool, []
        for ch in pool:
            ch.close()
        for ch in pool:
            try:
                await ch.writer.wait_closed()
            except OSError:
                pass

    def statistics(self) -> ClientStatistics:
        return ClientStatistics(**self._counts)

    def _give_back(self, ch: AsyncChannel) -> None:
        """Pool a connection whose request ended with its replies read; close it if the client closed meanwhile."""
        if self._closed:
            ch.close()
        else:
            self._pool.append(ch)

    async def _connect(self) -> AsyncChannel:
        try:
            ch = await AsyncChannel.open(self._host, self._port, self._timeout_s, self._token, self._name)
        except (OSError, asyncio.TimeoutError) as exc:
            raise self._cannot_connect(exc) from exc
        self._hello_info(ch.info)
        return ch

    async def _run(self, make_op):
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._pool_size)
        async with self._slots:  # a request that waited for a slot while the client closed opens nothing
            if self._closed:
                raise p.ClientError("the client is closed")
            while self._pool and not self._pool[-1].idle_and_open():
                self._pool.pop().close()  # the daemon closed it while it idled
                self._counts["reconnects"] += 1
            fresh = not self._pool
            ch = await self._connect() if fresh else self._pool.pop()
            before_in, before_out = ch.conn.bytes_received, ch.conn.bytes_sent
            op = make_op()
            try:
                messages = next(op)
                while True:
                    replies = await ch.exchange(messages)
                    self._counts["frames"] += len(messages)
                    messages = op.send(replies)
            except StopIteration as stop:
                self._give_back(ch)
                return stop.value
            except (OSError, asyncio.TimeoutError, p.ConnectionLost, p.ProtocolError) as exc:
                ch.close()
                raise _AsyncRetry(exc, fresh, ch.conn.bytes_sent != before_out) from exc
            except p.RemoteError as exc:
                if exc.request_id == 0:
                    ch.close()
                else:
                    self._give_back(ch)
                raise
            except BaseException:
                ch.close()
                raise
            finally:
                self._counts["requests"] += 1
                self._counts["bytes_received"] += ch.conn.bytes_received - before_in
                self._counts["bytes_sent"] += ch.conn.bytes_sent - before_out

    async def _call(self, make_op, repeatable: bool = True):
        try:
            return await self._run(make_op)
        except _AsyncRetry as retry:
            if retry.fresh:
                raise _lost(retry.cause) from retry.cause
            if retry.sent and not repeatable:  # handed to the transport: the daemon may have applied it
                raise _not_repeated(retry.cause) from retry.cause
        self._counts["reconnects"] += 1
        try:
            return await self._run(make_op)
        except _AsyncRetry as retry:
            raise _lost(retry.cause) from retry.cause

    # -- the API ------------------------------------------------------------
    async def put(self, key, block, durable: bool = False) -> int:
        (seq,) = await self.put_many([(key, block)], durable)
        return seq

    async def put_many(self, items, durable: bool = False, ns_id: bytes | None = None) -> list[int]:
        items = list(items)
        return await self._call(lambda: ops.op_put_many(items, durable, ns_id, self.limits))

    async def get(self, key, ns_id: bytes | None = None, copy: bool = True) -> bytes | None:
        return (await self.get_many([key], ns_id, copy))[0]

    async def get_many(self, keys, ns_id: bytes | None = None, copy: bool = True) -> list[bytes | None]:
        """As BlockClient.get_many; ``copy`` is accepted for parity (asyncio
        streams copy once anyway, so the blocks are always bytes)."""
        keys = list(keys)
        results, corrupt = await self._call(lambda: ops.op_get_many(keys, ns_id, self.limits,
                                                                    reader_verifies=self._reader_verifies))
        self._counts["corrupt_blocks"] += corrupt
        return results

    async def get_into(self, key, buffer) -> int | None:
        target = memoryview(buffer).cast("B")
        if target.readonly:
            raise ValueError("get_into needs a writable buffer")
        block = await self.get(key)
        if block is None:
            return None
        if len(block) > target.nbytes:
            raise ValueError(f"block of {len(block)} bytes does not fit the {target.nbytes}-byte buffer")
        target[:len(block)] = block
        return len(block)

    async def lookup(self, keys, ns_id: bytes | None = None) -> int:
        keys = list(keys)
        leading, _ = await self._call(lambda: ops.op_lookup(keys, ns_id, False, self.limits))
        return leading

    async def lookup_locations(self, keys, ns_id: bytes | None = None):
        keys = list(keys)
        leading, locs = await self._call(lambda: ops.op_lookup(keys, ns_id, True, self.limits))
        return leading, list(locs)

    async def delete(self, key) -> bool:
        return (await self.delete_many([key]))[0]

    async def delete_many(self, keys) -> list[bool]:
        keys = list(keys)
        return await self._call(lambda: ops.op_bools(p.Delete, keys, None, self.limits), repeatable=False)

    async def pin(self, keys, ttl_s: float | None = None) -> list[bool]:
        """See :meth:`BlockClient.pin` (``ttl_s``: a soft pin that expires by itself)."""
        keys = list(keys)
        return await self._call(lambda: ops.op_bools(pin_request(ttl_s), keys, None, self.limits))

    async def unpin(self, keys) -> list[bool]:
        keys = list(keys)
        return await self._call(lambda: ops.op_bools(p.Unpin, keys, None, self.limits))

    async def flush(self) -> None:
        await self._call(lambda: ops.op_single(p.Flush(0)))

    async def stats(self) -> dict:
        return dict((await self._call(lambda: ops.op_single(p.Stats(0)))).stats)

    async def ping(self) -> float:
        started = time.perf_counter()
        await self._call(lambda: ops.op_single(p.Ping(0, b"ping")))
        return time.perf_counter() - started

    async def server_info(self) -> dict:
        if self._info is None:
            await self.ping()
        return self._info

    async def geometry(self) -> StripeGeometry:
        return geometry_from_info(await self.server_info())


class _AsyncRetry(Exception):
    def __init__(self, cause: BaseException, fresh: bool, sent: bool):
        super().__init__(str(cause))
        self.cause, self.fresh, self.sent = cause, fresh, sent
