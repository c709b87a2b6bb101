"""The asyncio twins of :class:`~.kvcache.KVCache`'s blocking calls: each runs the call on the
cache's worker threads (``self._executor``) and awaits it."""
from __future__ import annotations

import asyncio
import functools
from typing import Sequence


class AsyncTwins:
    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    async def alookup(self, tokens) -> int:
        return await self._run(self.lookup, tokens)

    async def alookup_keys(self, keys: Sequence[bytes]) -> int:
        return await self._run(self.lookup_keys, keys)

    async def aload(self, tokens, max_tokens: int | None = None, out=None):
        return await self._run(self.load, tokens, max_tokens, out)

    async def aload_blocks(self, keys: Sequence[bytes]) -> list:
        return await self._run(self.load_blocks, keys)

    async def astore(self, tokens, kv, durable: bool = False) -> int:
        return await self._run(self.store, tokens, kv, durable)

    async def astore_blocks(self, keys: Sequence[bytes], blocks: Sequence, durable: bool = False) -> int:
        return await self._run(self.store_blocks, keys, blocks, durable)
