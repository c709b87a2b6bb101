"""The engine's block-event hook: whom the engine tells that blocks were stored, removed or
all cleared (``Engine.set_block_listener``).

The engine calls a listener under its lock, in the order the index changes, with the keys
as their little-endian uint64 halves (``k0``, ``k1``: arrays the listener may keep):

* ``blocks_stored``  -- blocks just indexed: a PUT;
* ``blocks_removed`` -- blocks dropped from the index: deletes, a namespace delete, the blocks
  a reclaim evicts, a PUT taken back (its durable commit failed);
* ``all_cleared``    -- ``delete_all``.

A block a reclaim moves (pinned, soft-pinned, or hot by the reinsertion policy) keeps its key
and stays served throughout: it is not reported (the key set the events describe is unchanged).

A listener must not block, raise or call back into the engine: it copies what it needs and
returns (the KV-events publisher, :mod:`kvtier.daemon.events`, queues it for its own thread).
Blocks recovered when the engine opens are not reported: a subscriber starts from a snapshot
(:meth:`Engine.stored_keys`).
"""
from __future__ import annotations

from typing import Protocol

import numpy as np


class BlockListener(Protocol):
    def blocks_stored(self, k0: np.ndarray, k1: np.ndarray) -> None: ...

    def blocks_removed(self, k0: np.ndarray, k1: np.ndarray) -> None: ...

    def all_cleared(self) -> None: ...


class NoListener:
    """The default: nobody listens."""

    def blocks_stored(self, k0: np.ndarray, k1: np.ndarray) -> None:
        pass

    def blocks_removed(self, k0: np.ndarray, k1: np.ndarray) -> None:
        pass

    def all_cleared(self) -> None:
        pass


NO_LISTENER = NoListener()
