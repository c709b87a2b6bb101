"""KVCache: the engine-side cache over the hot, warm and cold tiers.

What an inference engine links. Given a prompt's tokens it finds the
longest stored prefix, brings its KV into the engine's memory and lets the
engine prefill only the rest; after prefill it stores the new blocks::

    load(tokens)
      keys = namespace.keys(tokens)                    (chained, whole blocks)
      hot:  lease the leading blocks resident in the pool (ref-counted)
      warm: the rest from kvtierd - direct device reads of sealed blocks
            where the devices are visible (validated: key, seq, CRC; a
            mismatch falls back to TCP), TCP otherwise
            -> decode (the namespace's codec) straight into pool slots
      -> per-layer (k, v) [1, kv_heads, T, head_dim] on the engine's device

    store(tokens, kv)
      one LOOKUP round trip -> skip the leading blocks already stored
      -> encode + PUT the rest (one batch), and keep them hot

cold (the daemon's upstream, ``kvtierd --upstream``) is served through the
daemon, which says per block whether it held it or fetched it from its upstream
(``FLAG_WANT_ORIGIN``): ``statistics().cold`` counts the blocks fetched upstream
for this client (hits, bytes, latency), ``warm`` the blocks the daemon held.

Several daemon addresses form a static cluster: each key has one owner by
rendezvous hashing over the addresses (:mod:`.routing`, the rule every
client uses); a batch is split per owner. ``etcd://HOST:PORT/PREFIX`` names a
cluster whose members are watched in etcd: each key goes to ``replicas`` (default
2) live members, with failover and read-repair (:mod:`.warm_tier`).
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

from kvtier.kernels import MixedCodec, get_codec
from kvtier.wire import events as p

from .async_twins import AsyncTwins
from .block_decoder import BlockDecoder
from .block_encoder import BlockEncoder, gather_block
from .block_payload import (as_tensor, as_token_list, check_blocks, check_kv, copy_block_into, copy_tensor, layers_of,
                            out_tokens)
from .direct_reader import DirectReader
from .hot_pool import HotPool
from .nixl_setup import lent_for_puts
from .output_buffers import OUTPUT_BUFFERS_BYTES_MAX, LoadOutputs
from .group_streamer import stream_groups
from .prefix_load import PrefixLoad
from .save_queue import SAVE_QUEUE_BYTES_MAX, SaveQueue
from .source_blocks import host_spans
from .store_pipeline import chunk_bounds, run_pipelined
from kvtier.common.cluster_url import REPLICAS_DEFAULT, is_cluster_url
from kvtier.common.keys import Namespace
from .owner_pool import FixedMembers, OwnerPool
from .warm_tier import Daemon, WarmTier
from .tier_stats import CacheStatistics, TierRecorder

log = logging.getLogger(__name__)

DEFAULT_HOT_POOL_BYTES = 256 * 1024 * 1024  # a modest default; engines size it from free HBM
WORKERS_MAX = 4  # prefetch / async-twin threads; loads are I/O-bound and few at a time
FETCH_STREAMS_MAX = 4  # parallel GET batches per daemon and load: the daemon reads them from its devices at once
TRANSPORTS = ("auto", "tcp", "direct", "nixl")  # nixl: docs/nixl.md (auto: where installed and offered)
CLUSTER_IO_OWNERS = 4  # owners one load streams from at once, on an etcd cluster


@dataclass(frozen=True)
class LoadedPrefix:
    """The KV of a stored prefix: ``layers[i] = (k, v)``, each
    ``[1, kv_heads, num_tokens, head_dim]`` on the cache's device."""

    num_tokens: int
    layers: tuple = ()
    blocks_hot: int = 0
    blocks_warm: int = 0
    transports: Mapping[str, int] = field(default_factory=dict)  # warm blocks by transport

    @property
    def num_blocks(self) -> int:
        return self.blocks_hot + self.blocks_warm


