"""The warm tier as ``KVCache`` sees it: the daemons that own its blocks, reached over
TCP or by direct device reads, one LOOKUP / GET / PUT batch per owner.

A block is stored as ``layout.layer_groups`` objects, one per layer group, under
:func:`~kvtier.common.keys.layer_group_key`; every object of a block goes to the block
key's owner, so one LOOKUP of a chain's objects (block-major) answers how many leading
blocks are whole::

    block keys   k0        k1        k2
    objects      k0.g0 k0.g1 k1.g0 k1.g1 k2.g0 k2.g1        (layer_groups = 2)

A fetched block is the tuple of its verified objects (header + payload each), in group
order, or ``None`` where any object is missing or fails verification.
"""
from __future__ import annotations

import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

from kvtier.common.blockformat import BlockFormatError, decode_header
from kvtier.common.keys import Namespace, layer_group_key

from .direct_reader import DirectLocation, DirectReader
from .routing import Rendezvous
from .tier_stats import TierRecorder

log = logging.getLogger(__name__)

FETCH_STREAM_BLOCKS_MIN = 4  # a batch smaller than this is not worth a stream of its own


@dataclass(frozen=True)
class Daemon:
    """One daemon: its block client and, where its devices are visible, a direct reader."""

    address: str
    client: object
    reader: DirectReader | None


