"""Formatting a store and validating its devices on open.

``format_store`` writes one superblock per device; ``open_store`` reads them
back and refuses a missing, extra, reordered, resized or foreign device with
a :class:`GeometryError` that names it.
"""
from __future__ import annotations

import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

from kvtier.common.stripe import StripeGeometry

from .config import EngineConfig
from .devices import Device, FileDevice
from kvtier.common.aligned import aligned_buffer
from .errors import DeviceError, GeometryError
from .raid0 import StripedArray
from .recovery import scan_regions
from .superblock import DATA_OFFSET_BYTES, SUPERBLOCK_BYTES, Superblock, SuperblockError, decode_superblock

REGION_COUNT_MIN = 2  # one open region plus one to reclaim
UNSCANNED_SEQ_MARGIN = 1 << 48  # an old store whose regions cannot be scanned: its seqs are taken to lie below
#                                 its floor plus this (more seqs than a store takes in centuries)


@dataclass(frozen=True)
class StoreLayout:
    geometry: StripeGeometry
    region_count: int
    generation: int
    store_uuid: bytes
    seq_floor: int = 0  # every seq <= this is of an erased generation or store (see superblock.py)


def open_devices(cfg: EngineConfig, create: bool) -> list[Device]:
    devices: list[Device] = []
    try:
        for path in cfg.device_paths:
            if not os.path.exists(path) and not (create and cfg.device_size_bytes):
                raise GeometryError(f"device {path} is missing" + ("" if not create else
                                    " and no device_size_bytes is configured to create it"))
            devices.append(FileDevice(path, create_size_bytes=cfg.device_size_bytes if create else None))
    except (GeometryError, DeviceError):
        for device in devices:
            device.close()
            if getattr(device, "created", False):  # made by this call, space reserved: give it back
                os.unlink(device.name)
        raise
    return devices


def read_superblocks(devices: Sequence[Device]) -> list[Superblock | SuperblockError]:
    page = aligned_buffer(SUPERBLOCK_BYTES)
    out: list[Superblock | SuperblockError] = []
    for device in devices:
        if device.size_bytes < SUPERBLOCK_BYTES:
            out.append(SuperblockError(f"device is only {device.size_bytes} bytes"))
            continue
        device.read_into(0, [page])
        try:
            out.append(decode_superblock(page))
        except SuperblockError as exc:
            out.append(exc)
    return out


