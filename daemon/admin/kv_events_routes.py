"""KV-events routes of the admin API: where the events are published, and the snapshot a
subscriber starts (or resynchronizes) from (:mod:`kvtier.daemon.events.snapshot`)."""
from __future__ import annotations

from fastapi import APIRouter, HTTPException

from kvtier.daemon.admin.view import AdminStateView

KV_EVENTS_OFF = "KV events are off: start kvtierd with --kv-events-endpoint tcp://HOST:PORT"


def kv_events_router(view: AdminStateView, dependencies: list) -> APIRouter:
    router = APIRouter(dependencies=dependencies, tags=["kv-events"])

    def kv_events():
        events = view.kv_events()
        if events is None:
            raise HTTPException(404, KV_EVENTS_OFF)
        return events

    @router.get("/v1/kv-events")
    def kv_events_info() -> dict:
        """The PUB and replay endpoints, the newest sequence number and the publisher's counters."""
        return kv_events().statistics().as_dict()

    @router.get("/v1/kv-events/snapshot")
    def kv_events_snapshot() -> dict:
        """Every stored key (base64 of the packed 16-byte keys) and ``seq``, the number of the newest
        event batch this state includes: apply the batches numbered above it."""
        return kv_events().snapshot().as_document()

    return router
