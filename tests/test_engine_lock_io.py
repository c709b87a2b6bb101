"""No device I/O runs in a thread that holds the engine lock -- on the put, get, delete, pin and
reclaim paths, error paths (failed seals, region headers, commits, take-backs) included; only
close seals under it. A device records every read, write and sync made by a lock holder."""
from __future__ import annotations

import threading

import pytest

from kvtier.daemon.engine import DeviceError, Engine, EngineConfig, NoSpaceError
from kvtier.daemon.engine.devices import FaultyDevice, MemoryDevice
from kvtier.daemon.engine.superblock import DATA_OFFSET_BYTES

from test_engine import MiB, block, key


class LockWatchingDevice(FaultyDevice):
    def __init__(self, inner):
        super().__init__(inner)
        self.engine_lock = None
        self.under_lock: list[str] = []

    def _watch(self, op: str) -> None:
        if self.engine_lock is not None and self.engine_lock._is_owned():
            self.under_lock.append(f"{op} in {threading.current_thread().name}")

    def _read(self, offset, buffers, total):
        self._watch("read")
        super()._read(offset, buffers, total)

    def _write(self, offset, buffers, total):
        self._watch("write")
        super()._write(offset, buffers, total)

    def sync(self):
        self._watch("sync")
        super().sync()


def test_no_device_io_under_the_engine_lock_even_when_writes_fail():
    cfg = EngineConfig(device_paths=("m0", "m1"), stripe_size_bytes=MiB // 4, region_size_bytes=MiB)
    devs = [LockWatchingDevice(MemoryDevice(DATA_OFFSET_BYTES + 8 * MiB, f"m{i}")) for i in range(2)]
    Engine.format(cfg, devices=devs)
    engine = Engine.open(cfg, devices=devs)
    for dev in devs:
        dev.engine_lock = engine._lock
    errors = 0
    for i in range(200):  # about 6 times the store: seals, headers, reclaims
        failing = i % 37 in (5, 6, 7)  # writes or syncs fail now and then
        for dev in devs:
            dev.fail_writes = failing and i % 2 == 0
            dev.fail_syncs = failing and i % 2 == 1
        try:
            engine.put(block(i, 60_000), durable=i % 3 == 0)
            if i % 10 == 0:
                engine.pin_many([key(i)])
            if i % 10 == 5:
                engine.delete_many([key(i - 1)])
                engine.unpin_many([key(i - 5)])
            engine.get(key(i))
        except (DeviceError, NoSpaceError):
            errors += 1
    for dev in devs:
        dev.fail_writes = dev.fail_syncs = False
    engine.put(block(1000, 60_000), durable=True)
    engine.flush()
    assert errors, "no fault was met"
    assert engine.failure is None
    assert [line for dev in devs for line in dev.under_lock] == []
    engine.close()
