"""Direct reads of sealed blocks from the daemon's devices (the NVMe-oF path).

The daemon answers *where* a block lives (LOOKUP with locations: a logical
offset and length in its striped space, the block's write sequence, and
whether its region is sealed). A client that sees the same devices - the
same files or loop devices on one machine, NVMe-oF-attached namespaces in
production - reads the bytes itself::

    location (logical_offset, length)
        -> align to ALIGNMENT_BYTES         (O_DIRECT rules)
        -> StripeGeometry.map_range         -> [(device, device_offset, n), ...]
        -> preadv on each device's fd       (each device's contiguous stripe units in one
                                             preadv; READS_PER_DEVICE in flight per device)
        -> verify_block(key, seq, CRC)      -> the block, or None (a miss); each span as soon
                                             as its reads are in, while others are read
        -> with a landing: the raw payload copied into the load's output (LandedBlock)

A large batch is read window by window (WINDOW_BYTES_MAX) into pooled, pre-faulted
buffers, so a 1 GiB load reuses a few hundred MiB of landing memory instead of mapping
a fresh GiB.

Sealed regions are immutable, but the daemon may recycle a region between
our LOOKUP and our read. The header's key and sequence and the payload CRC
make that detectable: a block that does not validate is returned as
``None`` and the caller falls back to TCP. Wrong KV is never returned.

Backends: ``posix`` (O_DIRECT ``preadv``, always available on Linux, and what
``auto`` picks), ``nixl`` (NIXL's POSIX file backend, every piece of a batch in one
transfer, :mod:`.nixl_file_reads`; a failed NIXL read is read again with ``posix``) and ``kvikio`` (cuFile, on request; needs ``libcuda.so.1`` even
in compat mode). Both read into host buffers, where the CRC is checked: kvikio
gains nothing there, so ``auto`` does not choose it; reads straight into HBM
belong to NIXL's GDS backend.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from kvtier.common.aligned import ALIGNMENT_BYTES, align_down, align_up
from kvtier.common.blockformat import BlockFormatError, verify_block
from kvtier.common.stripe import StripeGeometry
from kvtier.common.views import views_past

from .output_buffers import OutputBuffers
from .scatter_plan import LandedBlock, Landing

COALESCE_GAP_BYTES_MAX = 256 * 1024  # reading a gap this small beats another syscall per block
READ_RANGE_BYTES_MAX = 16 * 1024 * 1024  # bounds one buffer; larger batches are split
DEVICES_MAX = 64  # one fd per device
READS_PER_DEVICE = 4  # reads in flight on each device (runs of up to RUN_BYTES_MAX)
RUN_BYTES_MAX = 4 << 20  # one preadv: a device's contiguous stripe units, up to this many bytes
IOV_ENTRIES_MAX = 512  # under Linux's IOV_MAX of 1024
SPAN_BUFFERS_BYTES_MAX = 512 << 20  # landing buffers kept for reuse (their pages stay faulted in)
WINDOW_BYTES_MAX = 256 << 20  # spans read at once: a larger batch goes window by window, reusing the buffers


@dataclass(frozen=True)
class DirectLocation:
    """Where a sealed block lives in the daemon's striped logical space."""

    logical_offset: int
    length: int
    seq: int


@dataclass(frozen=True)
class DirectReaderStatistics:
    backend: str
    o_direct: bool
    blocks_read: int
    bytes_read: int  # bytes moved from the devices, alignment padding included
    validation_failures: int  # blocks whose key, sequence or CRC did not match (recycled regions)
    io_errors: int
    nixl_fallbacks: int = 0  # batches the nixl backend failed to read and preadv read instead


