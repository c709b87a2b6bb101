"""Block routes of the admin API: per-key info and data, lookup, pin/unpin, evict.

Engine calls run in FastAPI's worker threads (plain ``def`` routes, or
``run_in_threadpool``), never on the event loop; the engine is thread-safe. Auth and the
size of an upload are settled by :mod:`.gate` before a route runs.
"""
from __future__ import annotations

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from kvtier.common.blockformat import BlockFormatError, verify_block
from kvtier.daemon.admin.errors import error_response
from kvtier.daemon.admin.models import EvictRequest, KeySelection, PinSelection, key_from_hex
from kvtier.daemon.admin.view import AdminStateView
from kvtier.common.codec_ids import codec_name


def key_or_400(key_hex: str) -> bytes:
    try:
        return key_from_hex(key_hex)
    except ValueError as exc:
        raise HTTPException(400, str(exc)) from None


def _not_stored(key: bytes):
    return error_response(404, f"block {key.hex()} is not stored", key=key.hex(), present=False)


def _codec_label(codec_id: int) -> str:
    try:
        return codec_name(codec_id)
    except ValueError:
        return f"unknown({codec_id:#x})"


def blocks_router(view: AdminStateView, dependencies: list) -> APIRouter:
    router = APIRouter(dependencies=dependencies, tags=["blocks"])

    @router.get("/v1/blocks/{key_hex}")
    def block_info(key_hex: str):
        """Where a block lives and how it is kept: size, codec, namespace, region, pinned, last access."""
        key = key_or_400(key_hex)
        info = view.engine.block_info(key)
        if info is None:
            return _not_stored(key)
        return {"key": key.hex(), **info, "codec": _codec_label(info["codec_id"])}

    @router.get("/v1/blocks/{key_hex}/data", response_class=Response,
                responses={200: {"content": {"application/octet-stream": {}}}})
    def block_data(key_hex: str):
        """The stored block as the data port returns it: 64-byte header + payload."""
        key = key_or_400(key_hex)
        block = view.engine.get(key)
        if block is None:
            return _not_stored(key)
        return Response(bytes(block), media_type="application/octet-stream")

    @router.put("/v1/blocks/{key_hex}/data")
    async def put_block(key_hex: str, request: Request, durable: bool = Query(False)):
        """Store one block (the body: header + payload, built by the client; verified here)."""
        key = key_or_400(key_hex)
        body = await request.body()  # bounded by the gate: one region at most
        try:
            verify_block(body, expected_key=key)
        except BlockFormatError as exc:
            raise HTTPException(400, f"not a valid block for key {key.hex()}: {exc}") from None
        seq = await run_in_threadpool(view.engine.put, body, durable)
        return {"key": key.hex(), "seq": seq, "size_bytes": len(body), "durable": durable}

    @router.post("/v1/lookup")
    def lookup(selection: KeySelection) -> dict:
        """How many leading blocks of the chain are stored."""
        keys = selection.resolve()
        return {"requested": len(keys), "hit_blocks": view.engine.lookup(keys) if keys else 0}

    def pin_or_unpin(selection: KeySelection, pin: bool) -> dict:
        keys = selection.resolve()
        ttl_s = getattr(selection, "ttl_s", None)
        done = (view.engine.pin_many(keys, ttl_s=ttl_s) if pin else view.engine.unpin_many(keys)) if keys else []
        missing = [k.hex() for k, ok in zip(keys, done) if not ok]
        return {"requested": len(keys), "pinned" if pin else "unpinned": len(keys) - len(missing),
                "missing": missing}

    @router.post("/v1/pin")
    def pin(selection: PinSelection) -> dict:
        """Pin blocks: eviction reinserts them instead of dropping them. With 'ttl_s' a soft pin that expires
        by itself (memory only). Past the pinned-bytes limit: 507, nothing pinned. Absent keys come back in
        'missing'."""
        return pin_or_unpin(selection, True)

    @router.post("/v1/unpin")
    def unpin(selection: KeySelection) -> dict:
        """Unpin blocks: they age out like any other."""
        return pin_or_unpin(selection, False)

    @router.post("/v1/evict")
    def evict(request: EvictRequest) -> dict:
        """Drop blocks now: by key, by namespace, or all of them."""
        if request.keys is not None:
            keys = [bytes.fromhex(k) for k in request.keys]
            dropped = view.engine.delete_many(keys) if keys else []
            return {"scope": "keys", "requested": len(keys), "evicted_blocks": sum(map(bool, dropped))}
        ns_id = request.namespace_id_bytes()
        if ns_id is not None:
            return {"scope": "namespace", "namespace_id": ns_id.hex(),
                    "evicted_blocks": view.engine.delete_namespace(ns_id)}
        assert request.all, "EvictRequest validated exactly one form"
        return {"scope": "all", "evicted_blocks": view.engine.delete_all()}

    return router
