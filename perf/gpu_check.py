"""GPU check for the codec and paged kernels: CuPy vs the NumPy reference, and speed vs copy.

    python3 perf/gpu_check.py [--quick] [--pytest]      (on a machine with a CUDA GPU)

1. compiles both kernel modules with CuPy (NVRTC) on the device;
2. correctness on fresh random data (new seeds each run), many shapes, fp16/bf16/fp32:
   payload bytes from the GPU == bytes from the NumPy reference, decoded bytes equal;
   paged gather/scatter == the torch CPU reference, byte for byte;
3. speed: each kernel timed with CUDA events against a device-to-device copy of the
   same input bytes in the same run (ratio = kernel input GB/s / copy GB/s; goal >= 0.7);
4. a pipelined load into HBM (perf/gpu_load.py): a real kvtierd, the Llama-3-8B layout in
   layer groups, ``KVCache(device="cuda").start_load`` timed to layer 0 and to the whole
   prefix, against a pinned host-to-device copy of the same bytes in the same run;
   ``--skip-load`` leaves it out;
5. NIXL (perf/gpu_nixl.py): a file read straight into HBM through the GDS_MT / GDS backend,
   and a NIXL WRITE over UCX into a CUDA tensor, each byte-compared and timed against the
   host path in the same run; each skips, saying why, without NIXL or GDS; ``--skip-nixl``;
6. ``--pytest``: also runs the gpu-marked test files.

Prints a table; writes gpu_check.json to $OUT when set (the device tool), else perf/out/.
Works without an installed kvtier: it maps the repository's kernels/ folder to
``kvtier.kernels`` itself. Every section records its own errors and the run goes on.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


PACKAGES = ("common", "wire", "client", "daemon", "kernels", "tools")


def bootstrap_kvtier() -> Path | None:
    """Make ``kvtier.*`` importable from the repository's folders when kvtier is not
    installed: a temp dir holding ``kvtier/<name>`` links (a namespace package), put
    first on sys.path and returned for subprocesses' PYTHONPATH."""
    try:
        import kvtier.kernels  # noqa: F401
        import kvtier.common  # noqa: F401
        return None
    except ImportError:
        pass
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="kvtier-src-"))
    (top / "kvtier").mkdir()
    for name in PACKAGES:
        (top / "kvtier" / name).symlink_to(ROOT / name)
    sys.path.insert(0, str(top))
    for name in [m for m in sys.modules if m == "kvtier" or m.startswith("kvtier.")]:
        del sys.modules[name]
    return top


def section(report: dict, name: str):
    """Decorator: run a section, keep its result or its traceback."""
    def wrap(fn):
        t0 = time.perf_counter()
        try:
            report[name] = fn()
        except Exception:  # noqa: BLE001 - recorded, the run goes on
            report.setdefault("errors", {})[name] = traceback.format_exc()
            print(f"[{name}] FAILED\n{report['errors'][name]}", flush=True)
        print(f"[{name}] {time.perf_counter() - t0:.1f} s", flush=True)
        return fn
    return wrap


