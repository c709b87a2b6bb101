"""Offline check of a stopped store: every region's summary and every block.

``check_store`` validates the superblocks (as open does), classifies each
region, reads each non-free region whole and verifies every block its summary
lists (CRCs, key, seq). With ``repair=True`` it rewrites the summary of a
region without its bad entries, and seals regions found open; it never
changes a block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvtier.common.blockformat import BlockFormatError, verify_block

from . import regionfmt as fmt
from .config import EngineConfig
from .devices import Device
from kvtier.common.aligned import aligned_buffer
from .raid0 import StripedArray
from .recovery import scan_regions, write_summary
from .regions import RegionState
from .store import open_devices, validate_store


@dataclass(frozen=True)
class RegionReport:
    region: int
    state: RegionState  # as found on flash (OPEN: open when the store stopped)
    entries_ok: int
    entries_bad: int
    note: str = ""


@dataclass(frozen=True)
class FsckReport:
    regions: tuple[RegionReport, ...]
    repaired_regions: tuple[int, ...]

    @property
    def blocks_ok(self) -> int:
        return sum(r.entries_ok for r in self.regions)

    @property
    def blocks_bad(self) -> int:
        return sum(r.entries_bad for r in self.regions)

    @property
    def clean(self) -> bool:
        return self.blocks_bad == 0 and not any(r.state == RegionState.OPEN for r in self.regions)


def check_store(cfg: EngineConfig, repair: bool = False, devices: Sequence[Device] | None = None) -> FsckReport:
    owned = devices is None
    devs = open_devices(cfg, create=False) if owned else list(devices)
    try:
        layout = validate_store(cfg, devs)
        array = StripedArray(devs, layout.geometry, pool=_InlinePool())
        size = cfg.region_size_bytes
        reports, repaired = [], []
        for scan in scan_regions(array, layout.region_count, size, layout.generation, layout.seq_floor):
            if scan.kind == RegionState.FREE:
                reports.append(RegionReport(scan.region, RegionState.FREE, 0, 0, scan.note))
                continue
            image = scan.image
            if image is None:
                image = aligned_buffer(size)
                array.read(scan.region * size, image)
            good = _verify_entries(image, scan.entries)
            bad = int(np.count_nonzero(~good)) + scan.dropped_entries
            reports.append(RegionReport(scan.region, scan.kind, int(np.count_nonzero(good & _is_block(scan.entries))),
                                        bad, scan.note))
            if repair and (bad or scan.kind == RegionState.OPEN):
                write_summary(array, image, scan.region, layout.generation, scan.entries[good], scan.base_seq,
                              scan.data_end)
                repaired.append(scan.region)
        return FsckReport(tuple(reports), tuple(repaired))
    finally:
        if owned:
            for device in devs:
                device.close()


def _is_block(entries: np.ndarray) -> np.ndarray:
    return entries["kind"] == fmt.KIND_BLOCK


def _verify_entries(image: memoryview, entries: np.ndarray) -> np.ndarray:
    """True for metadata records and for blocks that verify in place."""
    good = np.ones(len(entries), bool)
    for i, row in enumerate(entries.tolist()):
        k0, k1, _, seq, _, offset, length, kind, _, _ = row
        if kind != fmt.KIND_BLOCK:
            continue
        if offset < fmt.REGION_HEADER_BYTES or offset + length > image.nbytes:
            good[i] = False
            continue
        try:
            verify_block(image[offset:offset + length], fmt.halves_to_key(k0, k1), seq)
        except BlockFormatError:
            good[i] = False
    return good


class _InlinePool:
    """fsck runs device I/O in the calling thread."""

    def submit(self, fn):
        from concurrent.futures import Future
        fut: Future = Future()
        try:
            fut.set_result(fn())
        except BaseException as exc:  # delivered through the future, as a pool would
            fut.set_exception(exc)
        return fut
