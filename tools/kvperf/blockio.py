"""One request of a workload: read or write a batch of blocks on one daemon,
checking what comes back. Shared by the block and prefix workloads."""
from __future__ import annotations

import asyncio

from .connect import Connections
from .content import BlockMaker, check_block
from .result import CloneLog


async def write_blocks(client, keys: list[bytes], blocks: list[bytes], durable: bool) -> None:
    if len(keys) == 1:
        await client.put(keys[0], blocks[0], durable=durable)
    else:
        await client.put_many(list(zip(keys, blocks)), durable=durable)


async def _fetch(conns: Connections, client, keys: list[bytes], log: CloneLog) -> list:
    """The blocks for ``keys`` (None for a miss), by direct read where the
    target is ``direct:`` and the block's region is sealed, else over TCP."""
    if conns.direct is None:
        if len(keys) == 1:
            return [await client.get(keys[0])]
        return list(await client.get_many(keys))
    from kvtier.client.direct_reader import DirectLocation

    _, locations = await client.lookup_locations(keys)
    wanted = [i for i, loc in enumerate(locations) if loc is not None and loc.sealed]
    blocks: list = [None] * len(keys)
    if wanted:
        direct = await asyncio.get_running_loop().run_in_executor(
            None, conns.direct.read_many, [keys[i] for i in wanted],
            [DirectLocation(locations[i].logical_offset, locations[i].length, locations[i].seq) for i in wanted])
        for i, block in zip(wanted, direct):
            blocks[i] = block
    log.direct_blocks += sum(b is not None for b in blocks)
    rest = [i for i, b in enumerate(blocks) if b is None]
    if rest:
        log.direct_fallbacks += len(rest)
        fetched = await client.get_many([keys[i] for i in rest])
        for i, block in zip(rest, fetched):
            blocks[i] = block
    return blocks


async def read_blocks(conns: Connections, client, keys: list[bytes], size_bytes: int, verify: bool,
                      log: CloneLog) -> list[bool]:
    """Read ``keys``; per key, whether a good block came back. With ``verify``
    a miss or wrong content is a verify error; without, a miss is counted."""
    blocks = await _fetch(conns, client, keys, log)
    ok: list[bool] = []
    for key, block in zip(keys, blocks):
        if verify:
            problem = check_block(block, key, size_bytes)
            if problem is not None:
                log.verify_error(problem)
            ok.append(problem is None)
        else:
            if block is None:
                log.misses += 1
            ok.append(block is not None)
    return ok


async def put_blocks(client, maker: BlockMaker, keys: list[bytes], durable: bool) -> None:
    """Build the blocks for ``keys`` in the maker's reused buffers and PUT them."""
    blocks = maker.blocks(keys)
    try:
        await write_blocks(client, keys, blocks, durable)
    finally:
        maker.release(blocks)
