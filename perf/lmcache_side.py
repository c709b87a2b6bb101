"""The LMCache half of perf/bench_store_load.py: runs in LMCache's own venv.

    /var/tmp/lmcache-venv/bin/python perf/lmcache_side.py '{"dir": ..., "requests": 1, ...}'

Prints one JSON document on stdout (progress and LMCache's logs go to stderr).
Started by bench_store_load.py with the same layout, tokens and KV bytes as the
kvtier half (both derive them from one seed with the same torch build).

What it measures, on LMCache's local-disk backend (``LocalDiskBackend``,
``extra_config.use_odirect``) with its CPU hot cache off (``local_cpu=False``,
so retrieves come from the files)::

    store     LMCacheEngine.store(tokens, kv=...) for every request, until the
              backend's disk writes have all completed (its own completion:
              ``async_save_bytes_to_disk`` returned for every chunk)
    durable   + fsync of every chunk file and of the directory: LMCache itself
              never fsyncs, so this is what "durable" costs on top of it
    retrieve  page cache dropped, then LMCacheEngine.retrieve(tokens, kv=out)
              for every request; bytes compared with what was stored
    lookup    LMCacheEngine.lookup(tokens) of one request's 32 chunks, p50/p99

LMCache has no CPU connector that copies (``MockGPUConnector`` is a no-op), so
:class:`CopyConnector` below implements ``GPUConnectorInterface`` by copying
between the engine's per-layer (k, v) tensors and LMCache's memory objects; its
time is reported on its own (``connector_s``). LMCache's disk index lives in
the process only (no recovery from the files), so unlike kvtierd it cannot be
restarted between store and retrieve: the page cache is dropped instead.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

LOOKUP_ROUNDS = 200  # enough for a p99 of 32-chunk lookups; each is well under a millisecond
WRITE_WAIT_S_MAX = 600.0  # bound on waiting for LMCache's background disk writes
GiB = 1 << 30


def progress(msg: str) -> None:
    print(f"[lmcache_side {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_request(seed: int, index: int, tokens: int, layers: int, heads: int, head_dim: int):
    """Tokens and per-layer (k, v) ``[1, heads, tokens, head_dim]`` float16 of one
    request: the same function, seed and torch build as bench_store_load.py's."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    token_ids = torch.randint(0, 128_000, (tokens,), generator=g, dtype=torch.int64)
    raw = torch.randint(-32768, 32768, (layers, 2, 1, heads, tokens, head_dim), generator=g, dtype=torch.int16)
    kv = raw.view(torch.float16)
    return token_ids.tolist(), [(kv[i, 0], kv[i, 1]) for i in range(layers)]


def copy_connector_class():
    from lmcache.v1.gpu_connector import GPUConnectorInterface

    class CopyConnector(GPUConnectorInterface):
        """A CPU connector that copies: engine KV (per-layer (k, v), each
        ``[1, H, T, D]``, passed as ``kv=`` to store/retrieve) <-> LMCache memory
        objects in KV_2LTD format ``[2, L, t, H*D]``. ``seconds`` adds up its time."""

        def __init__(self, layers: int, heads: int, head_dim: int, chunk_tokens: int):
            self.layers, self.heads, self.head_dim, self.chunk_tokens = layers, heads, head_dim, chunk_tokens
            self.seconds = 0.0
            self._lock = threading.Lock()

        def _view(self, memory_obj, start: int, end: int):
            t = memory_obj.tensor
            want = (2, self.layers, end - start, self.heads * self.head_dim)
            assert tuple(t.shape) == want, f"memory object shape {tuple(t.shape)}, expected {want}"
            return t.view(2, self.layers, end - start, self.heads, self.head_dim)

        def from_gpu(self, memory_obj, start: int, end: int, **kwargs):
            started = time.perf_counter()
            dst = self._view(memory_obj, start, end)
            for layer, (k, v) in enumerate(kwargs["kv"]):
                dst[0, layer].copy_(k[0, :, start:end].transpose(0, 1))
                dst[1, layer].copy_(v[0, :, start:end].transpose(0, 1))
            with self._lock:
                self.seconds += time.perf_counter() - started

        def to_gpu(self, memory_obj, start: int, end: int, **kwargs):
            started = time.perf_counter()
            src = self._view(memory_obj, start, end)
            for layer, (k, v) in enumerate(kwargs["kv"]):
                k[0, :, start:end].copy_(src[0, layer].transpose(0, 1))
                v[0, :, start:end].copy_(src[1, layer].transpose(0, 1))
            with self._lock:
                self.seconds += time.perf_counter() - started

        def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
            for obj, s, e in zip(memory_objs, starts, ends):
                self.from_gpu(obj, s, e, **kwargs)

        def batched_to_gpu(self, memory_objs, starts, ends, **kwargs):
            for obj, s, e in zip(memory_objs, starts, ends):
                self.to_gpu(obj, s, e, **kwargs)

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([2, self.layers, num_tokens, self.heads * self.head_dim])

    return CopyConnector


