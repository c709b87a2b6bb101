"""Admin routes about the node itself: health, readiness, statistics, config, devices, metrics.

Health and readiness answer without auth (probes: ``.auth.PUBLIC_PATHS``); the gate
(:mod:`.gate`) asks every other request for the token.
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from kvtier.daemon.admin.errors import error_response
from kvtier.daemon.admin.metrics import KvtierCollector
from kvtier.daemon.admin.stats import stats_document
from kvtier.daemon.admin.view import AdminStateView


def node_router(view: AdminStateView) -> APIRouter:
    router = APIRouter()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KvtierCollector(view))

    @router.get("/healthz", tags=["health"])
    def healthz() -> dict:
        """The process is alive and the admin thread answers."""
        return {"status": "ok", "uptime_s": round(view.uptime_s(), 3)}

    @router.get("/readyz", tags=["health"])
    def readyz():
        """Devices are open and the index is recovered: the data port serves."""
        if not view.ready():
            return error_response(503, "not ready: starting, recovering or shutting down", ready=False)
        return {"status": "ready", "ready": True}

    @router.get("/v1/stats", tags=["stats"])
    def stats() -> dict:
        """Engine, data server, per-tier and per-namespace figures (one snapshot each)."""
        return stats_document(view)

    @router.get("/v1/config", tags=["config"])
    def config() -> dict:
        """The effective configuration (file, then flags), secrets redacted."""
        return view.redacted_config()

    @router.get("/v1/devices", tags=["config"])
    def devices() -> dict:
        """Each device's id and local path in stripe order, and the stripe geometry:
        the map a client on this host (or with the same NVMe-oF namespaces) gives
        KVCache for direct reads."""
        return view.devices()

    @router.get("/metrics", tags=["stats"], response_class=Response)
    def metrics(request: Request):
        """Prometheus text exposition (OpenMetrics when the scraper asks for it),
        read from statistics() snapshots at scrape time."""
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(registry), headers={"Content-Type": content_type})

    return router
