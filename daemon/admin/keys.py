"""``GET /v1/keys``: the keys a node stores, a page at a time (what a re-replication pass reads);
``GET /v1/keys/deleted``: the keys it deleted lately, which that pass must not copy back
(``kvtier.daemon.engine.deleted_keys``).

::

    GET /v1/keys?cursor=0&limit=4096   ->  {"keys": ["<32 hex>", ...], "next_cursor": 8191}
    ... until next_cursor is 0
    GET /v1/keys/deleted?cursor=0&limit=4096   the same, oldest delete first

A cursor is a position in the node's index, not a key: a table that grows between pages may
list a key twice or skip one, so a listing is a hint to repair from, not a snapshot.
"""
from __future__ import annotations

from fastapi import APIRouter, Query
from starlette.concurrency import run_in_threadpool

from kvtier.daemon.admin.view import AdminStateView

KEYS_PAGE_MAX = 65536  # 2.2 MiB of hex a page at most
KEYS_PAGE_DEFAULT = 4096


def keys_router(view: AdminStateView, dependencies: list) -> APIRouter:
    router = APIRouter(dependencies=dependencies, tags=["blocks"])

    @router.get("/v1/keys")
    async def list_keys(cursor: int = Query(0, ge=0), limit: int = Query(KEYS_PAGE_DEFAULT, ge=1, le=KEYS_PAGE_MAX)):
        """Up to ``limit`` stored keys from ``cursor`` on, and the cursor of the next page (0: done)."""
        return _page(*await run_in_threadpool(view.engine.keys_page, cursor, limit))

    @router.get("/v1/keys/deleted")
    async def list_deleted_keys(cursor: int = Query(0, ge=0),
                                limit: int = Query(KEYS_PAGE_DEFAULT, ge=1, le=KEYS_PAGE_MAX)):
        """Up to ``limit`` keys deleted lately from ``cursor`` on, and the next page's cursor (0: done)."""
        return _page(*await run_in_threadpool(view.engine.deleted_keys_page, cursor, limit))

    return router


def _page(raw: bytes, next_cursor: int) -> dict:
    return {"keys": [raw[i:i + 16].hex() for i in range(0, len(raw), 16)], "next_cursor": next_cursor}
