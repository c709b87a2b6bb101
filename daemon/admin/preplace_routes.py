"""Pre-placement routes of the admin API (a region started with ``--preplace-edges``).

=======  ========================  ======================================================
POST     /v1/preplace              soft-pin a given prefix (keys, or namespace + tokens) on
                                   chosen edges or on all of them
POST     /v1/preplace/push         run one push round of the hot prefixes now
GET      /v1/preplace              the edges, the settings, and the pre-placement figures
=======  ========================  ======================================================

A daemon without edges answers 404 naming the flag. An edge that cannot take the push
(down, wrong token, no soft pins) is one ``ok: false`` entry of the answer with its error;
the others are pushed all the same.
"""
from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, HTTPException
from pydantic import Field

from kvtier.daemon.admin.models import KeySelection, PIN_TTL_S_MAX
from kvtier.daemon.admin.view import AdminStateView

EDGES_PER_REQUEST_MAX = 256  # the most edges a region is configured with (preplace settings' EDGES_MAX)
EDGE_NAME_CHARS_MAX = 300  # a node id or an IPv6 HOST:PORT


class PreplaceRequest(KeySelection):
    """A prefix (``keys``, or ``namespace`` + ``tokens``), the edges (names or addresses, or
    ``"all"``) and the soft pins' TTL (default: the region's ``preplace_ttl_s``)."""

    edges: Literal["all"] | list[str] = Field(default="all", max_length=EDGES_PER_REQUEST_MAX)
    ttl_s: float | None = Field(default=None, gt=0, le=PIN_TTL_S_MAX, strict=True)  # true is not 1 s

    def edge_names(self):
        if self.edges != "all":
            for name in self.edges:
                if not 0 < len(name) <= EDGE_NAME_CHARS_MAX:
                    raise HTTPException(400, f"edge name {name[:40]!r}... is not 1..{EDGE_NAME_CHARS_MAX} characters")
            if not self.edges:
                raise HTTPException(400, "'edges' is an empty list: name edges, or give \"all\"")
        return self.edges


def _outcome_doc(outcome) -> dict:
    return {"edge": outcome.edge, "address": outcome.address, "ok": outcome.ok, "blocks_put": outcome.blocks_put,
            "bytes_put": outcome.bytes_put, "blocks_pinned": outcome.blocks_pinned,
            "bytes_pinned": outcome.bytes_pinned, "error": outcome.error}


def preplace_router(view: AdminStateView, dependencies: list) -> APIRouter:
    router = APIRouter(dependencies=dependencies, tags=["preplace"])

    def placer():
        found = view.preplacer()
        if found is None:
            raise HTTPException(404, "pre-placement is off on this daemon (start it with --preplace-edges)")
        return found

    @router.post("/v1/preplace")
    def preplace(request: PreplaceRequest) -> dict:
        """Push the prefix's leading blocks this region holds to the edges and soft-pin them there."""
        from kvtier.daemon.preplace.edges import UnknownEdge

        pusher = placer()
        keys = request.resolve()
        ns_id = request.namespace.to_namespace().id if request.namespace is not None else None
        try:
            held, outcomes = pusher.place(keys, ns_id, request.edge_names(), request.ttl_s)
        except UnknownEdge as exc:
            raise HTTPException(400, str(exc)) from None
        return {"requested": len(keys), "held_blocks": held, "missing": [k.hex() for k in keys[held:]],
                "ttl_s": pusher.settings.ttl_s if request.ttl_s is None else request.ttl_s,
                "edges": [_outcome_doc(o) for o in outcomes]}

    @router.post("/v1/preplace/push")
    def push_now() -> dict:
        """One push round of the hot prefixes now, as the periodic worker runs it."""
        report = placer().push_round()
        return {"prefixes": report.prefixes, "planned_bytes": report.planned_bytes,
                "edges": [_outcome_doc(o) for o in report.edges]}

    @router.get("/v1/preplace")
    def preplace_status() -> dict:
        """The edges, the settings and the figures (``statistics()``)."""
        pusher = placer()
        s = pusher.settings
        return {"edges": [{"name": e.name, "address": e.address} for e in pusher.edges()],
                "settings": {"edges": s.edges, "budget_bytes": s.budget_bytes, "ttl_s": s.ttl_s,
                             "interval_s": s.interval_s, "token": None if s.token is None else "<set>"},
                "statistics": pusher.statistics().as_dict()}

    return router
