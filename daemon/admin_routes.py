"""The admin API app (FastAPI). Served by :class:`kvtier.daemon.admin.AdminServer`.

=======  ===========================  =================================================
GET      /healthz                     alive (no auth)
GET      /readyz                      devices open and index recovered: 200, else 503 (no auth)
GET      /v1/stats                    engine, server, per-tier and per-namespace figures
GET      /v1/blocks/{key}             present?, size, codec, region, pinned, last access
GET      /v1/blocks/{key}/data        the stored block (64-byte header + payload), as stored
PUT      /v1/blocks/{key}/data        store a block (body: header + payload; ?durable=true)
POST     /v1/lookup                   how many leading keys of a chain are present
POST     /v1/pin, /v1/unpin           keys, or namespace + tokens
POST     /v1/evict                    keys, a namespace, or all
GET      /v1/config                   effective config, secrets redacted
GET      /v1/devices                  device ids (superblocks) and local paths, stripe order
GET      /metrics                     Prometheus text exposition (or OpenMetrics)
=======  ===========================  =================================================

Every error is JSON (:mod:`.admin_errors`); auth is :mod:`.admin_auth`; the block
routes are :mod:`.admin_blocks`. Block routes answer 503 while the daemon is not
ready (starting, or draining on SIGTERM).
"""
from __future__ import annotations

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from kvtier.daemon.admin_auth import make_auth_dependency
from kvtier.daemon.admin_blocks import blocks_router
from kvtier.daemon.admin_errors import error_response, install_error_handlers
from kvtier.daemon.admin_state import AdminStateView
from kvtier.daemon.admin_stats import stats_document
from kvtier.daemon.metrics import KvtierCollector


def build_app(view: AdminStateView) -> FastAPI:
    """The admin FastAPI app over one daemon's state."""
    app = FastAPI(title="kvtierd admin API", version="1",
                  description="Health, statistics, per-block info, pin/unpin, evict, config and "
                              "Prometheus metrics of one kvtierd storage node.")
    install_error_handlers(app)
    auth = [Depends(make_auth_dependency(view))]

    def require_ready() -> None:
        if not view.ready():
            raise HTTPException(503, "kvtierd is not ready (starting, recovering or shutting down)")

    registry = CollectorRegistry(auto_describe=False)
    registry.register(KvtierCollector(view))

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict:
        """The process is alive and the admin thread answers."""
        return {"status": "ok", "uptime_s": round(view.uptime_s(), 3)}

    @app.get("/readyz", tags=["health"])
    def readyz():
        """Devices are open and the index is recovered: the data port serves."""
        if not view.ready():
            return error_response(503, "not ready: starting, recovering or shutting down", ready=False)
        return {"status": "ready", "ready": True}

    @app.get("/v1/stats", dependencies=auth, tags=["stats"])
    def stats() -> dict:
        """Engine, data server, per-tier and per-namespace figures (one snapshot each)."""
        return stats_document(view)

    @app.get("/v1/config", dependencies=auth, tags=["config"])
    def config() -> dict:
        """The effective configuration (file, then flags), secrets redacted."""
        return view.redacted_config()

    @app.get("/v1/devices", dependencies=auth, tags=["config"])
    def devices() -> dict:
        """Each device's id and local path in stripe order, and the stripe geometry:
        the map a client on this host (or with the same NVMe-oF namespaces) gives
        KVCache for direct reads."""
        return view.devices()

    @app.get("/metrics", dependencies=auth, tags=["stats"], response_class=Response)
    def metrics(request: Request):
        """Prometheus text exposition (OpenMetrics when the scraper asks for it),
        read from statistics() snapshots at scrape time."""
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(registry), headers={"Content-Type": content_type})

    app.include_router(blocks_router(view, auth + [Depends(require_ready)]))
    return app
