"""A pipelined load into HBM, for perf/gpu_check.py: a real kvtierd on files in a temp dir,
the Llama-3-8B layout (32 layers, 8 KV heads, head dim 128, fp16, 256-token blocks) in
4 layer groups, 8192-token requests stored from GPU tensors, then loaded back into HBM:

- ``load()`` (the whole prefix before the model could start) and ``start_load()``
  (time to layer 0 ready, and to every layer), bytes compared with what was stored;
- the reference of the same run: a pinned host-to-device copy of the same bytes
  (``tensor.to("cuda", non_blocking=True)`` from page-locked memory), and the TCP
  load into host memory (``device="cpu"``);
- where NIXL is installed, the same store and load through ``transport="nixl"``.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

READY_TIMEOUT_S = 120  # a 4 GiB store is formatted and its space reserved before it serves
LAYOUT = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16", block_tokens=256, layer_groups=4)


def _start_daemon(work: Path, pythonpath: Path | None, device_gib: int) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = f"{pythonpath}{os.pathsep}{env.get('PYTHONPATH', '')}"
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.daemon.main", "--data-dir", str(work),
                             "--device-size", f"{device_gib}g", "--listen", "127.0.0.1:0", "--admin", "none"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + READY_TIMEOUT_S
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        match = re.search(r"kvtierd ready data=(\S+)", line)
        if match:
            return proc, match.group(1)
    proc.kill()
    raise RuntimeError("kvtierd did not start:\n" + "".join(lines[-20:]))


def _through_nixl(kvcache, namespace, address: str, tokens, kv, nbytes: int) -> dict:
    """The same store from HBM and load into HBM through the nixl transport (the daemon READs the
    store's blocks, WRITEs the load's), where NIXL is installed; byte-compared."""
    import torch

    if importlib.util.find_spec("nixl_cu12") is None:
        return {"nixl": "skipped: NIXL is not installed (pip install 'kvtier[nixl]')"}
    with kvcache(namespace, address, hot_pool_bytes=0, device="cuda", transport="nixl") as cache:
        if not cache.wait_nixl_ready(30):
            return {"nixl": "skipped: the nixl transport was not ready within 30 s"}
        t0 = time.perf_counter()
        cache.store(tokens, kv, durable=True)
        out = {"store_from_hbm_nixl_GBps": nbytes / (time.perf_counter() - t0) / 1e9}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        layers = cache.load(tokens).layers
        torch.cuda.synchronize()
        out["load_nixl_GBps"] = nbytes / (time.perf_counter() - t0) / 1e9
        out["load_nixl_bytes_equal"] = all(torch.equal(a, k) and torch.equal(b, v)
                                           for (a, b), (k, v) in zip(layers, kv))
        (daemon,) = cache._warm.daemons
        stats = daemon.nixl.ready().statistics()
        out.update(nixl_put_blocks=stats.put_blocks, nixl_get_blocks=stats.blocks, nixl_transport=stats.transport)
    return out


def pipelined_load(quick: bool, pythonpath: Path | None) -> dict:
    import torch

    from kvtier.client.kvcache import KVCache
    from kvtier.common.keys import KVLayout, Namespace

    tokens_per_request = 2048 if quick else 8192
    layout = KVLayout(**LAYOUT)
    namespace = Namespace("gpu-check/llama-3-8b-layout", layout)
    work = Path(tempfile.mkdtemp(prefix="kvtier-gpu-load-", dir="/var/tmp" if Path("/var/tmp").is_dir() else None))
    proc, address = _start_daemon(work, pythonpath, device_gib=1 if quick else 2)
    try:
        gen = torch.Generator(device="cuda").manual_seed(1)
        kv = [tuple(torch.randn(1, 8, tokens_per_request, 128, device="cuda", dtype=torch.float16, generator=gen)
                    for _ in range(2)) for _ in range(32)]
        tokens = list(range(tokens_per_request))
        nbytes = tokens_per_request * layout.block_raw_bytes // layout.block_tokens
        report: dict = {"layout": LAYOUT, "tokens": tokens_per_request, "bytes": nbytes}
        with KVCache(namespace, address, hot_pool_bytes=0, device="cuda", transport="tcp") as cache:
            t0 = time.perf_counter()
            cache.store(tokens, kv, durable=True)
            report["store_from_hbm_GBps"] = nbytes / (time.perf_counter() - t0) / 1e9
            for name in ("load", "start_load"):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if name == "load":
                    layers = cache.load(tokens).layers
                    torch.cuda.synchronize()
                    report["load_GBps"] = nbytes / (time.perf_counter() - t0) / 1e9
                else:
                    streaming = cache.start_load(tokens)
                    streaming.wait_layer(0)
                    first = time.perf_counter() - t0
                    streaming.wait()
                    torch.cuda.synchronize()
                    total = time.perf_counter() - t0
                    layers = streaming.layers
                    report.update(start_load_first_layer_ms=first * 1e3, start_load_ms=total * 1e3,
                                  start_load_GBps=nbytes / total / 1e9, first_layer_fraction=first / total)
                report[f"{name}_bytes_equal"] = all(torch.equal(a, k) and torch.equal(b, v)
                                                     for (a, b), (k, v) in zip(layers, kv))
        report.update(_through_nixl(KVCache, Namespace("gpu-check/llama-3-8b-layout-nixl", layout), address,
                                    tokens, kv, nbytes))
        with KVCache(namespace, address, hot_pool_bytes=0, device="cpu", transport="tcp") as host_cache:
            t0 = time.perf_counter()
            host_cache.load(tokens)
            report["load_into_host_GBps"] = nbytes / (time.perf_counter() - t0) / 1e9
        pinned = torch.empty(nbytes // 2, dtype=torch.float16).pin_memory()
        pinned.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pinned.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        report["pinned_h2d_GBps"] = nbytes / (time.perf_counter() - t0) / 1e9
        report["load_vs_pinned_h2d"] = report["load_GBps"] / report["pinned_h2d_GBps"]
        report["start_load_vs_pinned_h2d"] = report["start_load_GBps"] / report["pinned_h2d_GBps"]
        print("pipelined load into HBM: " + ", ".join(f"{k} {v:.3g}" for k, v in report.items()
                                                       if isinstance(v, float)), flush=True)
        return report
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(work, ignore_errors=True)
