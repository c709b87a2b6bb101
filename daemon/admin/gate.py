"""The admin API's front door: who may send a request, and how big a body it may send, settled
before any of the body is read.

FastAPI reads and parses a JSON body before it runs a route's dependencies, so the auth
dependency alone would let any client make the daemon hold a body of any size. This ASGI
middleware answers first:

* a request that may not pass (:func:`.auth.auth_refusal`; the probes in ``PUBLIC_PATHS``
  excepted) gets its 401/403 before its body is read;
* a body over ``JSON_BODY_BYTES_MAX`` gets 413: at once when ``Content-Length`` says so, else
  as soon as the bytes received pass it. A block upload caps its own body at one region
  (:func:`.blocks.read_body_capped`).
"""
from __future__ import annotations

import re

from starlette.exceptions import HTTPException
from starlette.requests import Request

from kvtier.daemon.admin.auth import PUBLIC_PATHS, auth_refusal
from kvtier.daemon.admin.errors import error_response
from kvtier.daemon.admin.view import AdminStateView

JSON_BODY_BYTES_MAX = 64 << 20  # 4 Mi tokens of up to 10 digits and a separator, with room for keys
BLOCK_UPLOAD_PATH = re.compile(r"^/v1/blocks/[^/]+/data$")


class RequestGate:
    """ASGI middleware: auth, then a bounded body, for every HTTP request of the admin app."""

    def __init__(self, app, view: AdminStateView) -> None:
        self.app = app
        self._view = view

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        refusal = None if scope["path"] in PUBLIC_PATHS else auth_refusal(self._view, request)
        if refusal is not None:
            response = error_response(refusal.status_code, refusal.detail)
            response.headers.update(refusal.headers or {})
            await response(scope, receive, send)
            return
        if scope["method"] == "PUT" and BLOCK_UPLOAD_PATH.match(scope["path"]):
            await self.app(scope, receive, send)
            return
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > JSON_BODY_BYTES_MAX:
            await error_response(413, f"body of {declared} bytes is over the limit of {JSON_BODY_BYTES_MAX} "
                                      "bytes")(scope, receive, send)
            return
        await self.app(scope, _capped(receive), send)


def _capped(receive):
    """``receive`` that raises 413 once the body passes ``JSON_BODY_BYTES_MAX``."""
    received = 0

    async def capped_receive():
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > JSON_BODY_BYTES_MAX:
                raise HTTPException(413, f"body is over the limit of {JSON_BODY_BYTES_MAX} bytes")
        return message

    return capped_receive
