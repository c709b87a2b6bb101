"""The warm tier as ``KVCache`` sees it: the daemons that own its blocks, reached over
TCP or by direct device reads, one LOOKUP / GET / PUT batch per owner.

A block is stored as ``layout.layer_groups`` objects, one per layer group, under
:func:`~kvtier.common.keys.layer_group_key`; every object of a block goes to the block
key's owner, so one LOOKUP of a chain's objects (block-major) answers how many leading
blocks are whole::

    block keys   k0        k1        k2
    objects      k0.g0 k0.g1 k1.g0 k1.g1 k2.g0 k2.g1        (layer_groups = 2)

Each key has ``replicas`` owners among the live members (:class:`~.owner_pool.OwnerPool`,
rendezvous over the members' node ids, first choice first). A PUT goes to all of them in
parallel (acknowledged by one owner when buffered, by every owner when durable); LOOKUP and
GET ask the first owner and move to the next where it cannot answer (a connection error or
timeout: a counted failover) or lacks the block. A block found only on a later owner is
written back to the earlier owners that answered without it, in the background and bounded
(a counted repair)::

    keys          k0  k1  k2            replicas = 2
    owner col 0   B   A   C      <- asked first
    owner col 1   C   B   A      <- asked where col 0 failed or missed

A fetched block is the tuple of its verified objects (header + payload each), in group
order, or ``None`` where any object is missing or fails verification.
"""
from __future__ import annotations

import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from kvtier.common.blockformat import BlockFormatError, decode_header
from kvtier.common.keys import Namespace, layer_group_key

from kvtier.wire import events as p

from .direct_reader import DirectLocation, DirectReader
from .nixl_agent import NixlFetchFailed
from .owner_pool import OWNER_ERRORS, OwnerBatch, OwnerPool, WriteQuorumError
from .routing import positions_by_owner
from .scatter_plan import Landing, LandedBlock
from .save_queue import SaveQueue
from .tier_stats import TierRecorder

log = logging.getLogger(__name__)

FETCH_STREAM_BLOCKS_MIN = 4  # a batch smaller than this is not worth a stream of its own
REPAIR_QUEUE_BYTES_MAX = 64 * 1024 * 1024  # read-repairs in flight; more are dropped (a later hit retries)
PUT_OWNERS_PARALLEL_MAX = 8  # owners one PUT batch writes to at once
UPSTREAM_TRANSPORT = "upstream"  # the transport name of blocks a daemon fetched from its upstream (cold)


@dataclass(frozen=True)
class Daemon:
    """One daemon: its block client and, where its devices are visible, a direct reader;
    where this process runs NIXL, the :class:`~.nixl_setup.NixlSetup` of its transport."""

    address: str
    client: object
    reader: DirectReader | None
    nixl: object | None = None


