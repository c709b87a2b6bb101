"""kvtierd with a fault-injecting device (for tests/test_degrade_fail_closed.py).

    faulty_device_daemon.py TRIGGER_FILE KVTIERD-ARGS...

Runs the real daemon (kvtier.daemon.main) on device files whose writes raise an unexpected
exception -- a RuntimeError, not the DeviceError a failing drive gives -- while TRIGGER_FILE
exists: a bug inside the engine's I/O path, from the daemon's point of view.
"""
from __future__ import annotations

import os
import sys

from kvtier.daemon.engine import devices, store


class BuggyFileDevice(devices.FileDevice):
    trigger = ""

    def _write(self, offset, buffers, total):
        if os.path.exists(self.trigger):
            raise RuntimeError(f"injected bug in a write of {total} bytes at {offset} on {self.name}")
        super()._write(offset, buffers, total)


if __name__ == "__main__":
    BuggyFileDevice.trigger = sys.argv[1]
    store.FileDevice = BuggyFileDevice  # what open_devices opens
    from kvtier.daemon.main import main
    sys.exit(main(sys.argv[2:]))
