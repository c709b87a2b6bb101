"""The loader's side of a :class:`~.prefix_load.PrefixLoad`: the warm blocks' layer groups
fetched in order, one at a time (each over all the streams), each decoded (or, raw, already
landed) into the output and handed over as soon as every block's group is verified::

    fetch g0 ─┐ fetch g1 ─┐ fetch g2 ...        (on the group-fetch workers)
              └ decode g0 -> ready(0)
                          └ decode g1 -> ready(1) ...

One group at a time, because two fetched together share the bandwidth and the first,
the one the model is waiting for, arrives as late as the second.

A block whose group is missing or fails verification shortens the prefix there; an
error fails the load (the consumer sees either at its next wait).
"""
from __future__ import annotations

import logging
from concurrent.futures import Executor
from typing import Callable

from .prefix_load import PrefixLoad

log = logging.getLogger(__name__)

GROUPS_IN_FLIGHT = 1  # group fetches in flight (the next starts when one is in)


def stream_groups(load: PrefixLoad, out, first: int, fetch: Callable, decoder, executor: Executor,
                  done: Callable[[], None]) -> None:
    """Fill blocks ``first ..`` of ``out`` group by group: ``fetch([g], count_blocks=...)``
    returns each block's objects of group g (None per miss); ``done()`` runs once all are in."""
    try:
        groups = load.layout.layer_groups
        ahead = [executor.submit(fetch, [g], count_blocks=(g == 0)) for g in range(min(GROUPS_IN_FLIGHT, groups))]
        for group in range(groups):
            objects = ahead[group].result()
            if group + GROUPS_IN_FLIGHT < groups:
                ahead.append(executor.submit(fetch, [group + GROUPS_IN_FLIGHT], count_blocks=False))
            for i, parts in enumerate(objects):
                if parts is None or not decoder.decode_into_tokens(parts, out, first + i, [group]):
                    load.shorten((first + i) * load.layout.block_tokens)
                    return
            load.group_done(group)
        done()
    except Exception as exc:  # the consumer sees it at its next wait
        log.exception("event=streaming_load_failed tokens=%d", load.num_tokens)
        load.fail(exc)