class WarmTier:
    """LOOKUP, GET and PUT of whole blocks (all their layer groups) across the owners."""

    def __init__(self, namespace: Namespace, codec_id: int, daemons: Sequence[Daemon], routing: Rendezvous,
                 io: ThreadPoolExecutor, streams: int, stats: TierRecorder) -> None:
        self.namespace = namespace
        self.layout = namespace.layout
        self.codec_id = codec_id
        self.daemons = list(daemons)
        self.routing = routing
        self.stats = stats
        self._io = io
        self._streams = streams

    # --- keys and owners ---------------------------------------------------------
    def objects_of(self, keys: Sequence[bytes], groups: Sequence[int] | None = None) -> list[bytes]:
        """The object keys of ``keys``' ``groups`` (all by default), block-major."""
        groups = range(self.layout.layer_groups) if groups is None else groups
        if list(groups) == [0]:
            return list(keys)
        return [layer_group_key(k, g) for k in keys for g in groups]

    def by_owner(self, keys: Sequence[bytes]) -> dict[Daemon, list[int]]:
        """``{daemon: [indices of keys it owns]}`` (:mod:`.routing`)."""
        return {self.daemons[m]: idx for m, idx in self.routing.groups(keys).items()}

    # --- lookup ------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> int:
        """Leading blocks of ``keys`` whose every layer group is stored: one LOOKUP per owner."""
        if not keys:
            return 0
        groups = self.layout.layer_groups
        first_missing = len(keys)
        for daemon, idx in self.by_owner(keys).items():
            present = daemon.client.lookup(self.objects_of([keys[i] for i in idx]), ns_id=self.namespace.id)
            if present // groups < len(idx):
                first_missing = min(first_missing, idx[present // groups])
        return first_missing

    # --- fetch -------------------------------------------------------------------
    def fetch(self, keys: list[bytes], prefix_only: bool, transports: dict[str, int],
              groups: Sequence[int] | None = None, count_blocks: bool = True) -> list:
        """Each block of ``keys`` as the tuple of its ``groups``' verified objects, None
        per miss (and, with ``prefix_only``, for every block after the first miss);
        ``transports`` counts blocks delivered per transport. ``count_blocks=False``
        records the bytes only (a later layer group of blocks counted already)."""
        groups = list(range(self.layout.layer_groups) if groups is None else groups)
        started = time.perf_counter()
        results: list = [None] * len(keys)
        via: list[str | None] = [None] * len(keys)
        fallbacks = 0
        for daemon, idx in self.by_owner(keys).items():
            objects = self.objects_of([keys[i] for i in idx], groups)
            got, names, fell = self._fetch_from(daemon, objects, prefix_only)
            fallbacks += fell
            width = len(groups)
            for n, i in enumerate(idx):
                parts = got[n * width:(n + 1) * width]
                if all(p is not None for p in parts):
                    results[i], via[i] = tuple(parts), names[n * width]
        if prefix_only:
            cut = next((i for i, blk in enumerate(results) if blk is None), len(results))
            results[cut:] = [None] * (len(results) - cut)
            via[cut:] = [None] * (len(via) - cut)
        nbytes = sum(len(part) for r in results if r is not None for part in r)
        if not count_blocks:
            self.stats.record(bytes_read=nbytes, fallbacks=fallbacks)
            return results
        counted: dict[str, int] = {}
        for name in via:
            if name is not None:
                counted[name] = counted.get(name, 0) + 1
                transports[name] = transports.get(name, 0) + 1
        self.stats.record(misses=len(keys) - sum(counted.values()), bytes_read=nbytes,
                          latency_s=time.perf_counter() - started, fallbacks=fallbacks)
        for name, count in counted.items():
            self.stats.record(hits=count, transport=name)
        return results

    def _fetch_from(self, daemon: Daemon, keys: list[bytes], prefix_only: bool):
        """(objects, transport name per object, fallbacks) from one daemon."""
        blocks: list = [None] * len(keys)
        via: list[str | None] = [None] * len(keys)
        tcp_idx = list(range(len(keys)))
        fallbacks = 0
        if daemon.reader is not None:
            present, found = daemon.client.lookup_locations(keys, ns_id=self.namespace.id)
            locations = list(found) + [None] * (len(keys) - len(found))
            span = present if prefix_only else len(keys)
            direct_idx = [i for i in range(span) if locations[i] is not None and locations[i].sealed]
            if direct_idx:
                try:
                    got = daemon.reader.read_many(
                        [keys[i] for i in direct_idx],
                        [DirectLocation(locations[i].logical_offset, locations[i].length, locations[i].seq)
                         for i in direct_idx])
                except (OSError, ValueError) as exc:
                    # an unreadable device or a location outside the geometry we hold (the
                    # daemon was re-formatted): every block goes to TCP instead
                    log.warning("event=direct_read_failed daemon=%s error=%s", daemon.address, exc)
                    got = [None] * len(direct_idx)
                for i, block in zip(direct_idx, got):
                    if block is not None and self.header_ok(block, keys[i]):
                        blocks[i], via[i] = block, "direct"
                    else:
                        fallbacks += 1
            # unsealed blocks and direct-read failures go to TCP
            tcp_idx = [i for i in range(span) if blocks[i] is None and locations[i] is not None]
        if tcp_idx:
            got = self._get_many(daemon, [keys[i] for i in tcp_idx])
            for i, block in zip(tcp_idx, got):
                if block is not None and self.header_ok(block, keys[i]):
                    blocks[i], via[i] = block, "tcp"
        return blocks, via, fallbacks

    def _get_many(self, daemon: Daemon, keys: list[bytes]) -> list:
        """GET over TCP, split into up to ``streams`` contiguous batches that run in
        parallel on the client's connection pool (the daemon reads them from its
        devices concurrently)."""
        # copy=False: verified read-only views into the reply buffers, which live as
        # long as a view does; decoding reads them once instead of copying them first
        get = functools.partial(daemon.client.get_many, ns_id=self.namespace.id, copy=False)
        streams = min(self._streams, len(keys) // FETCH_STREAM_BLOCKS_MIN)
        if streams <= 1:
            return get(keys)
        bounds = [len(keys) * i // streams for i in range(streams + 1)]
        futures = [self._io.submit(get, keys[a:b]) for a, b in zip(bounds, bounds[1:])]
        out: list = []
        for fut in futures:
            out.extend(fut.result())
        return out

    def header_ok(self, block, key: bytes) -> bool:
        """The object is this namespace's, this key's, and in this codec (the CRCs were
        checked by whoever read it)."""
        try:
            head = decode_header(block)
        except BlockFormatError:
            return False
        return head.key == key and head.ns_id == self.namespace.id and head.codec_id == self.codec_id

    # --- store -------------------------------------------------------------------
    def send(self, keys: Sequence[bytes], objects: Sequence[Sequence[memoryview]], durable: bool) -> int:
        """PUT each block's objects (``objects[g][i]``: group g of block i) to its owner."""
        group_keys = [self.objects_of(keys, [g]) for g in range(len(objects))]
        for daemon, idx in self.by_owner(keys).items():
            daemon.client.put_many([(group_keys[g][i], objects[g][i]) for i in idx for g in range(len(objects))],
                                   durable=durable)
        # tier latencies describe reads (what TTFT waits for); writes count bytes only
        self.stats.record(bytes_written=sum(b.nbytes for group in objects for b in group))
        return len(keys)