class KVCache(AsyncTwins):
    """The engine-side cache. See the module doc; thread-safe."""

    def __init__(self, namespace: Namespace, addresses: str | Sequence[str], token: str | None = None,
                 hot_pool_bytes: int = DEFAULT_HOT_POOL_BYTES, device: str = "cpu",
                 device_map: Mapping[str, str] | None = None, transport: str = "auto",
                 pool_size: int = 4, timeout_s: float = 30.0, direct_backend: str = "auto",
                 save_queue_bytes: int = SAVE_QUEUE_BYTES_MAX, replicas: int | None = None,
                 output_buffers_bytes: int = OUTPUT_BUFFERS_BYTES_MAX) -> None:
        if not isinstance(namespace, Namespace):
            raise ValueError("namespace must be a kvtier.common.keys.Namespace")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if transport == "direct" and not device_map:
            raise ValueError("transport='direct' needs device_map {daemon device id: local path}")
        addrs = [addresses] if isinstance(addresses, str) else list(addresses)
        cluster = len(addrs) == 1 and isinstance(addrs[0], str) and is_cluster_url(addrs[0])  # or a list of one
        if not addrs or len(set(addrs)) != len(addrs):
            raise ValueError(f"need one or more distinct daemon addresses, got {addresses!r}")
        replicas = (REPLICAS_DEFAULT if cluster else 1) if replicas is None else replicas
        if replicas < 1:
            raise ValueError(f"replicas must be 1 or more, got {replicas}")
        self.namespace = namespace
        self.layout = namespace.layout
        self.codec = get_codec(namespace.codec)
        self.device = device
        self.transport = transport
        if self.layout.layer_groups > 1 and isinstance(self.codec, MixedCodec):
            raise ValueError("the mixed codec chooses per layer of a whole block: use layer_groups=1 with it")
        self._hot = HotPool(self.layout, hot_pool_bytes, device)
        self._decoder = BlockDecoder(self.layout, self.codec, device)
        self._outputs = LoadOutputs(self.layout, device, output_buffers_bytes)  # reused once the engine drops them
        pinned = str(device).startswith("cuda")  # engine KV in HBM: gathers DMA into page-locked send buffers
        self._encoders = [BlockEncoder(self.layout, namespace.id, self.codec, self.layout.group_layers(g), pinned)
                          for g in range(self.layout.layer_groups)]
        self._saves = SaveQueue(save_queue_bytes)
        self._stats = {name: TierRecorder(name) for name in ("hot", "warm", "cold")}
        self._counters_lock = threading.Lock()
        self._requested = 0
        self._stored = 0
        self._executor = ThreadPoolExecutor(max_workers=WORKERS_MAX, thread_name_prefix="kvtier-cache")
        self._streams = max(1, min(FETCH_STREAMS_MAX, pool_size))
        # GET streams run here, never on _executor: a prefetch waiting on its own pool could deadlock
        io_owners = CLUSTER_IO_OWNERS if cluster else len(addrs)
        self._io = ThreadPoolExecutor(max_workers=self._streams * io_owners, thread_name_prefix="kvtier-get")
        # a streaming load's layer-group fetches: they wait on _io, and their driver on them
        self._group_fetches = ThreadPoolExecutor(max_workers=WORKERS_MAX, thread_name_prefix="kvtier-group")
        self._store_puts = ThreadPoolExecutor(max_workers=self._streams, thread_name_prefix="kvtier-store")
        self._warm: WarmTier | None = None
        try:
            if cluster:
                from .cluster_members import open_members
                members = open_members(addrs[0])
            else:
                members = FixedMembers(addrs)
            opener = functools.partial(self._open_daemon, token, pool_size, timeout_s, device_map, direct_backend)
            self._warm = WarmTier(namespace, self.codec.codec_id, OwnerPool(members, opener), replicas, self._io,
                                  self._streams, self._stats["warm"], cold_stats=self._stats["cold"])
            if not cluster:
                self._warm.pool.open_all()  # a static list connects (and finds its devices) now
        except BaseException:
            self.close()
            raise

    def _open_daemon(self, token, pool_size, timeout_s, device_map, backend, addr: str) -> Daemon:
        from . import BlockClient  # the block client (TCP); imported here to keep this module light

        client = BlockClient(addr, token=token, pool_size=pool_size, timeout_s=timeout_s)
        try:
            return Daemon(addr, client, self._open_reader(client, device_map, backend),
                          self._open_nixl(addr, token, pool_size, timeout_s))
        except BaseException:
            client.close()
            raise

    def _open_reader(self, client, device_map, backend) -> DirectReader | None:
        if self.transport in ("tcp", "nixl") or not device_map:
            return None
        geometry = client.geometry()
        try:
            return DirectReader(geometry, device_map, backend=backend)
        except (ValueError, OSError):
            if self.transport == "direct":
                raise
            return None  # auto: these devices are not visible here; TCP it is

    def _open_nixl(self, addr: str, token, pool_size: int, timeout_s: float):
        """The daemon's NIXL transport, set up in the background (TCP until it is ready): with ``auto``
        where NIXL is importable here, with ``nixl`` required (:func:`~.nixl_setup.open_nixl_setup`)."""
        if self.transport not in ("auto", "nixl"):
            return None
        from .nixl_setup import open_nixl_setup
        return open_nixl_setup(addr, self.transport == "nixl", token, pool_size, timeout_s)

    # --- keys and lookup ---------------------------------------------------
    def keys_for(self, tokens) -> list[bytes]:
        return self.namespace.keys(as_token_list(tokens))

    @property
    def direct_enabled(self) -> bool:
        return any(d.reader is not None for d in self._warm.daemons)

    def lookup(self, tokens) -> int:
        """Leading stored tokens (whole blocks), hot pool first, then one
        LOOKUP round trip per daemon."""
        return self.lookup_keys(self.keys_for(tokens)) * self.layout.block_tokens

    def lookup_keys(self, keys: Sequence[bytes]) -> int:
        """Leading stored blocks of ``keys``."""
        keys = list(keys)
        hot = 0
        while hot < len(keys) and self._hot.contains(keys[hot]):
            hot += 1
        return hot + self._warm.lookup(keys[hot:])

    # --- load ----------------------------------------------------------------
    def load(self, tokens, max_tokens: int | None = None, out=None) -> LoadedPrefix:
        """The longest stored prefix of ``tokens`` (at most ``max_tokens``), as
        per-layer K and V on the cache's device. Raw blocks bound for the host are
        received straight into the output (one LOOKUP sizes it first). ``out``: the
        caller's ``[L, 2, 1, H, T, D]`` tensor to load into (the prefix is cut to its T
        tokens; the layers returned are views of it), else a pooled output."""
        if out is not None:
            room = out_tokens(out, self.layout, self.device)
            max_tokens = room if max_tokens is None else min(room, max_tokens)
        keys = self.keys_for(self._prefix_tokens(tokens, max_tokens))
        if self.codec.name == "raw" and str(self.device) == "cpu":
            return self._load_in_place(keys, out)
        with self._held(keys, prefix_only=True) as held:
            out = self._outputs.kv(len(held.blocks)) if out is None else out
            n = 0
            for block in held.blocks:
                if isinstance(block, _Staged):
                    if not self._decoder.decode_into_tokens(block.data, out, n):
                        break  # a payload the codec rejects ends the prefix
                else:
                    copy_block_into(out, n, block, self.layout)
                n += 1
        b = self.layout.block_tokens
        layers = tuple((k[:, :, :n * b], v[:, :, :n * b]) for k, v in layers_of(out))
        return LoadedPrefix(num_tokens=n * b, layers=layers, blocks_hot=min(held.hot, n),
                            blocks_warm=n - min(held.hot, n), transports=dict(held.transports))

    def load_blocks(self, keys: Sequence[bytes]) -> list:
        """Each block of ``keys`` as a ``block_shape`` tensor on the cache's
        device, or ``None`` where it is missing or fails validation."""
        with self._held(list(keys), prefix_only=False) as held:
            out: list = []
            for block in held.blocks:
                if isinstance(block, _Staged):
                    target = self._outputs.block()
                    out.append(target if self._decoder.decode(block.data, target) else None)
                else:
                    out.append(None if block is None else block.clone())
            return out

    def load_blocks_into(self, keys: Sequence[bytes], targets: Sequence) -> list[bool]:
        """:meth:`load_blocks` straight into the caller's ``block_shape`` tensors (views of an
        engine's host pool or paged cache; raw payloads on the host land with one copy, any
        strides). Per key, whether its target now holds the block. A missing or corrupt block
        leaves its target as it was; one whose later layer group the codec refuses has its
        earlier groups written: a False target's contents are not the caller's KV either way."""
        keys = list(keys)
        if len(keys) != len(targets):
            raise ValueError(f"{len(keys)} keys but {len(targets)} targets")
        for i, target in enumerate(targets):
            if tuple(target.shape) != self.layout.block_shape:
                raise ValueError(f"target {i} has shape {tuple(target.shape)}, expected {self.layout.block_shape}")
        done: list[bool] = []
        with self._held(keys, prefix_only=False) as held:
            for block, target in zip(held.blocks, targets):
                if isinstance(block, _Staged):
                    done.append(self._decoder.decode_into(block.data, target))
                else:
                    if block is not None:
                        copy_tensor(target, block)
                    done.append(block is not None)
        return done

    def start_load(self, tokens, max_tokens: int | None = None) -> PrefixLoad:
        """Start loading the longest stored prefix of ``tokens`` (at most ``max_tokens``)
        and return at once with its tensors, which fill layer group by layer group
        (:class:`~.prefix_load.PrefixLoad`: ``wait_layer(i)`` before using layer i)."""
        load, out, warm_keys, hot = self._begin_load(self.keys_for(self._prefix_tokens(tokens, max_tokens)))
        if warm_keys:
            self._executor.submit(self._stream_groups, load, out, warm_keys, hot)
        return load

    def _load_in_place(self, keys: list[bytes], out=None) -> LoadedPrefix:
        """:meth:`load` as a :meth:`start_load` driven on this thread (a prefetch worker may be
        running it: waiting on a worker of its own pool could deadlock)."""
        load, out, warm_keys, hot = self._begin_load(keys, out)
        if warm_keys:
            self._stream_groups(load, out, warm_keys, hot)
        tokens, layers = load.wait_prefix()
        n = tokens // self.layout.block_tokens
        return LoadedPrefix(num_tokens=tokens, layers=layers, blocks_hot=min(hot, n), blocks_warm=n - min(hot, n),
                            transports=dict(load.transports))

    def _begin_load(self, keys: list[bytes], out=None) -> tuple[PrefixLoad, object, list[bytes], int]:
        """A prefix load's first half: the hot blocks leased and copied into the output (``out``,
        or a pooled one), one LOOKUP for the rest. (load, output, warm keys to fetch, hot blocks)."""
        with self._counters_lock:
            self._requested += len(keys)
        started = time.perf_counter()
        with self._hot.lease(keys, prefix_only=True) as lease:
            hot = lease.hits
            self._stats["hot"].record(hits=hot, misses=len(keys) - hot, bytes_read=hot * self.layout.block_raw_bytes,
                                      latency_s=time.perf_counter() - started)
            warm_keys = keys[hot:]
            warm = self._warm.lookup(warm_keys)
            out = self._outputs.kv(hot + warm) if out is None else out
            for i in range(hot):
                copy_block_into(out, i, lease.block(i), self.layout)
        self._stats["warm"].record(misses=len(warm_keys) - warm)  # absent at the LOOKUP: never fetched
        tokens = (hot + warm) * self.layout.block_tokens
        load = PrefixLoad(self.layout, tokens, tuple((k[:, :, :tokens], v[:, :, :tokens]) for k, v in layers_of(out)),
                          blocks_hot=hot, blocks_warm=warm, transports={})
        if not warm:
            for group in range(self.layout.layer_groups):
                load.group_done(group)
        return load, out, warm_keys[:warm], hot

    def _stream_groups(self, load: PrefixLoad, out, keys: list[bytes], first: int) -> None:
        """Fetch and decode each layer group of the warm blocks in turn (:mod:`.group_streamer`)."""
        fetch = functools.partial(self._warm.fetch, prefix_only=True, transports=load.transports,
                                  landing=self._decoder.landing(out, first))  # raw: straight into out
        stream_groups(load, out, first, keys, fetch, self._decoder, self._group_fetches, lambda: self._keep_hot(
            keys, lambda slot, i: copy_tensor(slot, out[:, :, 0, :, self._block_tokens(first + i)])))

    def _block_tokens(self, index: int) -> slice:
        b = self.layout.block_tokens
        return slice(index * b, (index + 1) * b)

    def _prefix_tokens(self, tokens, max_tokens: int | None) -> list[int]:
        token_list = as_token_list(tokens)
        if max_tokens is not None:
            if max_tokens < 0:
                raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
            token_list = token_list[:max_tokens]
        return token_list

    def prefetch(self, tokens, max_tokens: int | None = None) -> Future:
        """Start :meth:`load` now; the future's result is its LoadedPrefix."""
        return self._executor.submit(self.load, tokens, max_tokens)

    @contextmanager
    def _held(self, keys: list[bytes], prefix_only: bool) -> Iterator["_Held"]:
        """Blocks of ``keys`` held in the hot pool (or staged) for the body."""
        with self._counters_lock:
            self._requested += len(keys)
        started = time.perf_counter()
        with ExitStack() as stack:
            lease = stack.enter_context(self._hot.lease(keys, prefix_only=prefix_only))
            hot_hits = lease.hits
            self._stats["hot"].record(hits=hot_hits, misses=len(keys) - hot_hits,
                                      bytes_read=hot_hits * self.layout.block_raw_bytes,
                                      latency_s=time.perf_counter() - started)
            blocks: list = [lease.block(i) for i in range(len(keys))]
            if prefix_only:
                wanted = list(range(hot_hits, len(keys)))
            else:
                wanted = [i for i, blk in enumerate(blocks) if blk is None]
            transports: dict[str, int] = {}
            if wanted:
                fetched = self._warm.fetch([keys[i] for i in wanted], prefix_only, transports)
                for i, block in zip(wanted, fetched):
                    blocks[i] = self._place(stack, keys[i], block) if block is not None else None
                    if blocks[i] is None and prefix_only:
                        break
            if prefix_only:
                cut = next((i for i, blk in enumerate(blocks) if blk is None), len(blocks))
                blocks = blocks[:cut]
            yield _Held(blocks=blocks, hot=hot_hits, transports=transports)

    def _place(self, stack: ExitStack, key: bytes, block) -> object | None:
        """Decode a verified block into a pool slot (kept held by ``stack``);
        when the pool has no slot to give, leave it encoded (:class:`_Staged`)
        for the consumer to decode straight where it is needed."""
        got = self._hot.reserve(key)
        if got is None:
            return _Staged(block)
        slot, fresh = got
        target = self._hot.storage[slot]
        if fresh:
            try:
                decoded = self._decoder.decode(block, target)
            except BaseException:
                self._hot.abort(key)  # never leave a reservation that nobody will fill
                raise
            if not decoded:
                self._hot.abort(key)
                return None
            self._hot.commit(key)
        stack.callback(self._hot.release, [key])
        return target

    # --- store ---------------------------------------------------------------
    def store(self, tokens, kv, durable: bool = False) -> int:
        """Store the full blocks of ``tokens`` that ``kv`` (per-layer (k, v),
        ``[1, kv_heads, T, head_dim]``) covers and the daemon does not hold
        yet; keep them hot. Returns the number of blocks written."""
        keys, kv_tokens = self._store_keys(tokens, kv)
        return self._store_new(keys, kv, kv_tokens, durable)

    def _store_new(self, keys: list[bytes], kv, kv_tokens: int, durable: bool) -> int:
        known = self._warm.lookup(keys)
        new = keys[known:]
        if not new:
            return 0
        self._keep_hot(new, lambda slot, i: gather_block(kv, self.layout, known + i, slot))
        with lent_for_puts(self._warm.daemons, host_spans(kv)):  # daemons that READ the blocks where they lie
            return self._store_pipelined(new, lambda s, e: self._encode(kv, known + s, new[s:e], kv_tokens,
                                                                       from_source=True), durable)

    def store_async(self, tokens, kv, durable: bool = False, copy: bool = True) -> Future:
        """Write-behind :meth:`store`: the blocks are copied out of ``kv`` now (the engine
        may reuse its memory once this returns); the LOOKUP and PUT run on a background
        worker. The future holds the blocks written, 0 when the save queue was full (the
        save is dropped and counted in ``statistics().saves``). ``copy=False`` copies
        nothing on the caller's thread: the caller keeps ``kv`` unchanged until the future
        is done (a finished request's KV), and the whole :meth:`store` runs behind."""
        keys, kv_tokens = self._store_keys(tokens, kv)
        if not copy:
            return self._saves.submit(len(keys) * self.layout.block_raw_bytes, len(keys),
                                      lambda: self._store_new(keys, kv, kv_tokens, durable))
        self._keep_hot(keys, lambda slot, i: gather_block(kv, self.layout, i, slot))
        built = self._encode(kv, 0, keys, kv_tokens, sealed=False)
        return self._saves.submit(sum(group.nbytes for group in built), len(keys),
                                  lambda: self._send_new(keys, built, durable), on_drop=lambda: _release(built))

    def _encode(self, kv, first_block: int, keys: list[bytes], kv_tokens: int, sealed: bool = True,
                from_source: bool = False) -> list:
        """Each layer group's objects of blocks ``first_block ..`` of ``kv``, in send buffers (or,
        ``from_source``, sent from ``kv`` itself where the encoder can)."""
        built: list = []
        try:
            for group, encoder in enumerate(self._encoders):
                keys_ = self._warm.objects_of(keys, [group])
                objects = encoder.encode_from_source(kv, first_block, keys_) if from_source else None
                built.append(objects if objects is not None else
                             encoder.encode(kv, first_block, keys_, seq_tokens=kv_tokens, sealed=sealed))
        except BaseException:
            _release(built)
            raise
        return built

    def _encode_tensors(self, keys: list[bytes], blocks: Sequence, sealed: bool = True,
                        from_source: bool = False) -> list:
        built: list = []
        try:
            for group, encoder in enumerate(self._encoders):
                layers = self.layout.group_layers(group)
                parts, keys_ = [b[layers.start:layers.stop] for b in blocks], self._warm.objects_of(keys, [group])
                objects = encoder.tensors_from_source(parts, keys_) if from_source else None
                built.append(objects if objects is not None else encoder.encode_tensors(parts, keys_, sealed=sealed))
        except BaseException:
            _release(built)
            raise
        return built

    def _store_keys(self, tokens, kv) -> tuple[list[bytes], int]:
        token_list = as_token_list(tokens)
        kv_tokens = check_kv(kv, self.layout)
        if kv_tokens > len(token_list):
            raise ValueError(f"kv covers {kv_tokens} tokens but only {len(token_list)} tokens were given")
        return self.keys_for(token_list[:kv_tokens]), kv_tokens

    def store_blocks(self, keys: Sequence[bytes], blocks: Sequence, durable: bool = False) -> int:
        """Store each ``block_shape`` block (tensor or ndarray) under its key."""
        keys = list(keys)
        check_blocks(keys, blocks, self.layout)
        if not keys:
            return 0
        self._keep_hot(keys, lambda slot, i: copy_tensor(slot, as_tensor(blocks[i])))
        return self._store_pipelined(keys, lambda s, e: self._encode_tensors(keys[s:e], blocks[s:e],
                                                                             from_source=True), durable)

    def store_blocks_async(self, keys: Sequence[bytes], blocks: Sequence, durable: bool = False,
                           copy: bool = True) -> Future:
        """Write-behind :meth:`store_blocks` (see :meth:`store_async`, and its ``copy``); no LOOKUP first."""
        keys = list(keys)
        check_blocks(keys, blocks, self.layout)
        if not copy:
            return self._saves.submit(len(keys) * self.layout.block_raw_bytes, len(keys),
                                      lambda: self.store_blocks(keys, blocks, durable))
        self._keep_hot(keys, lambda slot, i: copy_tensor(slot, as_tensor(blocks[i])))
        built = self._encode_tensors(keys, blocks, sealed=False)

        def save() -> int:
            try:
                for group in built:
                    group.seal()
                return self._send(keys, [group.blocks for group in built], durable)
            finally:
                _release(built)
        return self._saves.submit(sum(group.nbytes for group in built), len(keys), save,
                                  on_drop=lambda: _release(built))

    def delete_blocks_async(self, keys: Sequence[bytes]) -> Future:
        """Delete ``keys``' blocks (every layer group, on every owner) in the background, after the
        saves queued so far: for blocks that failed to load, so that the recomputed blocks saved
        after this replace them (a daemon keeps the first block put under a key). The future
        holds the objects deleted, 0 where that failed (logged). Raises ClientError once closed."""
        try:
            return self._saves.then(functools.partial(self._warm.delete, list(keys)))
        except RuntimeError:
            raise p.ClientError("the cache is closed") from None

    def _send_new(self, keys: list[bytes], built: list, durable: bool) -> int:
        """The background half of :meth:`store_async`: PUT the blocks the daemons lack."""
        try:
            known = self._warm.lookup(keys)
            if known == len(keys):
                return 0
            for group in built:
                group.seal(known)  # the blocks the daemons hold are neither checksummed nor sent
            return self._send(keys[known:], [group.blocks[known:] for group in built], durable)
        finally:
            _release(built)

    def _store_pipelined(self, keys: list[bytes], build, durable: bool) -> int:
        """PUT ``keys`` chunk by chunk, ``build(start, end)`` gathering a chunk while earlier ones are sent."""
        return run_pipelined(chunk_bounds(len(keys), self.layout.block_raw_bytes), build,
                             lambda s, e, built: self._send(keys[s:e], [g.blocks for g in built], durable),
                             _release, self._store_puts, self._streams)

    def _send(self, keys: list[bytes], objects: list, durable: bool) -> int:
        sent = self._warm.send(keys, objects, durable)
        with self._counters_lock:
            self._stored += sent
        return sent

    def _keep_hot(self, keys: Sequence[bytes], fill) -> None:
        """Copy the blocks into the hot pool (``fill(slot, i)`` writes block i), when it has room."""
        if self._hot.capacity_blocks:
            for i, key in enumerate(keys):
                self._hot.put_with(key, lambda slot, i=i: fill(slot, i))

    def flush(self) -> None:
        """Ask every daemon to write out and seal its open region: stored
        blocks become durable and readable by direct device reads."""
        for daemon in self._warm.daemons:
            daemon.client.flush()

    # --- statistics and lifecycle -------------------------------------------
    def statistics(self) -> CacheStatistics:
        pool = self._hot.statistics()
        with self._counters_lock:
            requested, stored = self._requested, self._stored
        return CacheStatistics(hot=self._stats["hot"].snapshot(), warm=self._stats["warm"].snapshot(),
                               cold=self._stats["cold"].snapshot(), hot_blocks_resident=pool.resident_blocks,
                               hot_blocks_referenced=pool.referenced_blocks,
                               hot_capacity_blocks=pool.capacity_blocks, hot_evictions=pool.evictions,
                               blocks_requested=requested, blocks_stored=stored,
                               saves=self._saves.statistics())

    def cluster_statistics(self):
        """The members this cache routes over and their backoffs (an
        :class:`~.owner_pool.ClusterClientStatistics`; ``as_dict()`` for JSON)."""
        return self._warm.pool.statistics()

    def wait_nixl_ready(self, timeout_s: float) -> bool:
        """Every open daemon's NIXL transport set up within ``timeout_s`` (:func:`~.nixl_setup.wait_ready`)."""
        from .nixl_setup import wait_ready
        return wait_ready([d.nixl for d in self._warm.daemons], timeout_s)

    def close(self) -> None:
        """Drain accepted write-behind saves, then close every connection."""
        self._saves.close()
        self._executor.shutdown(wait=True)
        self._group_fetches.shutdown(wait=True)
        self._store_puts.shutdown(wait=True)
        self._io.shutdown(wait=True)
        if self._warm is not None:
            self._warm.close()

    def __enter__(self) -> "KVCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class _Staged:
    """A verified block not placed in the hot pool (no free slot): decoded by
    whoever consumes it, straight into its destination."""

    data: object


@dataclass(frozen=True)
class _Held:
    blocks: list
    hot: int
    transports: Mapping[str, int]


def _release(built: list) -> None:
    for group in built:
        group.release()
