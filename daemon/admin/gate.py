"""The admin API's front door: who may send a request, and how big a body it may send, settled
before any of the body is read. It is the one place auth is checked: no route repeats it.

FastAPI reads and parses a JSON body before it runs a route's dependencies, so an auth
dependency would let any client make the daemon hold a body of any size. This ASGI
middleware answers first:

* a request that may not pass (:func:`.auth.auth_refusal`; the probes in ``PUBLIC_PATHS``
  excepted) gets its 401/403 before its body is read;
* a body over its limit gets 413: at once when ``Content-Length`` says so, else as soon as
  the bytes received pass it. The limit is ``JSON_BODY_BYTES_MAX``, or for a block upload
  the largest block a region holds (at most ``BLOCK_UPLOAD_BYTES_MAX``).

An answer given before the body is read (or before all of it) carries ``Connection: close``:
the rest of that body stays unread, so the connection cannot carry another request. A client
that sends ``Expect: 100-continue`` gets such an answer before it sends any of the body; the
``100 Continue`` goes out only once a route starts reading.
"""
from __future__ import annotations

import re

from starlette.exceptions import HTTPException
from starlette.requests import Request

from kvtier.daemon.admin.auth import PUBLIC_PATHS, auth_refusal
from kvtier.daemon.admin.errors import error_response
from kvtier.daemon.admin.view import AdminStateView

JSON_BODY_BYTES_MAX = 64 << 20  # 4 Mi tokens of up to 10 digits and a separator, with room for keys
BLOCK_UPLOAD_BYTES_MAX = 1 << 30  # a block must fit one region; regions are at most this big
BLOCK_UPLOAD_PATH = re.compile(r"^/v1/blocks/[^/]+/data$")
BLOCK_LIMIT_REASON = " (the largest block a region holds)"


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
            await _refusal_before_the_body(refusal.status_code, refusal.detail, refusal.headers)(scope, receive, send)
            return
        limit_bytes, reason = self._body_limit(scope)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit_bytes:
            message = f"body of {declared} bytes is over the limit of {limit_bytes} bytes{reason}"
            await _refusal_before_the_body(413, message)(scope, receive, send)
            return
        await self.app(scope, _capped(receive, limit_bytes, reason), send)

    def _body_limit(self, scope) -> tuple[int, str]:
        """The most bytes the request's body may have, and what the limit is (for the 413)."""
        if scope["method"] == "PUT" and BLOCK_UPLOAD_PATH.match(scope["path"]):
            return min(BLOCK_UPLOAD_BYTES_MAX, self._view.engine.block_size_max_bytes), BLOCK_LIMIT_REASON
        return JSON_BODY_BYTES_MAX, ""


def _refusal_before_the_body(status: int, message: str, headers: dict | None = None):
    """The JSON error for a request whose body will not be read: the connection closes after it."""
    response = error_response(status, message)
    response.headers.update(headers or {})
    response.headers["Connection"] = "close"
    return response


def _capped(receive, limit_bytes: int, reason: str):
    """``receive`` that raises 413 once the body passes ``limit_bytes``."""
    received = 0

    async def capped_receive():
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit_bytes:
                raise HTTPException(413, f"body is over the limit of {limit_bytes} bytes{reason}",
                                    headers={"Connection": "close"})  # the rest of the body stays unread
        return message

    return capped_receive
