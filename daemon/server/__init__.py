"""kvtierd's data server: the binary TCP protocol (:mod:`kvtier.wire`) served from one engine.

Modules, one job each:

* :mod:`.data_server`      listening, accepting, connection limit, shutdown
* :mod:`.connection_loop`  one connection on its own thread: HELLO deadline, receive, reply
* :mod:`.closing`          error frames and half-close so the last frames arrive
* :mod:`.stop_signal`      the stop request every poller sees
* :mod:`.handler`          requests -> engine calls -> replies (every op but GET's reads)
* :mod:`.get_reply`        GET: locate, lay out one reply buffer, read the blocks into it
* :mod:`.session`          what the server knows about one connection
* :mod:`.request_buffers`  lending arenas and transient buffers to requests, within budget
* :mod:`.arenas`           the daemon-wide pool of request arenas and the transient budget
* :mod:`.stats`            counters and latency histograms, read as a frozen snapshot
"""
from .data_server import DataServer

__all__ = ["DataServer"]