def kv_host(shape, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape, dtype=np.float32)
    x[..., rng.choice(shape[-1], min(4, shape[-1]), replace=False)] *= 20
    return x


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer shapes, smaller timing block")
    ap.add_argument("--pytest", action="store_true", help="also run the gpu-marked test files")
    ap.add_argument("--skip-load", action="store_true", help="leave out the pipelined load into HBM")
    ap.add_argument("--skip-nixl", action="store_true", help="leave out the NIXL GDS read and transfer into HBM")
    args = ap.parse_args()
    src_path = bootstrap_kvtier()
    import cupy
    import numpy as np
    import torch

    if not cupy.cuda.is_available():
        print("no CUDA device (cupy.cuda.is_available() is False): nothing to check here", flush=True)
        return 2
    from kvtier.kernels import get_codec
    from kvtier.kernels import paged, quant_cupy
    from kvtier.kernels.codec import HOST_BACKEND

    HOST_BACKEND.fused = False  # compare with the NumPy reference itself (and skip numba's compile time)
    from kvtier.kernels.quant_ref import num_groups

    seed0 = int(time.time()) % 100_000  # fresh data each run; recorded for a rerun
    report: dict = {"seed0": seed0, "cupy": cupy.__version__, "torch": torch.__version__,
                    "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()}
    print(f"device {report['device']}, cupy {cupy.__version__}, torch {torch.__version__}, seed0 {seed0}", flush=True)
    tdtypes = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}

    @section(report, "compile")
    def _compile():
        t0 = time.perf_counter()
        quant_cupy._module().compile()
        paged._module().compile()
        return {"seconds": time.perf_counter() - t0}

    shapes = [(1, 1, 8), (3, 17, 64), (2, 2, 4, 64, 128), (5, 300, 96), (4, 2, 8, 256, 128), (2, 1000, 256)]
    if not args.quick:
        shapes += [(7, 33, 80), (32, 2, 2, 16, 128), (1, 4096, 128), (3, 2, 8, 129, 64)]

    @section(report, "codec_correctness")
    def _codecs():
        rows, seed = [], seed0
        for shape in shapes:
            for dname, tdt in tdtypes.items():
                for name in ("raw", "int8", "fp8", "int4"):
                    for g in ((None,) if name == "raw" else (16, 64)):
                        seed += 1
                        x = torch.from_numpy(kv_host(shape, seed)).to(tdt)
                        codec = get_codec(name, group_tokens=g)
                        ref = codec.encode(x)
                        got = codec.encode(x.cuda())
                        diff_bytes = sum(a != b for a, b in zip(ref, got)) + abs(len(ref) - len(got))
                        out_c = torch.empty_like(x)
                        codec.decode(ref, out_c)
                        out_g = torch.empty_like(x, device="cuda")
                        codec.decode(ref, out_g)
                        torch.cuda.synchronize()
                        dec = out_g.cpu()
                        dec_diff = int((dec.view(torch.uint8) != out_c.view(torch.uint8)).sum())
                        max_abs = float((dec.float() - out_c.float()).abs().max())
                        rows.append({"shape": shape, "dtype": dname, "codec": name, "group": g,
                                     "payload_bytes_differing": int(diff_bytes), "decoded_bytes_differing": dec_diff,
                                     "decoded_max_abs_diff": max_abs})
        bad = [r for r in rows if r["payload_bytes_differing"] or r["decoded_bytes_differing"]]
        print(f"codecs: {len(rows)} cases, {len(bad)} with differing bytes", flush=True)
        for r in bad[:20]:
            print("  DIFF", r, flush=True)
        return {"cases": len(rows), "differing": len(bad), "rows": rows}

    @section(report, "paged_correctness")
    def _paged():
        rows = []
        layouts = {"flash_attn": paged.FLASH_ATTN, "flashinfer": paged.FLASHINFER, "hnd": paged.HND}
        sizes = {"block": 40, "kv": 2, "token": 16, "head": 4, "dim": 128}
        gen = torch.Generator().manual_seed(seed0)
        for lname, layout in layouts.items():
            for dname, tdt in list(tdtypes.items()) + [("u8", torch.uint8)]:
                shape = [sizes[a] for a in layout.axes]
                layers = [torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8) for _ in range(5)]
                if tdt != torch.uint8:
                    elem = torch.empty((), dtype=tdt).element_size()
                    layers = [torch.randint(0, 256, shape[:-1] + [shape[-1] * elem], generator=gen,
                                            dtype=torch.uint8).view(tdt) for _ in range(5)]
                ids = torch.randperm(sizes["block"], generator=gen)[:13]
                ref = paged.gather_blocks(layers, ids, layout)
                got = paged.gather_blocks([t.cuda() for t in layers], ids, layout)
                fresh = [torch.zeros_like(t, device="cuda") for t in layers]
                paged.scatter_blocks(got, fresh, ids, layout)
                ref_fresh = [torch.zeros_like(t) for t in layers]
                paged.scatter_blocks(ref, ref_fresh, ids, layout)
                torch.cuda.synchronize()
                ok_g = torch.equal(got.cpu().view(torch.uint8), ref.view(torch.uint8))
                ok_s = all(torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8)) for a, b in zip(fresh, ref_fresh))
                rows.append({"layout": lname, "dtype": dname, "gather_equal": ok_g, "scatter_equal": ok_s,
                             "word_bytes": paged.word_bytes([t.cuda() for t in layers[:1]], got, layout)})
        bad = [r for r in rows if not (r["gather_equal"] and r["scatter_equal"])]
        print(f"paged: {len(rows)} cases, {len(bad)} differing", flush=True)
        return {"cases": len(rows), "differing": len(bad), "rows": rows}

    def time_ms(fn, iters):
        fn()
        cupy.cuda.Device().synchronize()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(iters):
            fn()
        stop.record()
        stop.synchronize()
        return cupy.cuda.get_elapsed_time(start, stop) / iters

    @section(report, "speed")
    def _speed():
        shape = (32, 2, 8, 256, 128) if args.quick else (32, 2, 8, 2048, 128)  # 33.5 MB / 268 MB of fp16
        iters = 10 if args.quick else 30
        b, t, d = shape[0] * shape[1] * shape[2], shape[3], shape[4]
        rows = []
        for dname in ("f16", "bf16"):
            x = torch.from_numpy(kv_host(shape, seed0)).to(tdtypes[dname]).cuda()
            xc = cupy.from_dlpack(x.view(torch.int16))
            nbytes = x.numel() * 2
            dst = cupy.empty_like(xc)
            copy_ms = time_ms(lambda: cupy.copyto(dst, xc), iters)
            copy_gbps = nbytes / copy_ms / 1e6
            rows.append({"kernel": f"d2d_copy_{dname}", "ms": copy_ms, "input_GBps": copy_gbps, "vs_copy": 1.0})
            for name in ("int8", "fp8", "int4"):
                codec = get_codec(name)
                lay = codec.layout(shape, np.dtype(quant_cupy.BF16 if dname == "bf16" else np.float16))
                g = lay.header.group_tokens
                dev = cupy.empty(lay.scale_bytes + lay.value_bytes, cupy.uint8)
                per = 2 if name == "int4" else 1
                qargs = (xc, dev[: lay.scale_bytes], dev[lay.scale_bytes:], np.int64(b), np.int32(t), np.int32(d),
                         np.int32(g))
                q_threads = b * num_groups(t, g) * (d // per)
                enc_ms = time_ms(lambda: quant_cupy._launch(f"kv_quant_{name}_{dname}", q_threads, qargs), iters)
                out = cupy.empty_like(xc)
                dargs = (dev[lay.scale_bytes:], dev[: lay.scale_bytes], out, np.int64(b), np.int32(t), np.int32(d),
                         np.int32(g))
                dec_ms = time_ms(lambda: quant_cupy._launch(f"kv_dequant_{name}_{dname}", b * t * d // per, dargs),
                                 iters)
                for op, ms in (("quant", enc_ms), ("dequant", dec_ms)):
                    gbps = nbytes / ms / 1e6
                    rows.append({"kernel": f"{op}_{name}_{dname}", "ms": ms, "input_GBps": gbps,
                                 "vs_copy": gbps / copy_gbps})
            t0 = time.perf_counter()
            get_codec("int8").encode(x)
            rows.append({"kernel": f"encode()_int8_{dname}_incl_D2H", "ms": (time.perf_counter() - t0) * 1e3,
                         "input_GBps": nbytes / (time.perf_counter() - t0) / 1e9, "vs_copy": None})
        # paged gather/scatter: 32 layers, FlashAttention layout, 256 of 1024 blocks of 16 tokens
        layers = [torch.randn(2, 1024, 16, 8, 128, dtype=torch.float16, device="cuda") for _ in range(32)]
        ids = torch.randperm(1024, device="cuda")[:256]
        buf = paged.gather_blocks(layers, ids, paged.FLASH_ATTN)
        nbytes = buf.numel() * 2
        src = cupy.from_dlpack(buf.view(torch.int16))
        dst = cupy.empty_like(src)
        copy_ms = time_ms(lambda: cupy.copyto(dst, src), iters)
        for op, fn in (("gather", lambda: paged.gather_blocks(layers, ids, paged.FLASH_ATTN, out=buf)),
                       ("scatter", lambda: paged.scatter_blocks(buf, layers, ids, paged.FLASH_ATTN))):
            ms = time_ms(fn, iters)
            rows.append({"kernel": f"paged_{op}_f16", "ms": ms, "input_GBps": nbytes / ms / 1e6,
                         "vs_copy": copy_ms / ms})
        print(f"\n{'kernel':34s} {'ms':>8s} {'GB/s':>9s} {'x copy':>7s}")
        for r in rows:
            vs = "" if r["vs_copy"] is None else f"{r['vs_copy']:7.3f}"
            print(f"{r['kernel']:34s} {r['ms']:8.3f} {r['input_GBps']:9.1f} {vs}")
        return {"shape": shape, "iters": iters, "rows": rows}

    if not args.skip_load:
        @section(report, "pipelined_load_hbm")
        def _load():
            sys.path.insert(0, str(ROOT / "perf"))
            from gpu_load import pipelined_load

            return pipelined_load(quick=args.quick, pythonpath=src_path)

    if not args.skip_nixl:
        sys.path.insert(0, str(ROOT / "perf"))
        import gpu_nixl

        section(report, "gds_read_hbm")(gpu_nixl.gds_read_hbm)
        section(report, "nixl_into_hbm")(gpu_nixl.nixl_into_hbm)

    if args.pytest:
        @section(report, "pytest")
        def _pytest():
            import pytest

            files = [str(ROOT / "tests" / f) for f in ("test_codecs_gpu.py", "test_paged.py", "test_kernels_compile.py")]
            return {"exit_code": int(pytest.main(["-q", "-p", "no:cacheprovider", "-o", "addopts=", *files]))}

    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "perf" / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {out_dir / 'gpu_check.json'}", flush=True)
    failed = bool(report.get("errors")) or any(report.get(k, {}).get("differing") for k in
                                               ("codec_correctness", "paged_correctness"))
    failed = failed or any(report.get(k, {}).get("equal") is False for k in ("gds_read_hbm", "nixl_into_hbm"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
