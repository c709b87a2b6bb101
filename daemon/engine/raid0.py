"""RAID0 over devices: logical ranges -> per-device vectored I/O, in parallel.

The address mapping is :class:`kvtier.common.stripe.StripeGeometry` (shared
with the client's direct reader); this module only groups its pieces by
device, merges the ones that are contiguous on a device into one iovec list,
and runs each device's share on a thread pool so devices work in parallel::

    logical range  [u0|u1|u2|u3|u4|u5|u6|u7]          4 devices
    dev 0: pwritev(off0, [u0, u4])   dev 1: pwritev(off1, [u1, u5])  ...
"""
from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Sequence

from kvtier.common.stripe import StripeGeometry

from .devices import Device
from kvtier.common.aligned import ALIGNMENT_BYTES
from .errors import DeviceError

IOV_ENTRIES_MAX = 512  # below Linux IOV_MAX (1024); one preadv/pwritev per this many buffers
RUN_BYTES_MAX = 4 << 20  # one I/O per this many bytes: a region's 16 MiB per device becomes 4 I/Os in flight
#                          together (up to the pool's threads) instead of one deep-queue-less 16 MiB call


class StripedArray:
    """Logical reads and writes over striped devices."""

    def __init__(self, devices: Sequence[Device], geometry: StripeGeometry, pool: ThreadPoolExecutor):
        assert len(devices) == len(geometry.device_ids), (len(devices), geometry.device_ids)
        self.devices = tuple(devices)
        self.geometry = geometry
        self._pool = pool

    def plan(self, logical_offset: int, view: memoryview) -> dict[int, list[tuple[int, list[memoryview]]]]:
        """``{device_index: [(device_offset, [buffers]), ...]}`` for one range."""
        plan: dict[int, list[tuple[int, list[memoryview]]]] = {}
        self.add_to_plan(plan, logical_offset, view)
        return plan

    def add_to_plan(self, plan, logical_offset: int, view: memoryview) -> None:
        if logical_offset % ALIGNMENT_BYTES or view.nbytes % ALIGNMENT_BYTES:
            raise ValueError(f"striped range {logical_offset}+{view.nbytes} is not {ALIGNMENT_BYTES}-aligned")
        pos = 0
        for dev, dev_off, length in self.geometry.map_range(logical_offset, view.nbytes):
            piece = view[pos:pos + length]
            pos += length
            runs = plan.setdefault(dev, [])
            if runs:
                last_off, last_bufs = runs[-1]
                run_bytes = sum(b.nbytes for b in last_bufs)
                if (last_off + run_bytes == dev_off and len(last_bufs) < IOV_ENTRIES_MAX
                        and run_bytes + length <= RUN_BYTES_MAX):
                    last_bufs.append(piece)
                    continue
            runs.append((dev_off, [piece]))

    def read(self, logical_offset: int, view: memoryview) -> None:
        self.run_plan(self.plan(logical_offset, view), write=False)

    def read_inline(self, logical_offset: int, view: memoryview) -> None:
        """Read in the calling thread, device by device (for callers that already run on the pool:
        waiting on the pool from inside it could deadlock)."""
        for dev, runs in self.plan(logical_offset, view).items():
            for off, bufs in runs:
                self.devices[dev].read_into(off, bufs)

    def write(self, logical_offset: int, view: memoryview) -> None:
        self.run_plan(self.plan(logical_offset, view), write=True)

    def write_ranges(self, ranges: Iterable[tuple[int, memoryview]]) -> set[int]:
        """Write several logical ranges as one parallel batch; returns the devices touched."""
        plan: dict[int, list] = {}
        for logical_offset, view in ranges:
            self.add_to_plan(plan, logical_offset, view)
        self.run_plan(plan, write=True)
        return set(plan)

    def read_ranges(self, ranges: Iterable[tuple[int, memoryview]]) -> None:
        plan: dict[int, list] = {}
        for logical_offset, view in ranges:
            self.add_to_plan(plan, logical_offset, view)
        self.run_plan(plan, write=False)

    def sync(self, device_indexes: Iterable[int] | None = None) -> None:
        """fdatasync the given devices (all by default) in parallel."""
        targets = sorted(set(range(len(self.devices)) if device_indexes is None else device_indexes))
        self._parallel([(lambda d=d: self.devices[d].sync()) for d in targets])

    def run_plan(self, plan, write: bool) -> None:
        """One task per contiguous device run: several runs on one device are in flight at once
        (the pool's size bounds the queue depth). Tasks are queued round-robin over the devices,
        so a plan with many runs (a batch of blocks) keeps every device busy from its start
        instead of handing the pool's threads to the first device's runs."""
        per_device = []
        for dev, runs in plan.items():
            device = self.devices[dev]
            op = device.write if write else device.read_into
            per_device.append([(lambda op=op, off=off, bufs=bufs: op(off, bufs)) for off, bufs in runs])
        self._parallel([task for turn in itertools.zip_longest(*per_device) for task in turn if task is not None])

    def _parallel(self, tasks) -> None:
        if len(tasks) == 1:
            tasks[0]()
            return
        futures = [self._pool.submit(task) for task in tasks]
        errors = []
        for fut in futures:
            try:
                fut.result()
            except DeviceError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def close(self) -> None:
        for device in self.devices:
            device.close()
