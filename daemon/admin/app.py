"""The admin API app (FastAPI). Served by :class:`.http_server.AdminServer`.

=======  ===========================  =================================================
GET      /healthz                     alive (no auth)
GET      /readyz                      devices open and index recovered: 200, else 503 (no auth)
GET      /v1/stats                    engine, server, per-tier and per-namespace figures
GET      /v1/blocks/{key}             present?, size, codec, region, pinned, last access
GET      /v1/blocks/{key}/data        the stored block (64-byte header + payload), as stored
PUT      /v1/blocks/{key}/data        store a block (body: header + payload; ?durable=true)
POST     /v1/lookup                   how many leading keys of a chain are present
GET      /v1/keys                     the stored keys, a page at a time (?cursor=&limit=)
GET      /v1/keys/deleted             the keys deleted lately (re-replication does not copy them back)
POST     /v1/pin, /v1/unpin           keys, or namespace + tokens
POST     /v1/evict                    keys, a namespace, or all
GET      /v1/config                   effective config, secrets redacted
GET      /v1/devices                  device ids (superblocks) and local paths, stripe order
GET      /v1/kv-events                KV-events endpoints and publisher statistics (404 when off)
GET      /v1/kv-events/snapshot       every stored key and the event sequence number it matches
POST     /v1/preplace                 soft-pin a prefix on chosen edges or all (--preplace-edges; 404 off)
POST     /v1/preplace/push            one push round of the hot prefixes now
GET      /v1/preplace                 the edges, settings and pre-placement figures
GET      /metrics                     Prometheus text exposition (or OpenMetrics)
GET      /openapi.json, /docs, /redoc OpenAPI document, Swagger UI, ReDoc (auth like the rest)
=======  ===========================  =================================================

Every error is JSON (:mod:`.errors`); auth is :mod:`.auth`, applied by :mod:`.gate` alone
(no route repeats it), before a body is read; the gate also bounds the body. The health, stats,
config and metrics routes are :mod:`.routes`, the block routes :mod:`.blocks`.
Block routes answer 503 while the daemon is not ready (starting, or draining
on SIGTERM).
"""
from __future__ import annotations

from fastapi import Depends, FastAPI, HTTPException

from kvtier.daemon.admin.blocks import blocks_router
from kvtier.daemon.admin.docs import docs_router
from kvtier.daemon.admin.errors import install_error_handlers
from kvtier.daemon.admin.gate import RequestGate
from kvtier.daemon.admin.keys import keys_router
from kvtier.daemon.admin.kv_events_routes import kv_events_router
from kvtier.daemon.admin.preplace_routes import preplace_router
from kvtier.daemon.admin.routes import node_router
from kvtier.daemon.admin.view import AdminStateView


def build_app(view: AdminStateView) -> FastAPI:
    """The admin FastAPI app over one daemon's state."""
    app = FastAPI(title="kvtierd admin API", version="1", openapi_url=None, docs_url=None, redoc_url=None,
                  description="Health, statistics, per-block info, pin/unpin, evict, config and "
                              "Prometheus metrics of one kvtierd storage node.")
    install_error_handlers(app, on_internal_error=view.count_internal_error)
    app.add_middleware(RequestGate, view=view)  # auth and the body limit, for every route, before a body is read

    def require_ready() -> None:
        if not view.ready():
            raise HTTPException(503, "kvtierd is not ready (starting, recovering or shutting down)")

    ready = [Depends(require_ready)]
    app.include_router(node_router(view))
    app.include_router(blocks_router(view, ready))
    app.include_router(keys_router(view, ready))
    app.include_router(kv_events_router(view, ready))
    app.include_router(preplace_router(view, ready))
    app.include_router(docs_router(app))  # /openapi.json, /docs, /redoc: behind the gate like the rest
    return app