class WriteCounter:
    """Counts LMCache's completed chunk writes: wraps the disk backend's
    ``async_save_bytes_to_disk`` (the function its disk worker runs per chunk)
    so the benchmark waits on an event, not a poll."""

    def __init__(self, backend):
        self._cond = threading.Condition()
        self.done = 0
        self.errors: list[BaseException] = []
        inner = backend.async_save_bytes_to_disk

        def counted(*args, **kwargs):
            try:
                return inner(*args, **kwargs)
            except BaseException as exc:
                with self._cond:
                    self.errors.append(exc)
                raise
            finally:
                with self._cond:
                    self.done += 1
                    self._cond.notify_all()
        backend.async_save_bytes_to_disk = counted

    def wait_done(self, count: int, timeout_s: float) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self.done >= count, timeout=timeout_s):
                raise TimeoutError(f"LMCache wrote {self.done} of {count} chunks in {timeout_s} s")
        if self.errors:
            raise RuntimeError(f"LMCache disk writes failed: {self.errors[0]!r}")


def cpu_s() -> float:
    return time.process_time()


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def run(cfg: dict) -> dict:
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    import lmcache

    layers, heads, head_dim, chunk = cfg["layers"], cfg["heads"], cfg["head_dim"], cfg["block_tokens"]
    requests, req_tokens, seed = cfg["requests"], cfg["request_tokens"], cfg["seed"]
    disk_dir = Path(cfg["dir"])
    disk_dir.mkdir(parents=True, exist_ok=True)
    chunk_bytes = 2 * layers * chunk * heads * head_dim * 2
    total_bytes = requests * req_tokens // chunk * chunk_bytes
    chunks = total_bytes // chunk_bytes
    # the CPU pool holds every chunk of a request until its write completes, then the retrieve's
    pool_gb = (req_tokens // chunk * chunk_bytes) * 1.5 / 1e9 + 0.25
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=chunk, local_cpu=False, max_local_cpu_size=pool_gb, local_disk=str(disk_dir),
        max_local_disk_size=total_bytes * 1.5 / 1e9 + 0.5, save_unfull_chunk=False,
        extra_config={"use_odirect": True, "disk_io_threads": cfg.get("io_threads", 4)})
    metadata = LMCacheMetadata(model_name="llama-3-8b-bench", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.float16, kv_shape=(layers, 2, chunk, heads, head_dim),
                               chunk_size=chunk)
    connector = copy_connector_class()(layers, heads, head_dim, chunk)
    engine = LMCacheEngineBuilder.get_or_create("kvtier-bench", config, metadata, connector,
                                                lambda *a, **k: None, lambda *a, **k: None)
    engine.post_init()
    try:
        backend = engine.storage_manager.storage_backends["LocalDiskBackend"]
        assert backend.use_odirect, "LocalDiskBackend did not take use_odirect"
        writes = WriteCounter(backend)
        reqs = [make_request(seed, i, req_tokens, layers, heads, head_dim) for i in range(requests)]
        progress(f"store {requests} x {req_tokens} tokens ({total_bytes / GiB:.2f} GiB) into {disk_dir}")

        # --- store -----------------------------------------------------------
        c0, t0 = cpu_s(), time.perf_counter()
        for tokens, kv in reqs:
            engine.store(tokens, kv=kv)
        t_call = time.perf_counter() - t0
        writes.wait_done(chunks, WRITE_WAIT_S_MAX)
        store_s, store_cpu = time.perf_counter() - t0, cpu_s() - c0
        files = sorted(disk_dir.glob("*.pt"))
        assert len(files) == chunks, f"{len(files)} chunk files, expected {chunks}"
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        dfd = os.open(disk_dir, os.O_RDONLY)
        os.fsync(dfd)
        os.close(dfd)
        durable_s, durable_cpu = time.perf_counter() - t0, cpu_s() - c0
        store_connector_s = connector.seconds
        progress(f"stored: {total_bytes / store_s / 1e9:.2f} GB/s ({durable_s:.2f} s with fsync)")

        # --- lookup ----------------------------------------------------------
        tokens0 = reqs[0][0]
        assert engine.lookup(tokens0) == req_tokens, "lookup after store does not find the request"
        lat = []
        for _ in range(LOOKUP_ROUNDS):
            s = time.perf_counter()
            engine.lookup(tokens0)
            lat.append(time.perf_counter() - s)

        # --- retrieve --------------------------------------------------------
        drop_page_cache()
        progress("page cache dropped; retrieve")
        outs = [[(torch.zeros_like(k), torch.zeros_like(v)) for k, v in kv] for _, kv in reqs]
        connector.seconds = 0.0
        c0, t0 = cpu_s(), time.perf_counter()
        hit_tokens = 0
        for (tokens, _), out in zip(reqs, outs):
            hit_tokens += int(engine.retrieve(tokens, kv=out).sum())
        load_s, load_cpu = time.perf_counter() - t0, cpu_s() - c0
        load_connector_s = connector.seconds
        assert hit_tokens == requests * req_tokens, f"retrieved {hit_tokens} of {requests * req_tokens} tokens"
        for (_, kv), out in zip(reqs, outs):
            for (k, v), (k2, v2) in zip(kv, out):
                assert torch.equal(k.view(torch.int16), k2.view(torch.int16)) and \
                    torch.equal(v.view(torch.int16), v2.view(torch.int16)), "retrieved bytes differ"
        progress(f"retrieved and checked: {total_bytes / load_s / 1e9:.2f} GB/s")
    finally:
        LMCacheEngineBuilder.destroy("kvtier-bench")
    lat_us = sorted(x * 1e6 for x in lat)
    return {
        "lmcache_version": getattr(lmcache, "__version__", None) or _dist_version(),
        "torch_version": torch.__version__,
        "backend": "LocalDiskBackend", "use_odirect": True, "local_cpu": False,
        "io_threads": cfg.get("io_threads", 4), "chunk_files": chunks, "bytes": total_bytes,
        "store_bytes_per_s": total_bytes / store_s,
        "store_call_s": t_call,
        "store_durable_bytes_per_s": total_bytes / durable_s,
        "load_bytes_per_s": total_bytes / load_s,
        "cpu_s_per_gib": {"store": store_cpu * GiB / total_bytes, "store_durable": durable_cpu * GiB / total_bytes,
                          "load": load_cpu * GiB / total_bytes},
        "connector_s": {"store": store_connector_s, "load": load_connector_s},
        "connector_bytes_per_s": {"store": total_bytes / store_connector_s if store_connector_s else None,
                                  "load": total_bytes / load_connector_s if load_connector_s else None},
        "lookup_us": {"p50": statistics.median(lat_us), "p99": lat_us[int(0.99 * (len(lat_us) - 1))],
                      "rounds": LOOKUP_ROUNDS, "blocks": req_tokens // chunk},
        "bytes_checked": True,
    }


def _dist_version() -> str | None:
    from importlib.metadata import version
    return version("lmcache")


def main() -> int:
    cfg = json.loads(sys.argv[1])
    # LMCache logs (and may print) to stdout: everything but the result goes to stderr
    result_fd = os.dup(1)
    os.dup2(2, 1)
    result = run(cfg)
    sys.stdout.flush()
    os.write(result_fd, (json.dumps(result) + "\n").encode())
    os.close(result_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