def libcuda_available() -> bool:
    """True where the NVIDIA driver library loads (kvikio needs it, even in compat mode)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def kvikio_available() -> bool:
    if not libcuda_available():
        return False
    try:
        import kvikio  # noqa: F401
    except ImportError:
        return False
    return True


def choose_backend(requested: str = "auto") -> str:
    """``auto`` picks posix (see the module doc); an explicit
    request that cannot be met is a ValueError naming what is missing."""
    if requested not in ("auto", "posix", "kvikio", "nixl"):
        raise ValueError(f"direct read backend must be auto, posix, kvikio or nixl, got {requested!r}")
    if requested == "nixl" and importlib.util.find_spec("nixl_cu12") is None:
        raise ValueError("nixl backend requested but NIXL is not installed: pip install 'kvtier[nixl]'")
    if requested == "kvikio" and not kvikio_available():
        raise ValueError("kvikio backend requested but unavailable: needs libcuda.so.1 and the kvikio package")
    if requested == "auto":
        return "posix"
    return requested


@dataclass(frozen=True)
class _Span:
    """One aligned logical range read into one buffer, and the blocks in it."""

    start: int
    end: int
    members: tuple[int, ...]  # indices into the request


class DirectReader:
    """Reads and validates sealed blocks straight from the devices.

    ``device_map`` maps each daemon device id (``geometry.device_ids``) to a
    locally visible path. Every device of the stripe set must be mapped."""

    def __init__(self, geometry: StripeGeometry, device_map: Mapping[str, str], backend: str = "auto") -> None:
        missing = [d for d in geometry.device_ids if d not in device_map]
        if missing:
            raise ValueError(f"device_map has no local path for daemon device(s) {missing}")
        if len(geometry.device_ids) > DEVICES_MAX:
            raise ValueError(f"{len(geometry.device_ids)} devices is over the limit {DEVICES_MAX}")
        if geometry.stripe_size_bytes % ALIGNMENT_BYTES or geometry.data_offset_bytes % ALIGNMENT_BYTES:
            raise ValueError("stripe size and data offset must be multiples of "
                             f"{ALIGNMENT_BYTES} bytes for direct reads")
        self.geometry = geometry
        self.backend = choose_backend(backend)
        self._fds: list[int] = []
        self._paths = tuple(str(device_map[dev_id]) for dev_id in geometry.device_ids)
        self._o_direct = True
        try:
            for path in self._paths:
                self._fds.append(self._open(path))
        except BaseException:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(max_workers=READS_PER_DEVICE * len(self._fds), thread_name_prefix="kvtier-direct")
        self._span_buffers = OutputBuffers(SPAN_BUFFERS_BYTES_MAX)
        self._lock = threading.Lock()
        self._blocks = self._bytes = self._failures = self._io_errors = self._nixl_fallbacks = 0
        self._nixl_files = None
        if self.backend == "nixl":
            from .nixl_file_reads import NixlFileReads
            try:
                self._nixl_files = NixlFileReads(self._fds)
            except BaseException:
                self.close()
                raise
        self._cufiles: dict = {}  # kvikio handles, one per device path, opened on first use

    def _open(self, path: str) -> int:
        try:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != 22:  # EINVAL: the filesystem (tmpfs) refuses O_DIRECT
                raise OSError(exc.errno, f"cannot open daemon device {path} for direct reads: {exc.strerror}") from exc
        self._o_direct = False
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    # --- reading ---------------------------------------------------------
    def read_many(self, keys: Sequence[bytes], locations: Sequence[DirectLocation],
                  landing: Landing | None = None) -> list[memoryview | LandedBlock | None]:
        """The verified block for each (key, location), or ``None`` where the
        bytes found do not validate (the caller falls back to TCP). An I/O
        error on a device is raised: it is not a miss, it is a fault. Each span is
        verified as soon as its reads are in, while other spans are still being read.
        ``landing``: a raw block whose head is ``landing.head_nbytes`` is copied, once
        verified, into ``landing.views(i, 0)`` and comes back as a :class:`LandedBlock`."""
        if len(keys) != len(locations):
            raise ValueError(f"{len(keys)} keys but {len(locations)} locations")
        results: list = [None] * len(keys)
        spans = self._plan(locations)
        for window in _windows(spans, WINDOW_BYTES_MAX):
            self._read_window(window, keys, locations, landing, results)
        failures = results.count(None)  # every block lies in a span: None is one that did not verify
        with self._lock:
            self._blocks += len(keys) - failures
            self._bytes += sum(s.end - s.start for s in spans)
            self._failures += failures
        return results

    def _read_window(self, spans: list[_Span], keys, locations, landing: Landing | None, results: list) -> None:
        """Read, verify (and land) one window of spans. Its landing buffers are pooled, pre-faulted and
        page-aligned; they are free again for the next window once nothing refers to them (with a
        landing, as soon as this returns; else once the caller drops the blocks handed out)."""
        buffers = [memoryview(self._span_buffers.take(s.end - s.start))[:s.end - s.start] for s in spans]

        def check(k: int) -> None:  # span k's bytes are all in
            span, view = spans[k], buffers[k]
            for i in span.members:
                loc = locations[i]
                lo = loc.logical_offset - span.start
                block = view[lo:lo + loc.length]
                try:
                    verify_block(block, expected_key=keys[i], expected_seq=loc.seq)
                except BlockFormatError:
                    continue
                results[i] = block if landing is None else _land(block, landing, i)
        self._read_spans(spans, buffers, check)

    def _plan(self, locations: Sequence[DirectLocation]) -> list[_Span]:
        """Aligned spans covering the blocks, neighbours coalesced."""
        limit = self.geometry.logical_size_bytes
        order = sorted(range(len(locations)), key=lambda i: locations[i].logical_offset)
        spans: list[_Span] = []
        cur_start = cur_end = -1
        members: list[int] = []
        for i in order:
            loc = locations[i]
            if loc.length <= 0 or loc.logical_offset < 0 or loc.logical_offset + loc.length > limit:
                raise ValueError(f"block location {loc} is outside the daemon's {limit}-byte logical space")
            start = align_down(loc.logical_offset)
            end = align_up(loc.logical_offset + loc.length)
            if members and start - cur_end <= COALESCE_GAP_BYTES_MAX and max(end, cur_end) - cur_start <= READ_RANGE_BYTES_MAX:
                cur_end = max(cur_end, end)
                members.append(i)
                continue
            if members:
                spans.append(_Span(cur_start, cur_end, tuple(members)))
            cur_start, cur_end, members = start, end, [i]
        if members:
            spans.append(_Span(cur_start, cur_end, tuple(members)))
        return spans

    def _read_spans(self, spans: Sequence[_Span], buffers: Sequence[memoryview], check) -> None:
        """Read every span into its buffer; ``check(k)`` runs (on a reader thread) once span k is in."""
        per_device: dict[int, list[tuple[int, memoryview, int]]] = {}
        for k, (span, buf) in enumerate(zip(spans, buffers)):
            view = memoryview(buf)
            pos = 0
            for dev, dev_off, length in self.geometry.map_range(span.start, span.end - span.start):
                per_device.setdefault(dev, []).append((dev_off, view[pos:pos + length], k))
                pos += length
        if self._nixl_files is not None:
            try:
                self._nixl_files.read([(dev, off, v) for dev, pieces in per_device.items() for off, v, _ in pieces])
                for k in range(len(spans)):
                    check(k)
                return
            except OSError:
                with self._lock:
                    self._nixl_fallbacks += 1  # read again below, with preadv
        # devices interleaved, each in offset order: every device busy from the start, spans in order
        runs = sorted(((dev, run) for dev, pieces in per_device.items() for run in device_runs(pieces)),
                      key=lambda item: (item[1][0], item[0]))
        left = [0] * len(spans)  # runs still to finish, per span
        for _, (_, _, members) in runs:
            for k in members:
                left[k] += 1

        def read(dev: int, dev_off: int, views: list[memoryview], members: set[int]) -> None:
            self._read_run(dev, dev_off, views)
            for k in members:
                with self._lock:
                    left[k] -= 1
                    complete = left[k] == 0
                if complete:
                    check(k)
        futures = [self._pool.submit(read, dev, dev_off, views, members) for dev, (dev_off, views, members) in runs]
        errors = []
        for fut in futures:
            try:
                fut.result()
            except OSError as exc:
                errors.append(exc)
        if errors:
            with self._lock:
                self._io_errors += len(errors)
            raise errors[0]

    def _read_run(self, dev: int, dev_off: int, views: list[memoryview]) -> None:
        """Read one run (device ``dev``, from ``dev_off``) into ``views``, in order."""
        if self.backend == "kvikio":
            pieces, pos = [], dev_off
            for view in views:
                pieces.append((pos, view))
                pos += view.nbytes
            self._read_device_kvikio(self._paths[dev], pieces)
            return
        total, done = sum(v.nbytes for v in views), 0
        while done < total:
            n = os.preadv(self._fds[dev], views_past(views, done), dev_off + done)
            if n <= 0:
                raise OSError(5, f"short direct read on device {self.geometry.device_ids[dev]} "
                                 f"at offset {dev_off + done}: got {done} of {total} bytes")
            done += n

    def _read_device_kvikio(self, path: str, pieces: list[tuple[int, memoryview]]) -> None:
        """cuFile reads (kvikio picks GDS or its POSIX compat path) into the
        same host buffers, validated like posix. Reading straight into HBM
        would need the CRC check on the device; not done yet."""
        import kvikio
        import numpy as np

        with self._lock:
            handle = self._cufiles.get(path)
            if handle is None:
                handle = self._cufiles[path] = kvikio.CuFile(path, "r")
        futures = [handle.pread(np.frombuffer(view, dtype=np.uint8), view.nbytes, dev_off) for dev_off, view in pieces]
        for fut, (_, view) in zip(futures, pieces):
            if fut.get() != view.nbytes:
                raise OSError(5, "short kvikio read")

    # --- lifecycle -------------------------------------------------------
    def statistics(self) -> DirectReaderStatistics:
        with self._lock:
            return DirectReaderStatistics(backend=self.backend, o_direct=self._o_direct, blocks_read=self._blocks,
                                          bytes_read=self._bytes, validation_failures=self._failures,
                                          io_errors=self._io_errors, nixl_fallbacks=self._nixl_fallbacks)

    def close(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        if getattr(self, "_nixl_files", None) is not None:
            self._nixl_files.close()
            self._nixl_files = None
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        for handle in getattr(self, "_cufiles", {}).values():
            handle.close()
        self._cufiles = {}

    def __enter__(self) -> "DirectReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def device_runs(pieces: Sequence[tuple[int, memoryview, int]]) -> list[tuple[int, list[memoryview], set[int]]]:
    """One device's ``(device offset, view, span)`` pieces as preadv runs ``(device offset, views,
    spans)``: pieces contiguous on the device joined, up to RUN_BYTES_MAX and IOV_ENTRIES_MAX."""
    runs: list[tuple[int, list[memoryview], set[int]]] = []
    end = size = -1
    for dev_off, view, span in sorted(pieces, key=lambda piece: piece[0]):
        if runs and dev_off == end and size + view.nbytes <= RUN_BYTES_MAX and len(runs[-1][1]) < IOV_ENTRIES_MAX:
            runs[-1][1].append(view)
            runs[-1][2].add(span)
            size += view.nbytes
        else:
            runs.append((dev_off, [view], {span}))
            size = view.nbytes
        end = dev_off + view.nbytes
    return runs


def _land(block: memoryview, landing: Landing, i: int) -> memoryview | LandedBlock:
    """A verified raw block's payload copied into its landing views (a LandedBlock), or the block
    itself where its shape is not the landing's (another codec: decoded later)."""
    views = landing.views(i, 0)
    head = landing.head_nbytes
    if block.nbytes != head + sum(v.nbytes for v in views):
        return block
    source, pos = np.frombuffer(block, np.uint8), head
    for view in views:  # NumPy copies without the GIL: the reader threads keep reading meanwhile
        np.copyto(np.frombuffer(view, np.uint8), source[pos:pos + view.nbytes])
        pos += view.nbytes
    return LandedBlock(memoryview(bytes(block[:head])), block.nbytes)


def _windows(spans: list[_Span], window_bytes: int) -> list[list[_Span]]:
    """Consecutive spans in windows of at most ``window_bytes`` (a larger span alone)."""
    windows: list[list[_Span]] = []
    size = 0
    for span in spans:
        if windows and size + span.end - span.start <= window_bytes:
            windows[-1].append(span)
            size += span.end - span.start
        else:
            windows.append([span])
            size = span.end - span.start
    return windows