class WarmTier:
    """LOOKUP, GET and PUT of whole blocks (all their layer groups) across the owners."""

    def __init__(self, namespace: Namespace, codec_id: int, pool: OwnerPool, replicas: int,
                 io: ThreadPoolExecutor, streams: int, stats: TierRecorder,
                 cold_stats: TierRecorder | None = None) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be 1 or more, got {replicas}")
        self.namespace = namespace
        self.layout = namespace.layout
        self.codec_id = codec_id
        self.pool = pool
        self.replicas = replicas
        self.stats = stats
        self.cold_stats = cold_stats  # blocks the daemons fetched from their upstream
        self._io = io
        self._streams = streams
        self._puts = ThreadPoolExecutor(max_workers=PUT_OWNERS_PARALLEL_MAX, thread_name_prefix="kvtier-put")
        self._repairs = SaveQueue(REPAIR_QUEUE_BYTES_MAX, name="kvtier-repair")

    @property
    def daemons(self) -> list[Daemon]:
        """The open daemons of the members now."""
        return self.pool.daemons

    def wait_repairs(self, timeout_s: float) -> None:
        """Wait for the read-repairs accepted so far (the queue runs them in order)."""
        self._repairs.submit(0, 0, lambda: 0).result(timeout=timeout_s)

    def close(self) -> None:
        """Drain the repairs and PUTs in flight, then close every connection."""
        self._repairs.close()
        self._puts.shutdown(wait=True)
        self.pool.close()

    # --- keys and owners ---------------------------------------------------------
    def objects_of(self, keys: Sequence[bytes], groups: Sequence[int] | None = None) -> list[bytes]:
        """The object keys of ``keys``' ``groups`` (all by default), block-major."""
        groups = range(self.layout.layer_groups) if groups is None else groups
        if list(groups) == [0]:
            return list(keys)
        return [layer_group_key(k, g) for k in keys for g in groups]

    @contextmanager
    def _placement(self, keys: Sequence[bytes]) -> Iterator[tuple[OwnerBatch, np.ndarray]]:
        """The members now (held open for the body) and each key's owners among them."""
        with self.pool.batch() as batch:
            if not len(batch.view):
                raise p.ConnectionLost(f"the cluster {batch.view.source} has no live members")
            yield batch, batch.placement(keys, self.replicas)

    @staticmethod
    def _owned(place: np.ndarray, todo: list[int], col: int) -> dict[int, list[int]]:
        """``{owner: ascending key indexes of todo}`` by column ``col`` of the placement."""
        return {j: [todo[q] for q in pos] for j, pos in positions_by_owner(place[todo, col]).items()}

    @staticmethod
    def _client_of(batch: OwnerBatch, j: int):
        daemon = batch.daemons[j]
        if daemon is None:
            raise p.ConnectionLost(f"no connection to {batch.node_of(j)}")
        return daemon

    # --- lookup ------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> int:
        """Leading blocks of ``keys`` whose every layer group is stored: one LOOKUP per owner,
        the next owner asked for what the first could not answer or lacks."""
        if not keys:
            return 0
        with self._placement(keys) as (batch, place):
            groups = self.layout.layer_groups
            todo, heard, failovers, error = list(range(len(keys))), [False] * len(keys), 0, None
            for col in range(place.shape[1]):
                ahead: list[int] = []
                for j, idx in self._owned(place, todo, col).items():
                    idx = self._unless_backed_off(batch, j, idx, heard, ahead)
                    if not idx:
                        continue
                    try:
                        present = batch.call(j, lambda d, idx=idx: d.client.lookup(
                            self.objects_of([keys[i] for i in idx]), ns_id=self.namespace.id)) // groups
                    except OWNER_ERRORS as exc:
                        error = self._owner_failed(batch, j, exc, "lookup")
                        ahead.extend(idx)
                        failovers += len(idx) if col + 1 < place.shape[1] else 0
                        continue
                    for i in idx:
                        heard[i] = True
                    ahead.extend(idx[present:])
                todo = sorted(ahead)
                if not todo:
                    break
        self.stats.record(failovers=failovers)
        if todo and not heard[todo[0]]:
            raise error
        return todo[0] if todo else len(keys)

    @staticmethod
    def _unless_backed_off(batch: OwnerBatch, j: int, idx: list[int], heard: list[bool], ahead: list[int]) -> list[int]:
        """``idx`` less the keys an owner already answered for, when owner ``j`` is in backoff
        (those stay missing, in ``ahead``: a node in backoff is asked only as a last resort)."""
        if not batch.skipped(j):
            return idx
        ahead.extend(i for i in idx if heard[i])
        return [i for i in idx if not heard[i]]

    @staticmethod
    def _owner_failed(batch: OwnerBatch, j: int, exc: BaseException, what: str) -> BaseException:
        log.warning("event=owner_failed op=%s node=%s error=%s", what, batch.node_of(j), exc)
        return exc

    # --- delete ------------------------------------------------------------------
    def delete(self, keys: Sequence[bytes]) -> int:
        """Delete every layer group of ``keys``' blocks on each of their owners among the live
        members; returns how many objects were deleted. An owner that fails is logged and
        skipped (its copy is deleted by a later failure, or ages out); any other failure (no live
        members, the cache closed, a refusal) is logged and deletes are given up: 0."""
        keys = list(keys)
        if not keys:
            return 0
        try:
            return self._delete_on_owners(keys)
        except (p.ClientError, OSError) as exc:
            log.warning("event=delete_failed blocks=%d error=%s", len(keys), exc)
            return 0

    def _delete_on_owners(self, keys: list[bytes]) -> int:
        deleted = 0
        with self._placement(keys) as (batch, place):
            for col in range(place.shape[1]):
                for j, idx in self._owned(place, list(range(len(keys))), col).items():
                    objects = self.objects_of([keys[i] for i in idx])
                    try:
                        deleted += sum(batch.call(j, lambda d, objects=objects: d.client.delete_many(objects)))
                    except OWNER_ERRORS as exc:
                        self._owner_failed(batch, j, exc, "delete")
        return deleted

    # --- fetch -------------------------------------------------------------------
    def fetch(self, keys: list[bytes], prefix_only: bool, transports: dict[str, int],
              groups: Sequence[int] | None = None, count_blocks: bool = True, landing: Landing | None = None) -> list:
        """Each block of ``keys`` as the tuple of its ``groups``' verified objects, None
        per miss (and, with ``prefix_only``, for every block after the first miss);
        ``transports`` counts blocks delivered per transport. ``count_blocks=False``
        records the bytes only (a later layer group of blocks counted already). ``landing``:
        blocks fetched over TCP are received straight into its views where they have its size
        (:class:`~.scatter_plan.LandedBlock` objects, verified where they landed)."""
        groups = list(range(self.layout.layer_groups) if groups is None else groups)
        if not keys:
            return []
        started = time.perf_counter()
        results: list = [None] * len(keys)
        via: list[str | None] = [None] * len(keys)
        fallbacks = self._fetch_owners(keys, groups, prefix_only, results, via, landing)
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
        self._record_tiers(keys, results, via, counted, time.perf_counter() - started, fallbacks)
        return results

    def _record_tiers(self, keys: list[bytes], results: list, via: list, counted: dict[str, int], latency_s: float,
                      fallbacks: int) -> None:
        """Warm: blocks the daemons held (a block their upstream had to fetch is a warm miss);
        cold: blocks fetched from a daemon's upstream for this request, and the misses where a
        daemon has one. The fetch's latency goes to cold when any block came from upstream."""
        cold = counted.pop(UPSTREAM_TRANSPORT, 0)
        cold_bytes = sum(len(part) for r, name in zip(results, via) if name == UPSTREAM_TRANSPORT for part in r)
        warm_bytes = sum(len(part) for r, name in zip(results, via) if r is not None and name != UPSTREAM_TRANSPORT
                         for part in r)
        warm = sum(counted.values())
        self.stats.record(misses=len(keys) - warm, bytes_read=warm_bytes, fallbacks=fallbacks,
                          latency_s=None if cold else latency_s)
        for name, count in counted.items():
            self.stats.record(hits=count, transport=name)
        if self.cold_stats is not None and any(d.client.has_upstream for d in self.daemons):
            self.cold_stats.record(hits=cold, misses=len(keys) - warm - cold, bytes_read=cold_bytes,
                                   latency_s=latency_s if cold else None,
                                   transport=UPSTREAM_TRANSPORT if cold else None)

    def _fetch_owners(self, keys: list[bytes], groups: list[int], prefix_only: bool, results: list,
                      via: list, landing: Landing | None = None) -> int:
        """Fill ``results`` / ``via`` from the first owner of each key that has it (the next
        owner where one fails or lacks it; repairs queued); returns the direct-read fallbacks."""
        fallbacks = failovers = 0
        with self._placement(keys) as (batch, place):
            todo, heard, error = list(range(len(keys))), [False] * len(keys), None
            missed: dict[int, list[int]] = {}  # key index -> owners that answered without it
            repairs: dict[int, list[int]] = {}  # owner -> key indexes to write back to it
            width = len(groups)
            for col in range(place.shape[1]):
                ahead: list[int] = []
                for j, idx in self._owned(place, todo, col).items():
                    idx = self._unless_backed_off(batch, j, idx, heard, ahead)
                    if not idx:
                        continue
                    objects = self.objects_of([keys[i] for i in idx], groups)
                    lands = None if landing is None else Landing(landing.head_nbytes, lambda n, _g, idx=idx: landing.views(
                        idx[n // width], groups[n % width]), landing.region)  # object n of this owner's batch
                    try:
                        got, names, fell = batch.call(j, lambda d, objects=objects, lands=lands: self._fetch_from(
                            d, objects, prefix_only, lands))
                    except OWNER_ERRORS as exc:
                        error = self._owner_failed(batch, j, exc, "get")
                        ahead.extend(idx)
                        failovers += len(idx) if col + 1 < place.shape[1] else 0
                        continue
                    fallbacks += fell
                    for n, i in enumerate(idx):
                        heard[i] = True
                        parts = got[n * width:(n + 1) * width]
                        if all(part is not None for part in parts):
                            names_of = names[n * width:(n + 1) * width]  # cold if any group came from upstream
                            results[i] = tuple(parts)
                            via[i] = UPSTREAM_TRANSPORT if UPSTREAM_TRANSPORT in names_of else names_of[0]
                            for owner in missed.get(i, ()):
                                repairs.setdefault(owner, []).append(i)
                        else:
                            ahead.append(i)
                            missed.setdefault(i, []).append(j)
                todo = sorted(ahead)
                if not todo:
                    break
            if todo and not all(heard[i] for i in (todo[:1] if prefix_only else todo)):
                raise error
            self.stats.record(failovers=failovers)
            if repairs:
                self._repair(batch, repairs, keys, groups, results)
        return fallbacks

    def _repair(self, batch: OwnerBatch, repairs: dict[int, list[int]], keys: list[bytes],
                groups: list[int], results: list) -> None:
        """Write blocks found on a later owner back to the owners that answered without
        them, in the background; a full repair queue drops the repair (a later hit retries).
        An owner that deleted a key lately does not take it back (a replica missed the delete)."""
        for j, idx in repairs.items():
            daemon = batch.daemons[j]
            # a block landed in the caller's tensors is not a block in memory to write back (a later hit repairs it)
            once: dict[bytes, int] = {}  # a key asked twice is written back once
            for i in idx:
                if not any(isinstance(part, LandedBlock) for part in results[i]):
                    once.setdefault(keys[i], i)
            idx = list(once.values())
            if not idx:
                continue
            items = [(key, memoryview(bytes(part))) for i in idx
                     for key, part in zip(self.objects_of([keys[i]], groups), results[i])]
            nbytes = sum(view.nbytes for _, view in items)

            def put(daemon=daemon, items=items, width=len(groups)) -> int:
                seqs = daemon.client.put_many(items, durable=False, repair=True)
                taken = sum(all(seqs[n:n + width]) for n in range(0, len(seqs), width))
                self.stats.record(repairs=taken, repairs_declined=len(seqs) // width - taken)
                return taken
            self._repairs.submit(nbytes, len(idx), put)

    def _put_to(self, daemon: Daemon, items: list, durable: bool) -> None:
        """PUT through NIXL where the daemon takes it (it READs the blocks from our memory), else,
        or when that fails, over TCP."""
        nixl = None if daemon.nixl is None else daemon.nixl.ready()
        if nixl is not None and nixl.puts:
            try:
                nixl.put_many(items, durable=durable)
                return
            except (NixlFetchFailed, p.ClientError, OSError) as exc:
                log.warning("event=nixl_put_failed daemon=%s blocks=%d error=%s", daemon.address, len(items), exc)
        daemon.client.put_many(items, durable=durable)

    def _fetch_from(self, daemon: Daemon, keys: list[bytes], prefix_only: bool, landing: Landing | None = None):
        """(objects, transport name per object, fallbacks) from one daemon."""
        blocks: list = [None] * len(keys)
        via: list[str | None] = [None] * len(keys)
        tcp_idx = list(range(len(keys)))
        fallbacks = 0
        nixl = None if daemon.nixl is None else daemon.nixl.ready()  # None: not set up (yet), TCP it is
        if daemon.reader is not None or nixl is not None:
            present, found = daemon.client.lookup_locations(keys, ns_id=self.namespace.id)
            locations = list(found) + [None] * (len(keys) - len(found))
            span = present if prefix_only else len(keys)
            direct_idx = [i for i in range(span) if locations[i] is not None and locations[i].sealed
                          and daemon.reader is not None]
            if direct_idx:
                try:
                    got = daemon.reader.read_many(
                        [keys[i] for i in direct_idx],
                        [DirectLocation(locations[i].logical_offset, locations[i].length, locations[i].seq)
                         for i in direct_idx],
                        None if landing is None else Landing(landing.head_nbytes,
                                                             lambda n, _g: landing.views(direct_idx[n], 0),
                                                             landing.region))
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
            # unsealed blocks and direct-read failures go to TCP; with an upstream, absent ones too
            # (the daemon fetches them: a LOOKUP's leading count covers blocks it holds nowhere)
            fetches = daemon.client.has_upstream
            tcp_idx = [i for i in range(span) if blocks[i] is None and (locations[i] is not None or fetches)]
        if tcp_idx and nixl is not None:
            fell, tcp_idx = self._fetch_nixl(daemon, nixl, keys, tcp_idx, locations, blocks, via, landing)
            fallbacks += fell
        if tcp_idx:
            got, upstream = self._get_many(daemon, [keys[i] for i in tcp_idx], None if landing is None else Landing(
                landing.head_nbytes, lambda n, _g: landing.views(tcp_idx[n], 0)))
            for i, block, cold in zip(tcp_idx, got, upstream):
                if block is not None and self.header_ok(block, keys[i]):
                    blocks[i], via[i] = block, UPSTREAM_TRANSPORT if cold else "tcp"
            if nixl is None and daemon.nixl is not None and daemon.nixl.failed:
                fallbacks += sum(via[i] == "tcp" for i in tcp_idx)
        return blocks, via, fallbacks

    def _fetch_nixl(self, daemon: Daemon, nixl, keys: list[bytes], idx: list[int], locations: list, blocks: list,
                    via: list, landing: Landing | None = None) -> tuple[int, list[int]]:
        """NIXL GET of the located blocks among ``idx`` into ``blocks`` / ``via`` (raw blocks straight
        into the ``landing``'s views, where it has a region); returns the fallbacks (located blocks
        NIXL did not deliver verified) and the indexes left for TCP."""
        located = [i for i in idx if locations[i] is not None]
        if not located:
            return 0, idx
        streams = max(1, min(self._streams, len(located) // FETCH_STREAM_BLOCKS_MIN))
        bounds = [len(located) * s // streams for s in range(streams + 1)]

        def get(part: list[int]) -> list:
            lands = None if landing is None else Landing(landing.head_nbytes, lambda n, _g: landing.views(part[n], 0),
                                                         landing.region)
            try:
                return nixl.get_many([keys[i] for i in part], [locations[i].length for i in part],
                                     [locations[i].seq for i in part], ns_id=self.namespace.id, landing=lands)
            except (NixlFetchFailed, p.ClientError, OSError) as exc:
                log.warning("event=nixl_get_failed daemon=%s blocks=%d error=%s", daemon.address, len(part), exc)
                return [None] * len(part)
        parts = [located[a:b] for a, b in zip(bounds, bounds[1:])]
        got = [block for part in (list(self._io.map(get, parts)) if streams > 1 else [get(parts[0])])
               for block in part]
        fell = 0
        for i, block in zip(located, got):
            if block is not None and self.header_ok(block, keys[i]):
                blocks[i], via[i] = block, "nixl"
            else:
                fell += 1
        return fell, [i for i in idx if blocks[i] is None]

    def _get_many(self, daemon: Daemon, keys: list[bytes], landing: Landing | None = None) -> tuple[list, list[bool]]:
        """GET over TCP, split into up to ``streams`` contiguous batches that run in
        parallel on the client's connection pool (the daemon reads them from its
        devices concurrently); with, per key, whether the daemon fetched it from its upstream."""
        # copy=False: verified read-only views into the reply buffers, which live as
        # long as a view does; decoding reads them once instead of copying them first
        # with a landing (and no upstream, whose origins only get_many reports), raw blocks are
        # received straight into its views
        scatter = landing is not None and not daemon.client.has_upstream

        def get(part: list[bytes], first: int = 0) -> tuple[list, list[bool]]:
            if scatter:
                return daemon.client.get_many_into(part, [functools.partial(landing.views, first + n, 0)
                                                          for n in range(len(part))],
                                                   landing.head_nbytes, ns_id=self.namespace.id), [False] * len(part)
            origins: list[bool] = []
            return daemon.client.get_many(part, ns_id=self.namespace.id, copy=False, origins=origins), origins
        streams = min(self._streams, len(keys) // FETCH_STREAM_BLOCKS_MIN)
        if streams <= 1:
            return get(keys)
        bounds = [len(keys) * i // streams for i in range(streams + 1)]
        futures = [self._io.submit(get, keys[a:b], a) for a, b in zip(bounds, bounds[1:])]
        out: list = []
        upstream: list[bool] = []
        for fut in futures:
            blocks, origins = fut.result()
            out.extend(blocks)
            upstream.extend(origins)
        return out, upstream

    def header_ok(self, block, key: bytes) -> bool:
        """The object is this namespace's, this key's, and in this codec (the CRCs were
        checked by whoever read it)."""
        try:
            head = decode_header(block.head if isinstance(block, LandedBlock) else block)
        except BlockFormatError:
            return False
        return head.key == key and head.ns_id == self.namespace.id and head.codec_id == self.codec_id

    # --- store ---------------------------------------------------------------------
    def send(self, keys: Sequence[bytes], objects: Sequence[Sequence[memoryview]], durable: bool) -> int:
        """PUT each block's objects (``objects[g][i]``: group g of block i) to all its owners
        in parallel. Acknowledged when one owner of every block took it (every owner, when
        ``durable``); else :class:`~.owner_pool.WriteQuorumError` names the nodes that failed.
        A durable PUT needs ``replicas`` owners: with fewer live members it is refused before
        anything is sent."""
        keys = list(keys)
        if not keys:
            return 0
        with self._placement(keys) as (batch, place):
            if durable and place.shape[1] < self.replicas:
                raise WriteQuorumError(f"a durable PUT needs {self.replicas} owners of every block (replicas="
                                       f"{self.replicas}); the cluster {batch.view.source} has {len(batch.view)} "
                                       "live members")
            group_keys = [self.objects_of(keys, [g]) for g in range(len(objects))]
            # a buffered PUT skips owners in backoff where a key has another owner to take it
            skip = np.zeros(place.shape, dtype=bool)
            if batch.backed_off is not None and not durable:
                skip = batch.backed_off[place]
                skip &= ~skip.all(axis=1, keepdims=True)
            per_owner: dict[int, list[int]] = {}
            for col in range(place.shape[1]):
                sent = np.flatnonzero(~skip[:, col])
                for j, pos in positions_by_owner(place[sent, col]).items():
                    per_owner.setdefault(j, []).extend(sent[pos].tolist())

            def put(j: int) -> int:
                idx = sorted(per_owner[j])
                items = [(group_keys[g][i], objects[g][i]) for i in idx for g in range(len(objects))]
                batch.call(j, lambda d: self._put_to(d, items, durable))
                return sum(view.nbytes for _, view in items)
            owners = list(per_owner)
            futures = {j: self._puts.submit(put, j) for j in owners[1:]}
            outcome: dict[int, object] = {}
            for j in owners:  # every PUT finishes before this returns: the caller frees the buffers then
                try:
                    outcome[j] = put(j) if j == owners[0] else futures[j].result()
                except OWNER_ERRORS as exc:
                    outcome[j] = self._owner_failed(batch, j, exc, "put")
                except BaseException as exc:  # not an owner fault: raised once every PUT is done
                    outcome[j] = exc
            other = [exc for exc in outcome.values() if isinstance(exc, BaseException)
                     and not isinstance(exc, OWNER_ERRORS)]
            if other:
                raise other[0]
            failed = {j: exc for j, exc in outcome.items() if isinstance(exc, BaseException)}
            down = np.zeros(len(batch.view), dtype=bool)
            down[list(failed)] = True
            acks = (~down[place] & ~skip).sum(axis=1)
            need = place.shape[1] if durable else 1
            if (acks < need).any():
                names = ", ".join(f"{batch.node_of(j)}: {exc}" for j, exc in failed.items())
                raise WriteQuorumError(f"{'durable' if durable else 'buffered'} PUT of {int((acks < need).sum())} of "
                                       f"{len(keys)} blocks reached fewer than {need} of their owners; failed: "
                                       f"{names}") from next(iter(failed.values()))
        # tier latencies describe reads (what TTFT waits for); writes count bytes only
        self.stats.record(bytes_written=sum(n for n in outcome.values() if not isinstance(n, BaseException)))
        return len(keys)
