"""CUDA codec and paged kernels against the CPU reference, with and without a GPU.

Without a GPU the CUDA C of cuda_sources.py is built as host C++ (g++): the CUDA built-ins
get host stand-ins that behave as a GPU does where it matters (a NaN product is the canonical
0x7FFFFFFF, the fp16 conversions give canonical NaNs), and every kernel runs one "thread" per
call. The decoders are then fed every byte value under a set of scales, NaN, infinite, zero,
subnormal and negative (a payload from elsewhere) included, and must write the bytes the CPU
decoders write. The paged launcher is run against stand-ins for CuPy: its pointer table must
stay referenced until an event recorded after the launch has passed.

Under the ``gpu`` marker the same payloads go through the real kernels, and many paged
launches are queued behind a stalled stream while other work reuses device memory.
"""
from __future__ import annotations

import ctypes
import gc
import shutil
import subprocess
import weakref

import ml_dtypes
import numpy as np
import pytest
import torch

from cuda_reason import cuda_skip_reason
from kvtier.kernels import get_codec, paged, quant_numba
from kvtier.kernels.cuda_sources import F16_CVT_PTX, codec_kernel_names, codec_source
from kvtier.kernels.launch_holds import HoldStatistics, LaunchHolds
from kvtier.kernels.quant_ref import num_groups

from test_codec_review_extremes import host_decode as decode_on_host

BF16 = np.dtype(ml_dtypes.bfloat16)
FP16 = np.dtype(np.float16)
FP32 = np.dtype(np.float32)
DT_CODES = {FP16: "f16", BF16: "bf16", FP32: "f32"}
KINDS = ["int8", "fp8", "int4"]
CODES = 256  # every byte value a payload's value section can hold



def _f16(v: float) -> int:
    return int(np.float16(v).view(np.uint16))


def _f32(v: float) -> int:
    return int(np.float32(v).view(np.uint32))


# scale bit patterns, one channel each; fp16 scales for fp16 data, fp32 scales for bf16 / fp32 data
F16_SCALE_BITS = [
    _f16(1.0), _f16(1.0 / 448),
    _f16(146.0), _f16(146.25),  # 448 * s = 65408 fits fp16; 65520 is past 65504 (clamped)
    _f16(65504.0), 0x0001,  # the largest fp16, the smallest subnormal
    _f16(0.0), _f16(-0.0), _f16(-2.0),
    0x7C00, 0xFC00,  # +inf, -inf
    0x7E00, 0x7C01, 0xFD55,  # quiet NaN, signalling NaN, negative NaN with a payload
]
F32_SCALE_BITS = [
    _f32(1.0), _f32(1.0 / 448),
    _f32(2.0 ** -23), _f32(2.0 ** -126), 0x00000001,  # 2**-126 is the floor; 2**-149 is below it
    _f32(7.5e35), _f32(7.58e35), _f32(7.6e35),  # 448 * s: within bf16, past bf16's max, past fp32's max
    0x7F7FFFFF, _f32(0.0), _f32(-0.0), _f32(-1.5),  # the largest fp32
    0x7F800000, 0xFF800000,  # +inf, -inf
    0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x7FFFFFFF,  # quiet, signalling, negative and all-ones NaNs
]
assert len(F16_SCALE_BITS) % 2 == 0 and len(F32_SCALE_BITS) % 2 == 0  # int4 packs channel pairs

# ---- the CUDA C built for the host ----

HOST_PRELUDE = r"""
#include <algorithm>
#include <cmath>
#include <cstring>
using std::max;
using std::min;
#define __device__
#define __forceinline__ inline
#define __global__
struct HostDim3 { unsigned int x; };
static HostDim3 blockIdx, blockDim, threadIdx;
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
#ifdef KV_GPU_NAN
#define KV_NAN_RESULT(v) ((v) != (v) ? __uint_as_float(0x7FFFFFFFu) : (v))
#else
#define KV_NAN_RESULT(v) (v)
#endif
/* IEEE RNE (the host's SSE multiply, not contracted); KV_GPU_NAN: a NaN product is canonical, as on a GPU */
static inline float __fmul_rn(float a, float b) { float p = a * b; return KV_NAN_RESULT(p); }
"""

