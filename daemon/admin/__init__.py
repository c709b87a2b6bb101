"""kvtierd's admin HTTP API (FastAPI, served by uvicorn) and its Prometheus metrics.

Modules, one job each:

* :mod:`.http_server`  the listening socket and the uvicorn thread
* :mod:`.app`          the FastAPI app: error handlers, the gate, routers
* :mod:`.routes`       health, readiness, stats, config, devices, /metrics
* :mod:`.blocks`       per-block info and data, lookup, pin/unpin, evict
* :mod:`.gate`         auth and the body limit of every request, before its body is read
* :mod:`.auth`         who may use the API (bearer token, or loopback only)
* :mod:`.models`       request bodies (pydantic) that validate themselves
* :mod:`.errors`       every error as JSON
* :mod:`.view`         what the API reads from the running daemon
* :mod:`.stats`        the /v1/stats document and the figures derived for it
* :mod:`.metrics`      the Prometheus collector, read from statistics() at scrape time
"""
from .http_server import AdminServer, AdminServerError

__all__ = ["AdminServer", "AdminServerError"]
