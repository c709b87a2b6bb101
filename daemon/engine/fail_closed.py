"""The engine's one fail-closed policy, as a decorator on every public Engine call.

An exception the call expects (an EngineError: no space, a device error, a bad argument; a
malformed block) is its answer, and the engine serves on; a device error first waits for the
cover writes of what the failed request wrote (:meth:`Allocator.wait_covers`). Any other exception
is a bug in engine state: the engine fails closed (:meth:`Engine.fail`) and the caller gets
EngineBugError naming it. Threads of the engine's own (the reclaim worker) fail it the same way.
"""
from __future__ import annotations

import functools
import logging

from kvtier.common.blockformat import BlockFormatError

from .errors import DeviceError, EngineBugError, EngineError

log = logging.getLogger("kvtier.daemon.engine")


def fails_closed(method):
    """An Engine call whose unexpected exception (not an EngineError, not a malformed block) is a bug
    in engine state: the engine fails closed and the caller gets EngineBugError naming it."""
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except DeviceError:
            self._allocator.wait_covers()  # what the failed request wrote is covered before its caller hears
            raise
        except (EngineError, BlockFormatError):
            raise
        except Exception as exc:
            reason = f"{type(exc).__name__} in Engine.{method.__name__}: {exc}"
            log.exception("event=engine_bug call=%s", method.__name__)
            self.fail(reason)
            raise EngineBugError(f"internal error: the engine failed closed ({reason}); a restart recovers from "
                                 f"flash") from exc
    return guarded
