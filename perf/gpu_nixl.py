"""The NIXL checks of perf/gpu_check.py, for a GPU host (each skips, saying why, elsewhere).

1. ``gds_read_hbm``: a file read straight into HBM through NIXL's GDS_MT (or GDS) backend,
   byte-compared with the file, timed against ``preadv`` into pinned memory plus the
   host-to-device copy of the same bytes in the same run.
2. ``nixl_into_hbm``: a NIXL WRITE over UCX from a DRAM buffer of one agent into a CUDA
   tensor registered by another (the daemon-to-engine path with the engine's KV in HBM),
   byte-compared, timed against a pinned host-to-device copy.

    python3 perf/gpu_nixl.py          # or as sections of perf/gpu_check.py
"""
from __future__ import annotations

import json
import os
import tempfile
import time

FILE_BYTES = 256 << 20  # big enough to time, small enough for any GPU host's disk and HBM
ROUNDS = 3


def _skip(why: str) -> dict:
    print(f"  skipped: {why}", flush=True)
    return {"skipped": why}


def _prerequisites():
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, "no CUDA GPU visible to torch"
    try:
        from nixl_cu12 import _api
    except ImportError as exc:
        return None, f"NIXL is not installed ({exc}): pip install 'kvtier[nixl]'"
    return (torch, _api), ""


def _wait(agent, handle, timeout_s: float = 60.0) -> None:
    state = agent.transfer(handle)
    deadline = time.monotonic() + timeout_s
    while state == "PROC":
        if time.monotonic() > deadline:
            raise TimeoutError("NIXL transfer not done within 60 s")
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"NIXL transfer failed: {state}")


def gds_read_hbm() -> dict:
    ready, why = _prerequisites()
    if ready is None:
        return _skip(why)
    torch, api = ready
    agent = api.nixl_agent("kvtier-gds-check", api.nixl_agent_config(enable_prog_thread=False, backends=[]))
    backend, errors = None, []
    for name in ("GDS_MT", "GDS"):
        try:
            agent.create_backend(name)
            backend = name
            break
        except Exception as exc:  # no libcufile, no nvidia-fs: say so
            errors.append(f"{name}: {type(exc).__name__} {exc}")
    if backend is None:
        return _skip("no GDS backend: " + "; ".join(errors))
    data = os.urandom(FILE_BYTES)
    with tempfile.NamedTemporaryFile(dir=os.environ.get("KVTIER_GDS_DIR"), delete=False) as fh:
        fh.write(data)
        path = fh.name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        dst = torch.empty(FILE_BYTES, dtype=torch.uint8, device="cuda")
        agent.register_memory([(0, FILE_BYTES, fd, "")], "FILE", backends=[backend])
        agent.register_memory(dst, backends=[backend])
        local = agent.get_xfer_descs(dst)
        remote = agent.get_xfer_descs([(0, FILE_BYTES, fd)], "FILE")
        gds_s = []
        for _ in range(ROUNDS):
            dst.zero_()
            torch.cuda.synchronize()
            started = time.perf_counter()
            handle = agent.initialize_xfer("READ", local, remote, "kvtier-gds-check")
            _wait(agent, handle)
            handle.release()
            torch.cuda.synchronize()
            gds_s.append(time.perf_counter() - started)
        equal = bytes(dst.cpu().numpy()) == data
        pinned = torch.empty(FILE_BYTES, dtype=torch.uint8, pin_memory=True)
        host_s = []
        for _ in range(ROUNDS):
            started = time.perf_counter()
            os.preadv(fd, [memoryview(pinned.numpy())], 0)
            dst.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()
            host_s.append(time.perf_counter() - started)
        os.close(fd)
    finally:
        os.unlink(path)
    return {"backend": backend, "bytes": FILE_BYTES, "equal": equal, "gds_GBps": FILE_BYTES / min(gds_s) / 1e9,
            "preadv_plus_h2d_GBps": FILE_BYTES / min(host_s) / 1e9,
            "ratio": min(host_s) / min(gds_s)}


def nixl_into_hbm() -> dict:
    ready, why = _prerequisites()
    if ready is None:
        return _skip(why)
    torch, api = ready
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("UCX_TLS", "self,sm,tcp,cuda_copy,cuda_ipc")
    sync = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    daemon = api.nixl_agent("kvtier-check-daemon", api.nixl_agent_config(enable_prog_thread=False, sync_mode=sync))
    engine = api.nixl_agent("kvtier-check-engine", api.nixl_agent_config(enable_prog_thread=False, sync_mode=sync))
    src = torch.randint(0, 256, (FILE_BYTES,), dtype=torch.uint8)
    dst = torch.zeros(FILE_BYTES, dtype=torch.uint8, device="cuda")
    daemon.register_memory(src)
    engine.register_memory(dst)
    daemon.add_remote_agent(engine.get_agent_metadata())
    engine.add_remote_agent(daemon.get_agent_metadata())
    nixl_s = []
    for r in range(ROUNDS + 1):  # the first round connects: not counted
        torch.cuda.synchronize()
        started = time.perf_counter()
        handle = daemon.initialize_xfer("WRITE", daemon.get_xfer_descs(src), daemon.get_xfer_descs(dst),
                                        "kvtier-check-engine", b"done")
        state = daemon.transfer(handle)
        while state == "PROC":
            engine.get_new_notifs()  # the engine side progresses as the client transport does
            state = daemon.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL WRITE into HBM failed: {state}")
        handle.release()
        torch.cuda.synchronize()
        if r:
            nixl_s.append(time.perf_counter() - started)
    equal = torch.equal(dst.cpu(), src)
    pinned = src.pin_memory()
    h2d_s = []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        dst.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()
        h2d_s.append(time.perf_counter() - started)
    return {"bytes": FILE_BYTES, "equal": equal, "ucx_tls": os.environ["UCX_TLS"],
            "nixl_GBps": FILE_BYTES / min(nixl_s) / 1e9, "pinned_h2d_GBps": FILE_BYTES / min(h2d_s) / 1e9,
            "ratio": min(h2d_s) / min(nixl_s)}


if __name__ == "__main__":
    print(json.dumps({"gds_read_hbm": gds_read_hbm(), "nixl_into_hbm": nixl_into_hbm()}, indent=2))
    os._exit(0)  # UCX's teardown at exit can crash (docs/nixl.md)
