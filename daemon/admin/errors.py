"""Every admin API error as JSON: ``{"error": <kind>, "message": <what is wrong>}``.

HTTP errors, request validation failures and engine exceptions all pass
through here, so a client always gets a machine-readable kind and a message
that names the problem. A client that leaves in the middle of its body is its own
doing: a 400 nobody reads. An unexpected exception here is a 500 for that request, logged and
counted; the engine fails itself closed only for a bug in its own state (EngineFailedError, 503).
"""
from __future__ import annotations

import logging
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvtier.daemon.engine.errors import (DeviceError, EngineBugError, EngineError, EngineFailedError, NoSpaceError,
                                         WaitTimeoutError)

log = logging.getLogger("kvtier.admin")

ERROR_KINDS = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
               405: "method_not_allowed", 413: "too_large", 422: "invalid_request", 500: "internal",
               503: "unavailable", 507: "no_space"}


def error_response(status: int, message: str, **extra) -> JSONResponse:
    body = {"error": ERROR_KINDS.get(status, "error"), "message": message, **extra}
    return JSONResponse(body, status_code=status)


def validation_message(exc: RequestValidationError) -> str:
    """``keys.0: String should match pattern ...; tokens: ...`` from pydantic's error list."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI, on_internal_error: Callable[[str], None] | None = None) -> None:
    """``on_internal_error``: told of an unexpected exception (the daemon counts it)."""
    @app.exception_handler(StarletteHTTPException)  # FastAPI's HTTPException is a subclass
    async def _http_error(request: Request, exc: StarletteHTTPException):
        response = error_response(exc.status_code, str(exc.detail))
        for name, value in (getattr(exc, "headers", None) or {}).items():
            response.headers[name] = value
        return response

    @app.exception_handler(ClientDisconnect)
    async def _client_left(request: Request, exc: ClientDisconnect):  # the client's doing, not the daemon's
        log.info("admin request %s %s: the client closed the connection before its whole body came",
                 request.method, request.url.path)
        return error_response(400, "the connection closed before the whole request body came")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(422, validation_message(exc))

    @app.exception_handler(NoSpaceError)
    async def _no_space(request: Request, exc: NoSpaceError):
        return error_response(507, str(exc))

    @app.exception_handler(EngineFailedError)
    async def _failed(request: Request, exc: EngineFailedError):
        return error_response(500 if isinstance(exc, EngineBugError) else 503, str(exc))

    @app.exception_handler(DeviceError)
    async def _device_error(request: Request, exc: DeviceError):
        log.error("admin request %s %s failed: %s", request.method, request.url.path, exc)
        return error_response(503, str(exc), error="device_error")

    @app.exception_handler(WaitTimeoutError)
    async def _wait_timeout(request: Request, exc: WaitTimeoutError):
        return error_response(503, str(exc), error="busy")

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError):
        log.warning("admin request %s %s refused: %s", request.method, request.url.path, exc)
        return error_response(400, str(exc))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("admin request %s %s crashed", request.method, request.url.path)
        if on_internal_error is not None:
            on_internal_error(f"{type(exc).__name__} in admin {request.method} {request.url.path}: {exc}")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