HOST_F16_CVT = r"""
static inline float f16_to_f32_cvt(unsigned short h) {
    _Float16 v; std::memcpy(&v, &h, 2); float f = (float)v; return KV_NAN_RESULT(f);
}
static inline unsigned short f32_to_f16_cvt(float f) {
#ifdef KV_GPU_NAN
    if (f != f) return 0x7FFFu;
#endif
    _Float16 v = (_Float16)f; unsigned short h; std::memcpy(&h, &v, 2); return h;
}
"""

HOST_DRIVER = r"""
/* every kernel takes (a, b, c, rows, tokens, dim, group): one call per thread index, in order */
template <typename A, typename B, typename C>
static void drive(void (*kernel)(A, B, C, long long, int, int, int), void* a, void* b, void* c,
                  long long rows, int tokens, int dim, int group, long long threads) {
    blockDim.x = 1; threadIdx.x = 0;
    for (long long i = 0; i < threads; ++i) {
        blockIdx.x = (unsigned int)i;
        kernel((A)a, (B)b, (C)c, rows, tokens, dim, group);
    }
}
"""

NAN_MODELS = {"gpu_nan": ["-DKV_GPU_NAN"], "host_nan": []}


def host_source() -> str:
    src = codec_source()
    assert F16_CVT_PTX in src
    body = src.replace(F16_CVT_PTX, HOST_F16_CVT)
    assert "asm(" not in body, "PTX outside the fp16 fragment: the host build cannot stand in for it"
    drivers = [f'extern "C" void drive_{n}(void* a, void* b, void* c, long long rows, int tokens, int dim, '
               f'int group, long long threads) {{ drive({n}, a, b, c, rows, tokens, dim, group, threads); }}'
               for n in codec_kernel_names()]
    return "\n".join([HOST_PRELUDE, body, HOST_DRIVER, *drivers])


@pytest.fixture(scope="module", params=sorted(NAN_MODELS))
def host_kernels(request, tmp_path_factory):
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++ to build the CUDA C source for the host")
    d = tmp_path_factory.mktemp(f"host_kernels_{request.param}")
    (d / "kernels.cpp").write_text(host_source())
    cmd = [cxx, "-std=c++17", "-O1", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC",
           *NAN_MODELS[request.param], "-o", str(d / "kernels.so"), str(d / "kernels.cpp")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    lib = ctypes.CDLL(str(d / "kernels.so"))
    for n in codec_kernel_names():
        fn = getattr(lib, f"drive_{n}")
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_longlong, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                               ctypes.c_longlong]
        fn.restype = None
    return lib


def run_host(lib, name, a, b, c, rows, tokens, dim, group, threads) -> None:
    getattr(lib, f"drive_{name}")(a.ctypes.data, b.ctypes.data, c.ctypes.data, rows, tokens, dim, group, threads)


