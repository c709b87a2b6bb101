"""The owners of keys among a cluster's members: rendezvous (highest random weight) hashing.

Every client routes with this one rule - engines through :class:`~kvtier.client.kvcache.KVCache`,
kvperf through its connections, an edge daemon asking its region (``kvtierd --upstream
etcd://...``) - so all of them agree where a block lives. Pure: numpy only, no I/O;
``kvtier.client.routing`` re-exports it::

    member seed  s[m]    = BLAKE2b-64(member name)                once per member
    key hash     h[k]    = mix(lo(k) ^ mix(hi(k)))                the key's two 64-bit halves
    score        w[k, m] = mix(h[k] ^ s[m])
    owner(k)             = argmax over m of w[k, m]               a tie (1 in 2^64) goes to the lower index

``mix`` is the splitmix64 finalizer. A batch of keys is scored with uint64
numpy arithmetic (no Python loop over keys), and nothing depends on the
process (no seed, no ``hash()``), so every client computes the same owners. A key's score at a
member depends only on the two, so removing a member moves only the keys it
owned, and each of N members owns about 1/N of the keys. Members sorted by
score are a key's ordered candidates (:meth:`Rendezvous.ranked`): the first
``r`` of them are where ``r`` replicas go.

Members are names (daemon addresses as ``HOST:PORT``), compared as text: the
clients of one cluster must spell them alike. Their order does not matter:
indexes returned refer to the order given, owners are the same in any order.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

from kvtier.common.keys import KEY_SIZE_BYTES

MEMBERS_MAX = 1024  # scoring costs O(members) per key; larger clusters want another scheme
SCORE_CELLS_MAX = 1 << 22  # keys x members scored in one pass: 32 MiB of uint64 at most
_SEED_PERSON = b"kvtier-owner-v2"
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)
_SHIFT_1, _SHIFT_2, _SHIFT_3 = np.uint64(30), np.uint64(27), np.uint64(31)
RANK_BY_ARGMAX_MAX = 4  # up to this many owners a key, repeated argmax beats a full sort of each row


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise over uint64 (wrapping multiplies)."""
    return _mix_inplace(x.copy())


def _mix_inplace(x: np.ndarray) -> np.ndarray:
    """:func:`_mix` written over ``x`` (a fresh array the caller owns): no temporaries
    beyond one shifted copy per step."""
    with np.errstate(over="ignore"):
        for shift, mult in ((_SHIFT_1, _MIX_1), (_SHIFT_2, _MIX_2)):
            x ^= x >> shift
            x *= mult
    x ^= x >> _SHIFT_3
    return x


def _check_key_sizes(keys: Sequence[bytes]) -> None:
    if any(len(k) != KEY_SIZE_BYTES for k in keys):
        bad = next(k for k in keys if len(k) != KEY_SIZE_BYTES)
        raise ValueError(f"keys must be {KEY_SIZE_BYTES} bytes, got one of {len(bad)}")


def _key_hashes(keys: Sequence[bytes]) -> np.ndarray:
    """One uint64 per key, from both halves of its 16 bytes."""
    _check_key_sizes(keys)
    halves = np.frombuffer(b"".join(keys), dtype="<u8").reshape(len(keys), 2)
    mixed = _mix_inplace(halves[:, 1].copy())
    mixed ^= halves[:, 0]
    return _mix_inplace(mixed)


