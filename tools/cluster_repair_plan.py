"""What a re-replication pass copies where: pure planning, no I/O.

Given each member's stored keys (from its ``GET /v1/keys``) and the members now, every key
should be on its first ``replicas`` rendezvous owners (the rule clients route by,
:mod:`kvtier.client.routing`). An owner that lacks a key gets it from a member that holds it::

    node ids      a      b      c      d (joined)         replicas = 2
    holds k       yes    yes    -      -
    owners of k   d, a                                     -> copy k: a -> d  (a: the first owner holding it)
    owners of k'  b, c   holds k' on b only                -> copy k': b -> c (a replica lost with a node)

Only owners that lack a key receive; nothing is copied off a node that is not the key's
owner unless no owner holds it (a node that leaves cleanly hands off nothing: its keys'
replicas are the sources). Copies that are no longer owned are left to eviction.
Transfers come out grouped by (source, target), keys in listing order, at most
``batch_keys`` per transfer.

A key one of its owners deleted lately (its ``GET /v1/keys/deleted``) and does not hold is
not copied: the members that still hold it missed the delete (they were away), or were
given it again while that owner was away, and the plan deletes it there. Either way the
cluster ends without it -- a miss, never a deleted block brought back::

    owners of k   a, b      a deleted k (b was down)   b holds k   -> delete k on b, copy nothing
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvtier.client.routing import Rendezvous
from kvtier.common.keys import KEY_SIZE_BYTES

BATCH_KEYS_DEFAULT = 256  # blocks one GET + PUT of a transfer moves


@dataclass(frozen=True)
class Transfer:
    source: int  # index into the plan's node ids
    target: int
    keys: tuple[bytes, ...]


@dataclass(frozen=True)
class Deletion:
    target: int  # index into the plan's node ids
    keys: tuple[bytes, ...]


@dataclass(frozen=True)
class RepairPlan:
    node_ids: tuple[str, ...]
    keys_listed: int  # distinct keys across the members
    copies_missing: int  # (key, owner) pairs where the owner lacks the key
    transfers: tuple[Transfer, ...]
    keys_deleted: int = 0  # distinct stored keys an owner deleted lately: deleted, not copied
    deletions: tuple[Deletion, ...] = ()

    def copies_to(self, target: int) -> int:
        return sum(len(t.keys) for t in self.transfers if t.target == target)


def holdings_matrix(listings: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """(distinct keys ``[U, 16]`` uint8 in first-seen order, ``holds[U, members]`` bool) from
    each member's listing (its keys joined, 16 bytes each)."""
    for n, raw in enumerate(listings):
        if len(raw) % KEY_SIZE_BYTES:
            raise ValueError(f"listing {n}: {len(raw)} bytes is not a whole number of {KEY_SIZE_BYTES}-byte keys")
    rows = [np.frombuffer(raw, dtype=np.uint8).reshape(-1, KEY_SIZE_BYTES) for raw in listings]
    if not rows or not sum(len(r) for r in rows):
        return np.empty((0, KEY_SIZE_BYTES), np.uint8), np.zeros((0, len(listings)), bool)
    every = np.concatenate(rows)
    owner = np.repeat(np.arange(len(rows)), [len(r) for r in rows])
    as_void = np.ascontiguousarray(every).view(np.dtype((np.void, KEY_SIZE_BYTES))).ravel()
    _, first, inverse = np.unique(as_void, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # unique ids in first-seen order
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    ids = rank[inverse.ravel()]
    holds = np.zeros((len(first), len(rows)), dtype=bool)
    holds[ids, owner] = True
    return every[first[order]], holds


def plan_repairs(node_ids: Sequence[str], listings: Sequence[bytes], replicas: int,
                 batch_keys: int = BATCH_KEYS_DEFAULT, deleted: Sequence[bytes] | None = None) -> RepairPlan:
    """The copies that put every listed key on its first ``replicas`` owners among ``node_ids``
    (``listings[j]``: member j's keys), and the deletes of the keys an owner deleted lately
    (``deleted[j]``: member j's, joined as the listings). See the module doc."""
    node_ids = tuple(node_ids)
    deleted = [b""] * len(node_ids) if deleted is None else list(deleted)
    if len(listings) != len(node_ids) or len(deleted) != len(node_ids):
        raise ValueError(f"{len(listings)} listings and {len(deleted)} deleted lists for {len(node_ids)} members")
    if replicas < 1 or batch_keys < 1:
        raise ValueError(f"replicas ({replicas}) and batch_keys ({batch_keys}) must be 1 or more")
    keys, both = holdings_matrix([*listings, *deleted])
    held = both[:, :len(node_ids)].any(axis=1)
    keys, holds, logged = keys[held], both[held, :len(node_ids)], both[held, len(node_ids):]
    if not len(keys):
        return RepairPlan(node_ids, 0, 0, ())
    key_list = [bytes(k) for k in keys]
    owners = Rendezvous(node_ids).ranked(key_list, min(replicas, len(node_ids)))
    rows = np.arange(len(keys))[:, None]
    doomed = (logged[rows, owners] & ~holds[rows, owners]).any(axis=1)  # an owner deleted it and lacks it
    lacking = ~holds[rows, owners] & ~doomed[:, None]  # [U, r]
    # source: the first owner that holds the key, else the lowest-index member that does
    owner_holds = ~lacking
    first_owner = owners[rows[:, 0], np.argmax(owner_holds, axis=1)]
    source = np.where(owner_holds.any(axis=1), first_owner, np.argmax(holds, axis=1))
    pairs: dict[tuple[int, int], list[int]] = {}
    for k, c in zip(*np.nonzero(lacking)):
        pairs.setdefault((int(source[k]), int(owners[k, c])), []).append(int(k))
    transfers = [Transfer(s, t, tuple(key_list[k] for k in idx[i:i + batch_keys]))
                 for (s, t), idx in sorted(pairs.items()) for i in range(0, len(idx), batch_keys)]
    deletions = []
    for target in range(len(node_ids)):
        idx = np.flatnonzero(doomed & holds[:, target]).tolist()
        deletions += [Deletion(target, tuple(key_list[k] for k in idx[i:i + batch_keys]))
                      for i in range(0, len(idx), batch_keys)]
    return RepairPlan(node_ids, len(keys), int(lacking.sum()), tuple(transfers), int(doomed.sum()),
                      tuple(deletions))


@dataclass(frozen=True)
class PlacementChange:
    """How a membership change moves ``keys``' owners (first ``replicas`` each)."""

    first_owner_changed: float  # fraction of keys whose first owner differs
    owner_set_changed: float  # fraction of keys whose owner set differs
    copies_moved: float  # fraction of (key, replica) places now on a node that was not an owner


def placement_change(keys: Sequence[bytes], before: Sequence[str], after: Sequence[str],
                     replicas: int) -> PlacementChange:
    if not keys:
        return PlacementChange(0.0, 0.0, 0.0)
    old = np.array(before)[Rendezvous(before).ranked(keys, min(replicas, len(before)))]
    new = np.array(after)[Rendezvous(after).ranked(keys, min(replicas, len(after)))]
    moved = np.array([[n not in o for n in row] for row, o in zip(new, (set(r) for r in old))])
    return PlacementChange(float((old[:, 0] != new[:, 0]).mean()), float(moved.any(axis=1).mean()),
                           float(moved.mean()))
