"""The OpenAPI document and the interactive docs, behind the same auth as the API.

FastAPI serves ``/openapi.json``, ``/docs`` and ``/redoc`` without any
dependency; the app turns those off and mounts these instead, so a daemon with a
token answers them only to a request that carries it (and, without a token,
only to loopback clients, like every other route).
"""
from __future__ import annotations

from fastapi import APIRouter, FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

OPENAPI_PATH = "/openapi.json"


def docs_router(app: FastAPI, auth: list) -> APIRouter:
    """Routes for the OpenAPI document, Swagger UI and ReDoc, each behind ``auth``."""
    router = APIRouter(dependencies=auth, include_in_schema=False)

    @router.get(OPENAPI_PATH)
    def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @router.get("/docs")
    def swagger() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=OPENAPI_PATH, title=f"{app.title} - docs")

    @router.get("/redoc")
    def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url=OPENAPI_PATH, title=f"{app.title} - ReDoc")

    return router
