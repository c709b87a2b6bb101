"""The loader's side of a :class:`~.prefix_load.PrefixLoad`: the warm blocks' layer groups
fetched in order, one at a time (each over all the streams), each decoded (or, raw, already
landed) into the output and handed over as soon as every block's group is verified::

    fetch g0 ─┐ fetch g1 ─┐ fetch g2 ...        (on the group-fetch workers)
              └ decode g0 -> ready(0)
                          └ decode g1 -> ready(1) ...

One group at a time, because two fetched together share the bandwidth and the first,
the one the model is waiting for, arrives as late as the second.

A block whose group is missing or fails verification ends the good prefix there, but the
tokens before it are good only once every group of theirs is in: the later groups are still
fetched, for those blocks alone, and only then is the prefix shortened (every wait raises
:class:`~.prefix_load.PrefixShortened`, naming tokens that hold their KV in every layer)::

    group      g0  g1  g2            block 2's g1 fails
    block 0    ok  ok  ok  <- fetched for blocks 0-1 only
    block 1    ok  ok  ok
    block 2    ok  ✘   -   -> the prefix is blocks 0-1, once g2 of both is in

An error fails the load (the consumer sees either at its next wait). Neither is told before
every fetch in flight has ended: a fetch lands raw blocks straight in the output, which is
the consumer's again once it hears.
"""
from __future__ import annotations

import logging
from concurrent.futures import Executor, Future, wait
from typing import Callable

from .prefix_load import PrefixLoad

log = logging.getLogger(__name__)

GROUPS_IN_FLIGHT = 1  # group fetches in flight (the next starts when one is in)


def stream_groups(load: PrefixLoad, out, first: int, keys: list[bytes], fetch: Callable, decoder,
                  executor: Executor, done: Callable[[], None]) -> None:
    """Fill blocks ``first ..`` of ``out`` (the blocks of ``keys``) group by group:
    ``fetch(keys, groups=[g], count_blocks=...)`` returns the objects of group g of those keys'
    blocks, None per miss; ``done()`` runs once all are in."""
    ahead: list[Future] = []
    good: int | None = None  # once a block failed: the leading blocks whose every group so far is in
    error: BaseException | None = None
    try:
        groups = load.layout.layer_groups
        ahead.extend(executor.submit(fetch, keys, groups=[g], count_blocks=(g == 0))
                     for g in range(min(GROUPS_IN_FLIGHT, groups)))
        for group in range(groups):
            objects = ahead[group].result()
            if group + GROUPS_IN_FLIGHT < groups:
                ahead.append(executor.submit(fetch, keys if good is None else keys[:good],
                                             groups=[group + GROUPS_IN_FLIGHT], count_blocks=False))
            wanted = len(objects) if good is None else min(good, len(objects))
            decoded = next((i for i in range(wanted) if objects[i] is None
                            or not decoder.decode_into_tokens(objects[i], out, first + i, [group])), wanted)
            if good is None and decoded == len(objects):
                load.group_done(group)
                continue
            good = decoded
            if good == 0:
                break
        if good is None:
            done()
    except Exception as exc:  # the consumer sees it at its next wait
        log.exception("event=streaming_load_failed tokens=%d", load.num_tokens)
        error = exc
    finally:
        wait(ahead)  # nothing may still land in the output once the consumer hears
    if error is not None:
        load.fail(error)
    elif good is not None:
        load.shorten((first + good) * load.layout.block_tokens)
