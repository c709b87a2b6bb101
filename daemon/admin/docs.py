"""The OpenAPI document and the interactive docs, behind the same auth as the API.

FastAPI's own ``/openapi.json``, ``/docs`` and ``/redoc`` are turned off and these
mounted instead, behind the gate (:mod:`.gate`) like every other route: a daemon with a
token answers them only to a request that carries it (and, without a token, only to
loopback clients).
"""
from __future__ import annotations

from fastapi import APIRouter, FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

OPENAPI_PATH = "/openapi.json"


def docs_router(app: FastAPI) -> APIRouter:
    """Routes for the OpenAPI document, Swagger UI and ReDoc (left out of the document)."""
    router = APIRouter(include_in_schema=False)

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