def host_decode(lib, kind: str, payload: bytes, dtype: np.dtype) -> np.ndarray:
    lay = get_codec(kind).parse(payload)
    scales, values = lay.views(payload)
    out = np.empty((lay.b, lay.t, lay.d), dtype)
    per_thread = 2 if kind == "int4" else 1
    run_host(lib, f"kv_dequant_{kind}_{DT_CODES[dtype]}", values, scales, out, lay.b, lay.t, lay.d,
             lay.header.group_tokens, lay.b * lay.t * (lay.d // per_thread))
    return out.reshape(lay.header.shape)


def host_encode_sections(lib, kind: str, x: np.ndarray, group: int) -> tuple[bytes, bytes]:
    """(scale bytes, value bytes) the quantize kernel writes for x [B, T, D]."""
    lay = get_codec(kind, group_tokens=group).layout(x.shape, x.dtype)
    scales = np.zeros(lay.scale_bytes, np.uint8)
    values = np.zeros(lay.value_bytes, np.uint8)
    per_thread = 2 if kind == "int4" else 1
    run_host(lib, f"kv_quant_{kind}_{DT_CODES[x.dtype]}", np.ascontiguousarray(x), scales, values, lay.b, lay.t,
             lay.d, group, lay.b * num_groups(lay.t, group) * (lay.d // per_thread))
    return scales.tobytes(), values.tobytes()


# ---- payloads ----

def scale_bits_for(dtype: np.dtype) -> list[int]:
    return F16_SCALE_BITS if dtype == FP16 else F32_SCALE_BITS


def every_code_payload(kind: str, dtype: np.dtype) -> bytes:
    """[256 tokens, one channel per scale of scale_bits_for(dtype)], one group: token t holds byte t
    in every channel (for int4 the byte holds channels 2p and 2p+1)."""
    bits = scale_bits_for(dtype)
    codec = get_codec(kind, group_tokens=CODES)
    data = bytearray(codec.encode(np.zeros((CODES, len(bits)), dtype)))
    scales, q = codec.parse(data).views(data)
    uint = np.uint16 if scales.dtype.itemsize == 2 else np.uint32
    scales.view(uint)[...] = np.array(bits, uint)
    q.view(np.uint8)[0] = np.arange(CODES, dtype=np.uint8)[:, None]
    return bytes(data)


def cpu_decode(kind: str, payload: bytes, dtype: np.dtype, fused: bool) -> np.ndarray:
    codec = get_codec(kind)
    return decode_on_host(fused, codec, payload, np.empty(codec.parse(payload).header.shape, dtype))


def cpu_backends() -> list[bool]:
    return [False, True] if quant_numba.AVAILABLE else [False]


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def nan_fp16_scale_channels(dtype: np.dtype) -> np.ndarray:
    """The channels of every_code_payload with a NaN fp16 scale (none for fp32 scales)."""
    if dtype != FP16:
        return np.zeros(len(F32_SCALE_BITS), bool)
    return np.isnan(np.array(F16_SCALE_BITS, np.uint16).view(FP16))


def assert_decoded_alike(got: np.ndarray, want: np.ndarray, dtype: np.dtype, what: str) -> None:
    """Bit for bit, except on the channels whose fp16 scale is NaN, which must decode to NaN: the CPU
    reference widens a NaN fp16 scale through torch, whose vector and scalar paths give it different
    bits (and sign), so no bits are defined there. fp32 scales, NaN ones included, are used as stored."""
    nan_ch = nan_fp16_scale_channels(dtype)
    assert np.isnan(got[:, nan_ch].astype(np.float32)).all(), f"{what}: a NaN scale decoded to a number"
    assert np.isnan(want[:, nan_ch].astype(np.float32)).all()
    assert_same_bits(got[:, ~nan_ch], want[:, ~nan_ch], what)


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    g, w = bits(np.ascontiguousarray(got)), bits(np.ascontiguousarray(want))
    bad = np.argwhere(g != w)
    assert bad.size == 0, (f"{what}: {len(bad)} values differ; first at {tuple(bad[0])}: "
                           f"{int(g[tuple(bad[0])]):#x} != {int(w[tuple(bad[0])]):#x}")


def outlier_block(shape: tuple[int, ...], dtype: np.dtype, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape, dtype=np.float32)
    x[..., rng.choice(shape[-1], 2, replace=False)] *= 20
    x[..., 0, 1] = 0.0  # a zero channel start; with group 1 a zero scale
    return x.astype(dtype)


# ---- CPU: the kernel source built for the host ----

@pytest.mark.parametrize("dtype", [FP16, BF16, FP32], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_host_built_decoder_matches_cpu_for_every_byte(host_kernels, kind, dtype):
    payload = every_code_payload(kind, dtype)
    got = host_decode(host_kernels, kind, payload, dtype)
    for fused in cpu_backends():
        assert_decoded_alike(got, cpu_decode(kind, payload, dtype, fused), dtype, f"{kind} {dtype} fused={fused}")


@pytest.mark.parametrize("dtype", [FP16, BF16, FP32], ids=str)
def test_host_built_fp8_decoder_gives_nan_for_the_nan_codes(host_kernels, dtype):
    payload = every_code_payload("fp8", dtype)
    got = host_decode(host_kernels, "fp8", payload, dtype).astype(np.float32)
    one = scale_bits_for(dtype).index(0x3C00 if dtype == FP16 else 0x3F800000)  # the channel with scale 1.0
    assert np.isnan(got[0x7F]).all() and np.isnan(got[0xFF]).all()
    assert not np.signbit(got[0x7F]).any() and np.signbit(got[0xFF]).all()
    assert got[0x7E, one] == 448.0 and got[0xFE, one] == -448.0  # the largest finite codes
    assert not np.isnan(np.delete(got[:, one], [0x7F, 0xFF])).any()


@pytest.mark.parametrize("dtype", [FP16, BF16, FP32], ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape,group", [((3, 37, 16), 16), ((2, 5, 8), 1), ((1, 64, 6), 64)], ids=str)
def test_host_built_encoder_matches_cpu_payload(host_kernels, kind, dtype, shape, group):
    x = outlier_block(shape, dtype, seed=shape[1])
    payload = get_codec(kind, group_tokens=group).encode(x)
    lay = get_codec(kind, group_tokens=group).layout(x.shape, x.dtype)
    scales, values = host_encode_sections(host_kernels, kind, x, group)
    start = lay.header.size_bytes
    assert scales == payload[start: start + lay.scale_bytes]
    assert values == payload[start + lay.scale_bytes:]


def test_fp16_fragment_is_the_only_ptx():
    src = codec_source()
    assert src.count("asm(") == F16_CVT_PTX.count("asm(") == 2
    for dt in DT_CODES.values():
        assert f"clamp_{dt}(mul_rn_hostnan(" in src and f"clamp_{dt}(__fmul_rn(" not in src


# ---- CPU: launch holds ----

class FakeEvent:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name, self.done = log, name, False
        self.recorded_on = None

    def record(self, stream) -> None:
        self.log.append(("record", self.name))
        self.recorded_on = stream

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))
        self.done = True


class Payload:
    """A weakly referenceable stand-in for a device array."""


def test_holds_are_released_in_launch_order_once_their_event_passed():
    log: list = []
    holds = LaunchHolds(limit=8)
    events = [FakeEvent(log, f"e{i}") for i in range(3)]
    objs = [Payload() for _ in events]
    refs = [weakref.ref(o) for o in objs]
    for e, o in zip(events, objs):
        holds.hold(e, (o,))
    del objs, o
    gc.collect()
    assert [r() is not None for r in refs] == [True, True, True]
    events[1].done = True  # passed, but behind e0: kept until e0 has passed
    assert holds.release_passed() == 0
    events[0].done = True
    assert holds.release_passed() == 2
    gc.collect()
    assert [r() is not None for r in refs] == [False, False, True]
    assert holds.statistics() == HoldStatistics(held=1, released_total=2, waited_total=0)
    assert log == []  # nothing waited


def test_holds_past_the_limit_wait_for_the_oldest():
    log: list = []
    holds = LaunchHolds(limit=2)
    events = [FakeEvent(log, f"e{i}") for i in range(4)]
    for e in events:
        holds.hold(e, (Payload(),))
    assert log == [("synchronize", "e0"), ("synchronize", "e1")]
    assert holds.statistics() == HoldStatistics(held=2, released_total=2, waited_total=2)
    events[2].done = events[3].done = True
    holds.hold(FakeEvent(log, "e4"), ())
    assert holds.statistics() == HoldStatistics(held=1, released_total=4, waited_total=2)


def test_holds_limit_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        LaunchHolds(limit=0)


# ---- CPU: the paged launcher's pointer table outlives the launch ----

class FakeCupy:
    """Stand-ins for the CuPy calls of paged._run_cuda, logging their order."""

    def __init__(self) -> None:
        self.log: list = []
        self.tables: list = []
        self.launches: list = []
        self.events: list = []
        self.streams: list = []

    def asarray(self, host):
        table = np.array(host)  # a fresh object standing in for the device copy
        self.tables.append(weakref.ref(table))
        self.log.append("asarray")
        return table

    def from_dlpack(self, t):
        return Payload()

    def external_stream(self, ptr, device):
        fake = self

        class Stream:
            def __enter__(self):
                fake.log.append("enter stream")
                return self

            def __exit__(self, *exc):
                fake.log.append("exit stream")

        s = Stream()
        s.ptr, s.device = ptr, device
        self.streams.append(s)
        return s

    def device(self, index):
        class Device:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                pass

        return Device()

    def event(self, block=False, disable_timing=False):
        e = FakeEvent(self.log, f"e{len(self.events)}")
        self.events.append(e)
        return e

    def kernel(self, grid, block, args):
        self.log.append("launch")
        self.launches.append(args[0])


@pytest.fixture
def fake_cupy(monkeypatch):
    cupy = pytest.importorskip("cupy")
    fake = FakeCupy()
    monkeypatch.setattr(cupy, "asarray", fake.asarray)
    monkeypatch.setattr(cupy, "from_dlpack", fake.from_dlpack)
    monkeypatch.setattr(cupy.cuda, "ExternalStream", fake.external_stream)
    monkeypatch.setattr(cupy.cuda, "Device", fake.device)
    monkeypatch.setattr(cupy.cuda, "Event", fake.event)

    class Module:
        def get_function(self, name):
            return fake.kernel

    monkeypatch.setattr(paged, "_module", lambda: Module())
    monkeypatch.setattr(paged, "torch_stream_ptr", lambda t: 0xABC)
    monkeypatch.setattr(paged, "LAUNCH_HOLDS", LaunchHolds(limit=4))
    return fake


def _cpu_layers(n_layers: int = 3) -> list:
    shape = [2, 6, 4, 2, 8]  # FLASH_ATTN: kv, block, token, head, dim
    return [torch.arange(np.prod(shape), dtype=torch.float16).reshape(shape) + i for i in range(n_layers)]


@pytest.mark.parametrize("op", ["gather", "scatter"])
def test_paged_pointer_table_is_held_until_its_event_passed(fake_cupy, op):
    layers = _cpu_layers()
    geo = paged._geometry(layers, paged.FLASH_ATTN)
    ids = torch.tensor([4, 1], dtype=torch.int64)
    buf = torch.zeros(geo.buffer_shape(2), dtype=torch.float16)
    paged._run_cuda(op, layers, ids, buf, geo, paged.FLASH_ATTN)
    assert fake_cupy.log == ["enter stream", "asarray", "launch", ("record", "e0"), "exit stream"]
    assert fake_cupy.events[0].recorded_on is fake_cupy.streams[0]  # the stream the kernel went to
    assert fake_cupy.streams[0].ptr == 0xABC
    table = fake_cupy.launches.pop()
    assert table.tolist() == [t.data_ptr() for t in layers]
    del table
    gc.collect()
    assert fake_cupy.tables[0]() is not None, "the pointer table was let go while its kernel may be queued"
    fake_cupy.events[0].done = True
    assert paged.LAUNCH_HOLDS.release_passed() == 1
    gc.collect()
    assert fake_cupy.tables[0]() is None


def test_paged_launches_back_to_back_hold_each_table(fake_cupy):
    layers = _cpu_layers()
    geo = paged._geometry(layers, paged.FLASH_ATTN)
    buf = torch.zeros(geo.buffer_shape(1), dtype=torch.float16)
    for i in range(6):
        paged._run_cuda("gather", layers, torch.tensor([i]), buf, geo, paged.FLASH_ATTN)
    fake_cupy.launches.clear()
    gc.collect()
    # limit 4: the fifth and sixth launch waited for the first two events; the last four tables are held
    assert [r() is not None for r in fake_cupy.tables] == [False, False, True, True, True, True]
    waits = [entry for entry in fake_cupy.log if isinstance(entry, tuple) and entry[0] == "synchronize"]
    assert waits == [("synchronize", "e0"), ("synchronize", "e1")]


# ---- GPU ----

@pytest.mark.gpu
@pytest.mark.skipif(cuda_skip_reason() is not None, reason=str(cuda_skip_reason()))
@pytest.mark.parametrize("dtype", [FP16, BF16, FP32], ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("target", ["torch", "cupy"])
def test_cuda_decoder_matches_cpu_for_every_byte(kind, dtype, target):
    import cupy

    payload = every_code_payload(kind, dtype)
    codec = get_codec(kind)
    shape = codec.parse(payload).header.shape
    if target == "cupy":
        if dtype == BF16:
            pytest.skip("CuPy has no bf16 dtype: bf16 decodes go through torch tensors")
        out = cupy.empty(shape, dtype)
        codec.decode(payload, out)
        got = out.get()
    else:
        tdt = {FP16: torch.float16, BF16: torch.bfloat16, FP32: torch.float32}[dtype]
        out_t = torch.empty(shape, dtype=tdt, device="cuda")
        codec.decode(payload, out_t)
        torch.cuda.synchronize()
        raw = out_t.cpu().view(torch.int16 if dtype.itemsize == 2 else torch.int32).numpy()
        got = raw.view(np.uint16 if dtype.itemsize == 2 else np.uint32).view(dtype)
    for fused in cpu_backends():
        want = cpu_decode(kind, payload, dtype, fused)
        assert_decoded_alike(got, want, dtype, f"cuda {kind} {dtype} fused={fused}")


PAGED_LAUNCHES = 256  # gathers, each followed by a scatter, all queued behind one stall
STALL_CYCLES = 1_000_000_000  # torch.cuda._sleep: outlasts queuing every launch
PAGED_LAYERS = 4


@pytest.mark.gpu
@pytest.mark.skipif(cuda_skip_reason() is not None, reason=str(cuda_skip_reason()))
@pytest.mark.parametrize("allocator", ["default", "async"])
def test_cuda_paged_launches_queued_back_to_back(allocator):
    """Gathers and scatters queued behind a stall, alternating two layer sets (different pointer
    tables), while a second stream allocates tables of the same size holding the other set's
    pointers: a table let go too early would be overwritten and copy the wrong layers.

    The launcher is called directly with the ids already on the device: gather_blocks and
    scatter_blocks check their ids on the host, which waits for the stream.
    """
    import cupy

    if allocator == "async":
        try:
            pool = cupy.cuda.MemoryAsyncPool()
        except Exception as exc:  # noqa: BLE001 - an unsupported platform says why
            pytest.skip(f"no stream-ordered allocator here: {exc}")
        cupy.cuda.set_allocator(pool.malloc)
    try:
        layout = paged.FLASH_ATTN
        shape = [2, 16, 16, 4, 64]
        sets = [[torch.full(shape, float(10 * s + i), dtype=torch.float16, device="cuda")
                 for i in range(PAGED_LAYERS)] for s in range(2)]
        other_tables = [np.array([t.data_ptr() for t in sets[1 - s]], np.uint64) for s in range(2)]
        geo = paged._geometry(sets[0], layout)
        ids = [torch.tensor([n % 16, (n + 5) % 16], device="cuda") for n in range(PAGED_LAUNCHES)]
        back_ids = torch.tensor([3, 9], device="cuda")
        outs = [torch.empty(geo.buffer_shape(2), dtype=torch.float16, device="cuda") for _ in ids]
        backs = [[torch.zeros_like(t) for t in sets[0]] for _ in ids]
        main, side = torch.cuda.Stream(), cupy.cuda.Stream(non_blocking=True)
        torch.cuda.synchronize()
        with torch.cuda.stream(main):
            torch.cuda._sleep(STALL_CYCLES)
            for n in range(PAGED_LAUNCHES):
                paged._run_cuda("gather", sets[n % 2], ids[n], outs[n], geo, layout)
                paged._run_cuda("scatter", backs[n], back_ids, outs[n], geo, layout)
                with side:
                    junk = cupy.asarray(other_tables[n % 2])  # the size of the tables just made
                    del junk  # back to the allocator at once, for the next table to be handed
        main.synchronize()
        side.synchronize()
        for n in range(PAGED_LAUNCHES):
            s = n % 2
            want = torch.tensor([10 * s + i for i in range(PAGED_LAYERS)], dtype=torch.float16, device="cuda")
            assert torch.equal(outs[n][:, :, 0, 0, 0, 0], want.expand(2, PAGED_LAYERS)), f"gather {n}"
            for i, t in enumerate(backs[n]):
                assert torch.equal(t[:, [3, 9]], torch.full_like(t[:, [3, 9]], 10 * s + i)), f"scatter {n}"
        for s, layers in enumerate(sets):
            for i, t in enumerate(layers):
                assert torch.equal(t, torch.full_like(t, 10 * s + i)), "a scatter wrote into a source layer"
        paged.LAUNCH_HOLDS.release_passed()
        assert paged.LAUNCH_HOLDS.statistics().held == 0
    finally:
        if allocator == "async":
            cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