class Rendezvous:
    """Owners of keys among ``members`` (see the module doc). Immutable; a new
    membership is a new instance."""

    def __init__(self, members: Sequence[str]) -> None:
        members = tuple(members)
        if not members or len(set(members)) != len(members):
            raise ValueError(f"need one or more distinct members, got {members!r}")
        if len(members) > MEMBERS_MAX:
            raise ValueError(f"{len(members)} members is over the limit {MEMBERS_MAX}")
        if not all(isinstance(m, str) and m for m in members):
            raise ValueError(f"members are non-empty names, got {members!r}")
        self.members = members
        self._seeds = np.array([int.from_bytes(hashlib.blake2b(m.encode(), digest_size=8, person=_SEED_PERSON)
                                               .digest(), "little") for m in members], dtype=np.uint64)

    def owners(self, keys: Sequence[bytes]) -> np.ndarray:
        """The index (into ``members``) of each key's owner."""
        hashes = _key_hashes(keys)
        if len(self.members) == 1:
            return np.zeros(len(hashes), dtype=np.intp)
        out = np.empty(len(hashes), dtype=np.intp)
        for s, part in self._passes(hashes):
            out[s:s + len(part)] = np.argmax(self._scores(part), axis=1)
        return out

    def ranked(self, keys: Sequence[bytes], count: int) -> np.ndarray:
        """``[len(keys), count]``: each key's first ``count`` members by score,
        the owner first (column 0 is :meth:`owners`)."""
        if not 1 <= count <= len(self.members):
            raise ValueError(f"count must be 1..{len(self.members)}, got {count}")
        if len(self.members) == 1:
            _check_key_sizes(keys)
            return np.zeros((len(keys), 1), dtype=np.intp)
        hashes = _key_hashes(keys)
        out = np.empty((len(hashes), count), dtype=np.intp)
        for s, part in self._passes(hashes):
            out[s:s + len(part)] = _top(self._scores(part), count)
        return out

    def _scores(self, hashes: np.ndarray) -> np.ndarray:
        """``[len(hashes), len(members)]`` uint64: each member's weight for each key."""
        return _mix_inplace(hashes[:, None] ^ self._seeds[None, :])

    def _passes(self, hashes: np.ndarray):
        step = max(1, SCORE_CELLS_MAX // len(self.members))
        for s in range(0, len(hashes), step):
            yield s, hashes[s:s + step]

    def groups(self, keys: Sequence[bytes]) -> dict[int, list[int]]:
        """``{member index: positions in keys of the keys it owns}``, positions
        ascending, members in index order; members that own none are absent."""
        return positions_by_owner(self.owners(keys))


def _top(scores: np.ndarray, count: int) -> np.ndarray:
    """``[rows, count]``: each row's columns by descending score, a tie to the lower column
    (a stable sort's order). Reorders nothing, but overwrites ``scores``."""
    if count > RANK_BY_ARGMAX_MAX:
        # ~score puts high scores first; stable, so ties keep the lower index first, as argmax does
        return np.argsort(~scores, axis=1, kind="stable")[:, :count]
    rows = np.arange(len(scores))
    out = np.empty((len(scores), count), dtype=np.intp)
    kept = np.empty((len(scores), count), dtype=np.uint64)  # the scores overwritten, to put back
    for c in range(count):
        out[:, c] = np.argmax(scores, axis=1)
        kept[:, c] = scores[rows, out[:, c]]
        scores[rows, out[:, c]] = 0  # taken: it loses to every column left, but one that scores 0 too
    # a row whose pick scored 0 may pick a taken column again (about 2^-64 a cell): sort it
    tied = (kept[:, :-1] == 0).any(axis=1) if count > 1 else np.zeros(len(scores), dtype=bool)
    if tied.any():
        for c in range(count):
            scores[rows[tied], out[tied, c]] = kept[tied, c]
        out[tied] = np.argsort(~scores[tied], axis=1, kind="stable")[:, :count]
    return out


def positions_by_owner(owners: np.ndarray) -> dict[int, list[int]]:
    """``{owner: ascending positions where owners == owner}`` for an owner array."""
    owners = np.asarray(owners)
    if owners.size == 0:
        return {}
    if owners.min() == owners.max():  # one owner (always, with one member)
        return {int(owners[0]): list(range(owners.size))}
    order = np.argsort(owners, kind="stable")
    sorted_owners = owners[order]
    cuts = np.flatnonzero(np.diff(sorted_owners)) + 1
    return {int(part_owners[0]): part.tolist()
            for part, part_owners in zip(np.split(order, cuts), np.split(sorted_owners, cuts))}
