"""Direct reads of sealed blocks from the daemon's devices (the NVMe-oF path).

The daemon answers *where* a block lives (LOOKUP with locations: a logical
offset and length in its striped space, the block's write sequence, and
whether its region is sealed). A client that sees the same devices - the
same files or loop devices on one machine, NVMe-oF-attached namespaces in
production - reads the bytes itself::

    location (logical_offset, length)
        -> align to ALIGNMENT_BYTES         (O_DIRECT rules)
        -> StripeGeometry.map_range         -> [(device, device_offset, n), ...]
        -> preadv on each device's fd       (devices in parallel)
        -> verify_block(key, seq, CRC)      -> the block, or None (a miss)

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

from kvtier.common.aligned import ALIGNMENT_BYTES, aligned_buffer, align_down, align_up
from kvtier.common.blockformat import BlockFormatError, verify_block
from kvtier.common.stripe import StripeGeometry

COALESCE_GAP_BYTES_MAX = 256 * 1024  # reading a gap this small beats another syscall per block
READ_RANGE_BYTES_MAX = 16 * 1024 * 1024  # bounds one buffer; larger batches are split
DEVICES_MAX = 64  # one fd and one reader thread per device


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
        self._pool = ThreadPoolExecutor(max_workers=len(self._fds), thread_name_prefix="kvtier-direct")
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
    def read_many(self, keys: Sequence[bytes], locations: Sequence[DirectLocation]) -> list[memoryview | None]:
        """The verified block for each (key, location), or ``None`` where the
        bytes found do not validate (the caller falls back to TCP). An I/O
        error on a device is raised: it is not a miss, it is a fault."""
        if len(keys) != len(locations):
            raise ValueError(f"{len(keys)} keys but {len(locations)} locations")
        results: list[memoryview | None] = [None] * len(keys)
        spans = self._plan(locations)
        buffers = [aligned_buffer(s.end - s.start) for s in spans]
        self._read_spans(spans, buffers)
        failures = 0
        for span, buf in zip(spans, buffers):
            view = memoryview(buf)
            for i in span.members:
                loc = locations[i]
                lo = loc.logical_offset - span.start
                block = view[lo:lo + loc.length]
                try:
                    verify_block(block, expected_key=keys[i], expected_seq=loc.seq)
                except BlockFormatError:
                    failures += 1
                    continue
                results[i] = block
        with self._lock:
            self._blocks += len(keys) - failures
            self._bytes += sum(s.end - s.start for s in spans)
            self._failures += failures
        return results

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

    def _read_spans(self, spans: Sequence[_Span], buffers: Sequence[memoryview]) -> None:
        per_device: dict[int, list[tuple[int, memoryview]]] = {}
        for span, buf in zip(spans, buffers):
            view = memoryview(buf)
            pos = 0
            for dev, dev_off, length in self.geometry.map_range(span.start, span.end - span.start):
                per_device.setdefault(dev, []).append((dev_off, view[pos:pos + length]))
                pos += length
        if self._nixl_files is not None:
            try:
                self._nixl_files.read([(dev, off, v) for dev, pieces in per_device.items() for off, v in pieces])
                return
            except OSError:
                with self._lock:
                    self._nixl_fallbacks += 1  # read again below, with preadv
        futures = [self._pool.submit(self._read_device, dev, pieces) for dev, pieces in per_device.items()]
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

    def _read_device(self, dev: int, pieces: list[tuple[int, memoryview]]) -> None:
        fd = self._fds[dev]
        if self.backend == "kvikio":
            self._read_device_kvikio(self._paths[dev], pieces)
            return
        for dev_off, view in pieces:
            done = 0
            while done < view.nbytes:
                n = os.preadv(fd, [view[done:]], dev_off + done)
                if n <= 0:
                    raise OSError(5, f"short direct read on device {self.geometry.device_ids[dev]} "
                                     f"at offset {dev_off + done}: got {done} of {view.nbytes} bytes")
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
