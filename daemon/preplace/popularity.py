"""Prefix popularity: decayed request counts per chain head, and the prefix each head is asked for.

Pure bookkeeping, no I/O, no clock of its own (every call takes ``now_s``).

A chain's *head* is its first key within a namespace; ``(ns_id, head key)`` names a
tracked entry. Each entry keeps the chain keys seen under that head and, per depth
``d``, ``reach[d]``: the decayed count of requests whose chain agreed with the kept
keys through key ``d``. ``reach`` never grows with depth, so the entry's *prefix* is
the longest run of kept keys that at least COMMON_FRACTION of its head's requests
reached -- the part of a shared system prompt every request asks for, without one
request's own tail::

    kept keys   k0    k1    k2    k3    k4    k5
    reach       9.0   9.0   8.5   6.0   1.0   1.0     reach[0] = the head's count
    prefix      [k0 .. k3]   (6.0 >= 0.5 x 9.0; 1.0 is not)

A request that runs past the kept keys (and agrees with all of them) extends them. A
request that leaves them at depth ``d`` counts through ``d``; when the kept branch past
``d`` is not common either, the request's own branch replaces it.

Keys are chained (each names every block before it), so a chain whose first key is a kept
key at depth ``d > 0`` of another entry in its namespace is a *remainder* of that entry:
the tail a client GETs after its leading blocks, an edge's pull-through of what it lacks,
one frame of a split GET. Its blocks are worth something only behind the entry's first
``d`` keys, so it is never a prefix of its own: once per batch each such entry is folded
into the entry it continues, its requests counted as requests of that entry's first ``d``
keys followed by its own::

    kept      k0    k1    k2    k3          remainder  k2    k3    k4
    reach     4.0   4.0   3.0   3.0         reach      2.0   2.0   1.0
    folded    6.0   6.0   5.0   5.0   1.0   (k4 extends the kept keys)

Decay is exponential with half-life ``half_life_s``, done lazily: a request observed at
``t`` adds ``2 ** ((t - t_ref) / half_life_s)`` and a count is read back multiplied by
``2 ** (-(now - t_ref) / half_life_s)``, so nothing is rescaled per request; the base
``t_ref`` moves forward (rescaling every entry once) before the weights lose precision.

Memory is bounded by HEADS_TRACKED_MAX entries and KEYS_TRACKED_MAX kept keys in all;
past either, the least popular entries are dropped (ties: the smaller ``(ns_id, head)``
first), so a flood of one-off chains cannot push out the prefixes that matter for long.
:meth:`PrefixPopularity.observe_many` folds remainders and checks the bounds once, after
its batch (one queue of :mod:`.observations` at most).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KEY_BYTES = 16  # kvtier.common.keys.KEY_SIZE_BYTES
KEY_DTYPE = np.dtype(f"S{KEY_BYTES}")  # one key as a numpy scalar: sorted and compared as its bytes
HALF_LIFE_S_DEFAULT = 300.0  # a prefix nobody asked for in 5 minutes counts half as much
HEADS_TRACKED_MAX = 4096  # chain heads counted at once: far more hot prefixes than an edge holds
KEYS_TRACKED_MAX = 1 << 20  # kept chain keys over all heads (16 MiB of keys, 8 MiB of counts)
PREFIX_KEYS_MAX = 16384  # keys kept per head: a 256k-token prefix at 16 tokens per block (one frame's batch)
COMMON_FRACTION = 0.5  # a head's prefix runs as deep as at least this share of its requests reached
REBASE_EXPONENT_MAX = 64.0  # weights are 2**exponent: rebase before float64 counts lose their small parts


@dataclass(frozen=True)
class HotPrefix:
    """One ranked prefix: its namespace, its keys (packed, count x 16 bytes) and its count now."""

    ns_id: bytes  # b"" for chains sent without a namespace
    keys: bytes
    count: float  # decayed requests for its head, as of the ``now_s`` it was ranked at

    @property
    def length(self) -> int:
        return len(self.keys) // KEY_BYTES

    def key_list(self) -> list[bytes]:
        return [self.keys[i:i + KEY_BYTES] for i in range(0, len(self.keys), KEY_BYTES)]


@dataclass(frozen=True)
class PopularityStatistics:
    heads_tracked: int
    keys_tracked: int
    observations: int
    heads_evicted: int


Ident = tuple[bytes, bytes]  # (ns_id, head key)


class _Entry:
    __slots__ = ("keys", "reach")

    def __init__(self, keys: bytes, weight: float):
        self.keys = keys
        self.reach = np.full(len(keys) // KEY_BYTES, weight)

    def __len__(self) -> int:
        return len(self.reach)

    def prefix_length(self) -> int:
        return int(np.count_nonzero(self.reach >= COMMON_FRACTION * self.reach[0]))


def agreeing_keys(a: bytes, b: bytes) -> int:
    """How many leading 16-byte keys ``a`` and ``b`` share (one memcmp, else one vector pass)."""
    n = min(len(a), len(b)) // KEY_BYTES
    if a[:n * KEY_BYTES] == b[:n * KEY_BYTES]:
        return n
    x = np.frombuffer(a, "<u8", 2 * n).reshape(n, 2)
    y = np.frombuffer(b, "<u8", 2 * n).reshape(n, 2)
    same = (x == y).all(axis=1)
    return int(np.argmin(same))


class PrefixPopularity:
    """Decayed counts per (namespace, chain head); :meth:`top` ranks their prefixes."""

    def __init__(self, half_life_s: float = HALF_LIFE_S_DEFAULT, heads_max: int = HEADS_TRACKED_MAX,
                 keys_max: int = KEYS_TRACKED_MAX, prefix_keys_max: int = PREFIX_KEYS_MAX):
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be positive, got {half_life_s}")
        if heads_max < 1 or keys_max < 1 or prefix_keys_max < 1:
            raise ValueError(f"heads_max, keys_max and prefix_keys_max must be at least 1, got "
                             f"{heads_max}, {keys_max}, {prefix_keys_max}")
        self._half_life_s = half_life_s
        self._heads_max, self._keys_max, self._prefix_keys_max = heads_max, keys_max, prefix_keys_max
        self._entries: dict[Ident, _Entry] = {}
        self._t_ref: float | None = None
        self._keys_held = 0
        self._observations = 0
        self._evicted = 0
        self._unfolded = False  # heads or kept keys changed since remainders were last folded

    # -- counting ---------------------------------------------------------------------
    def observe(self, ns_id: bytes | None, keys: bytes, now_s: float) -> None:
        """Count one request for the chain ``keys`` (packed, count x 16 bytes) in ``ns_id``."""
        self._observe(ns_id, keys, now_s)
        self._fold_remainders()
        self._enforce_bounds(now_s)

    def observe_many(self, observations) -> None:
        """Count ``(ns_id, keys, now_s)`` requests in order; the bounds are enforced once, after all."""
        last = None
        for ns_id, keys, now_s in observations:
            self._observe(ns_id, keys, now_s)
            last = now_s
        if last is not None:
            self._fold_remainders()
            self._enforce_bounds(last)

    def _observe(self, ns_id: bytes | None, keys: bytes, now_s: float) -> None:
        if len(keys) % KEY_BYTES:
            raise ValueError(f"{len(keys)} bytes of keys is not a whole number of {KEY_BYTES}-byte keys")
        if not keys:
            return
        keys = bytes(keys[:self._prefix_keys_max * KEY_BYTES])
        weight = self._weight(now_s)
        self._observations += 1
        ident = (bytes(ns_id or b""), keys[:KEY_BYTES])
        entry = self._entries.get(ident)
        if entry is None:
            self._entries[ident] = _Entry(keys, weight)
            self._keys_held += len(keys) // KEY_BYTES
            self._unfolded = True
            return
        agree = agreeing_keys(entry.keys, keys)
        entry.reach[:agree] += weight
        asked = len(keys) // KEY_BYTES
        if agree == len(entry) and asked > agree:  # runs past the kept keys: they grow
            self._replace_tail(entry, agree, keys, weight)
        elif agree < asked and agree < len(entry) and entry.reach[agree] < COMMON_FRACTION * entry.reach[0]:
            self._replace_tail(entry, agree, keys, weight)  # the kept branch is no more common than this one

    def _replace_tail(self, entry: _Entry, depth: int, keys: bytes, weight: float) -> None:
        before = len(entry)
        entry.keys = entry.keys[:depth * KEY_BYTES] + keys[depth * KEY_BYTES:]
        entry.reach = np.concatenate([entry.reach[:depth], np.full(len(keys) // KEY_BYTES - depth, weight)])
        self._keys_held += len(entry) - before
        self._unfolded = True

    # -- remainders ---------------------------------------------------------------------
    def _fold_remainders(self) -> None:
        """Fold every entry whose head is another entry's kept key (depth > 0) into that entry.
        A container folded away earlier in the pass is followed to where its keys went."""
        if not self._unfolded:
            return
        self._unfolded = False
        moved: dict[Ident, tuple[Ident, int]] = {}  # folded entry -> (its container, its depth there)
        for ident, container, depth in self._remainders():
            while container in moved:
                container, offset = moved[container]
                depth += offset
            target = self._entries.get(container)
            if container == ident or target is None or depth >= len(target) \
                    or target.keys[depth * KEY_BYTES:(depth + 1) * KEY_BYTES] != ident[1]:
                continue  # no longer inside it (its branch was replaced this pass)
            self._fold(target, depth, self._entries.pop(ident))
            moved[ident] = (container, depth)

    def _remainders(self) -> list[tuple[Ident, Ident, int]]:
        """(entry, the entry whose kept keys hold its head, that depth) for each entry whose
        head is a kept key at depth > 0 of another entry of its namespace: the first such
        place, entries in insertion order. One vectorized pass over the kept keys."""
        by_ns: dict[bytes, list[Ident]] = {}
        for ident in self._entries:
            by_ns.setdefault(ident[0], []).append(ident)
        found = []
        for idents in by_ns.values():
            if len(idents) < 2:
                continue
            entries = [self._entries[i] for i in idents]
            heads = np.frombuffer(b"".join(head for _, head in idents), dtype=KEY_DTYPE)
            order = np.argsort(heads, kind="stable")
            sorted_heads = heads[order]
            kept = np.frombuffer(b"".join(e.keys for e in entries), dtype=KEY_DTYPE)
            lengths = np.array([len(e) for e in entries])
            owner = np.repeat(np.arange(len(entries)), lengths)
            depth = np.arange(len(kept)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
            at = np.minimum(np.searchsorted(sorted_heads, kept), len(sorted_heads) - 1)
            head_of = order[at]
            inner = np.flatnonzero((sorted_heads[at] == kept) & (depth > 0) & (head_of != owner))
            _, first = np.unique(head_of[inner], return_index=True)
            for j in inner[np.sort(first)]:
                found.append((idents[head_of[j]], idents[owner[j]], int(depth[j])))
        return found

    def _fold(self, entry: _Entry, depth: int, rem: _Entry) -> None:
        """Count ``rem``'s requests as requests of ``entry``'s first ``depth`` keys followed by
        ``rem``'s keys; its branch replaces the kept one past ``depth`` where it was reached more."""
        before = len(entry) + len(rem)
        entry.reach[:depth] += rem.reach[0]
        agree = agreeing_keys(entry.keys[depth * KEY_BYTES:], rem.keys)
        entry.reach[depth:depth + agree] += rem.reach[:agree]
        room = self._prefix_keys_max - depth
        at = depth + agree
        if agree < min(len(rem), room) and (at == len(entry) or entry.reach[at] < rem.reach[agree]):
            entry.keys = entry.keys[:at * KEY_BYTES] + rem.keys[agree * KEY_BYTES:room * KEY_BYTES]
            entry.reach = np.concatenate([entry.reach[:at], rem.reach[agree:room]])
        self._keys_held += len(entry) - before

    def _weight(self, now_s: float) -> float:
        if self._t_ref is None:
            self._t_ref = now_s
        exponent = (now_s - self._t_ref) / self._half_life_s
        if exponent > REBASE_EXPONENT_MAX:
            scale = 2.0 ** -exponent
            for entry in self._entries.values():
                entry.reach *= scale
            self._t_ref, exponent = now_s, 0.0
        return 2.0 ** exponent

    def _scale(self, now_s: float) -> float:
        """Stored counts times this are counts as of ``now_s``."""
        return 1.0 if self._t_ref is None else 2.0 ** (-(now_s - self._t_ref) / self._half_life_s)

    def _enforce_bounds(self, now_s: float) -> None:
        if len(self._entries) <= self._heads_max and self._keys_held <= self._keys_max:
            return
        for ident in sorted(self._entries, key=lambda i: (self._entries[i].reach[0], i)):
            if len(self._entries) <= self._heads_max and self._keys_held <= self._keys_max:
                break
            self._keys_held -= len(self._entries.pop(ident))
            self._evicted += 1

    # -- reading ----------------------------------------------------------------------
    def count(self, ns_id: bytes | None, head: bytes, now_s: float) -> float:
        """The decayed request count of one head as of ``now_s`` (0.0 when not tracked)."""
        entry = self._entries.get((bytes(ns_id or b""), bytes(head)))
        return 0.0 if entry is None else float(entry.reach[0]) * self._scale(now_s)

    def top(self, now_s: float, count_max: int | None = None) -> list[HotPrefix]:
        """Prefixes by decayed count, most popular first (ties: the smaller ``(ns_id, head)``)."""
        scale = self._scale(now_s)
        ranked = sorted(self._entries.items(), key=lambda item: (-item[1].reach[0], item[0]))
        if count_max is not None:
            ranked = ranked[:count_max]
        return [HotPrefix(ns_id, entry.keys[:entry.prefix_length() * KEY_BYTES], float(entry.reach[0]) * scale)
                for (ns_id, _), entry in ranked]

    def statistics(self) -> PopularityStatistics:
        return PopularityStatistics(heads_tracked=len(self._entries), keys_tracked=self._keys_held,
                                    observations=self._observations, heads_evicted=self._evicted)