def compute_layout(cfg: EngineConfig, devices: Sequence[Device], device_ids: tuple[str, ...]) -> tuple[int, int]:
    """(device_data_bytes, region_count) for these devices."""
    share = cfg.region_size_bytes // len(devices)  # each region puts this many bytes on each device
    smallest = min(devices, key=lambda d: d.size_bytes)
    regions = max(0, (smallest.size_bytes - DATA_OFFSET_BYTES) // share)
    if regions < REGION_COUNT_MIN:
        raise GeometryError(f"device {smallest.name} ({smallest.size_bytes} bytes) is too small: the store needs "
                            f"{REGION_COUNT_MIN} regions of {cfg.region_size_bytes} bytes over {len(devices)} devices, "
                            f"i.e. >= {DATA_OFFSET_BYTES + REGION_COUNT_MIN * share} bytes per device")
    return regions * share, regions


def format_store(cfg: EngineConfig, devices: Sequence[Device], force: bool,
                 force_hint: str = "force=True") -> StoreLayout:
    """Write fresh superblocks; ``force_hint`` is how the refusal names the override
    (the command line says ``--force``)."""
    old = read_superblocks(devices)
    if not force:
        for device, sb in zip(devices, old):
            if isinstance(sb, Superblock):
                raise GeometryError(f"device {device.name} already holds kvtier store {sb.store_uuid.hex()}; "
                                    f"formatting it needs {force_hint} (erases the store)")
    seq_floor = erased_seq_floor(devices, old)
    uuids = tuple(secrets.token_bytes(16) for _ in devices)
    device_data_bytes, regions = compute_layout(cfg, devices, tuple(u.hex() for u in uuids))
    store_uuid = secrets.token_bytes(16)
    generation = secrets.randbits(62) + 1  # random: regions of any earlier store on these devices never match
    page = aligned_buffer(SUPERBLOCK_BYTES)
    for index, device in enumerate(devices):
        sb = Superblock(store_uuid, generation, index, uuids, device.size_bytes, cfg.stripe_size_bytes,
                        cfg.region_size_bytes, DATA_OFFSET_BYTES, device_data_bytes, seq_floor)
        page[:] = sb.encode()
        device.write(0, [page])
        device.sync()
    geometry = StripeGeometry(tuple(u.hex() for u in uuids), cfg.stripe_size_bytes, DATA_OFFSET_BYTES,
                              device_data_bytes)
    return StoreLayout(geometry, regions, generation, store_uuid, seq_floor)


def erased_seq_floor(devices: Sequence[Device], sbs: Sequence[Superblock | SuperblockError]) -> int:
    """The seq floor a new store on these devices starts above: the old store's floor and every
    seq its regions may hold (their header and trailer pages, read with the old geometry), so no
    block of the old store left on flash can pass for a new one in a reused region. 0 without
    an old store; the floors plus UNSCANNED_SEQ_MARGIN when the old superblocks do not describe one
    whole store or its regions cannot be read."""
    valid = [sb for sb in sbs if isinstance(sb, Superblock)]
    if not valid:
        return 0
    floor = max(sb.seq_floor for sb in valid)
    unscanned = floor + UNSCANNED_SEQ_MARGIN
    ref = valid[0]
    whole = (len(valid) == len(devices) == len(ref.device_uuids)
             and sorted(sb.device_index for sb in valid) == list(range(len(devices)))
             and all((sb.store_uuid, sb.device_uuids, sb.region_size_bytes, sb.stripe_size_bytes,
                      sb.data_offset_bytes, sb.device_data_bytes)
                     == (ref.store_uuid, ref.device_uuids, ref.region_size_bytes, ref.stripe_size_bytes,
                         ref.data_offset_bytes, ref.device_data_bytes) for sb in valid)
             and all(d.size_bytes >= sb.data_offset_bytes + sb.device_data_bytes for d, sb in zip(devices, valid)))
    if not whole:
        return unscanned
    ordered = [device for _, device in sorted(zip((sb.device_index for sb in valid), devices), key=lambda p: p[0])]
    geometry = StripeGeometry(tuple(u.hex() for u in ref.device_uuids), ref.stripe_size_bytes,
                              ref.data_offset_bytes, ref.device_data_bytes)
    regions = ref.device_data_bytes * len(devices) // ref.region_size_bytes
    generation = max(sb.generation for sb in valid)
    try:
        with ThreadPoolExecutor(max_workers=len(devices), thread_name_prefix="kvtier-format") as pool:
            scans = scan_regions(StripedArray(ordered, geometry, pool), regions, ref.region_size_bytes, generation)
    except DeviceError:
        return unscanned  # a failing old device must not stop the format that replaces the store
    return max([floor] + [max(scan.seq_bound, scan.last_seq) for scan in scans])


def validate_store(cfg: EngineConfig, devices: Sequence[Device]) -> StoreLayout:
    sbs = read_superblocks(devices)
    valid = [sb for sb in sbs if isinstance(sb, Superblock)]
    if not valid:
        raise GeometryError(f"no device holds a kvtier store (first: {devices[0].name}); format the store first")
    ref = valid[0]
    for device, sb in zip(devices, sbs):
        if isinstance(sb, SuperblockError):
            raise GeometryError(f"device {device.name} holds no superblock of store {ref.store_uuid.hex()} ({sb}): "
                                f"a missing, replaced or extra device")
        if sb.store_uuid != ref.store_uuid:
            raise GeometryError(f"device {device.name} belongs to another store ({sb.store_uuid.hex()}, "
                                f"not {ref.store_uuid.hex()})")
    count = len(ref.device_uuids)
    present = {sb.device_index for sb in sbs}
    missing = [i for i in range(count) if i not in present]
    if missing or count != len(devices):
        names = ", ".join(f"#{i} (uuid {ref.device_uuids[i].hex()})" for i in missing) or "none"
        raise GeometryError(f"store {ref.store_uuid.hex()} has {count} devices but {len(devices)} are configured "
                            f"({', '.join(d.name for d in devices)}); missing device {names}")
    for index, (device, sb) in enumerate(zip(devices, sbs)):
        if sb.device_index != index:
            raise GeometryError(f"device {device.name} is device #{sb.device_index} of the store but is configured "
                                f"as #{index} (reordered devices)")
    for device, sb in zip(devices, sbs):
        if device.size_bytes != sb.device_size_bytes:
            raise GeometryError(f"device {device.name} is {device.size_bytes} bytes but was formatted at "
                                f"{sb.device_size_bytes} bytes (resized device)")
        if (sb.stripe_size_bytes, sb.region_size_bytes) != (cfg.stripe_size_bytes, cfg.region_size_bytes):
            raise GeometryError(f"device {device.name} was formatted with stripe_size_bytes={sb.stripe_size_bytes}, "
                                f"region_size_bytes={sb.region_size_bytes}; the configuration says "
                                f"{cfg.stripe_size_bytes}, {cfg.region_size_bytes}")
        if sb.device_uuids != ref.device_uuids or sb.device_data_bytes != ref.device_data_bytes:
            raise GeometryError(f"device {device.name} disagrees with the other devices on the store's geometry")
    generation = max(sb.generation for sb in sbs)
    seq_floor = max(sb.seq_floor for sb in sbs)
    if any((sb.generation, sb.seq_floor) != (generation, seq_floor) for sb in sbs):
        write_generation(devices, sbs, generation, seq_floor)  # a crash during delete_all: finish it
    geometry = StripeGeometry(tuple(u.hex() for u in ref.device_uuids), ref.stripe_size_bytes,
                              ref.data_offset_bytes, ref.device_data_bytes)
    regions = ref.device_data_bytes * count // ref.region_size_bytes
    return StoreLayout(geometry, regions, generation, ref.store_uuid, seq_floor)


def write_generation(devices: Sequence[Device], sbs: Sequence[Superblock], generation: int, seq_floor: int) -> None:
    """Rewrite every superblock with ``generation`` and ``seq_floor`` (delete_all), syncing each."""
    page = aligned_buffer(SUPERBLOCK_BYTES)
    for device, sb in zip(devices, sbs):
        page[:] = Superblock(sb.store_uuid, generation, sb.device_index, sb.device_uuids, sb.device_size_bytes,
                             sb.stripe_size_bytes, sb.region_size_bytes, sb.data_offset_bytes,
                             sb.device_data_bytes, seq_floor).encode()
        device.write(0, [page])
        device.sync()
