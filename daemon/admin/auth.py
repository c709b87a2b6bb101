"""Who may use the admin API.

* The daemon has a token (``token_file``): every request except /healthz and
  /readyz carries ``Authorization: Bearer <token>`` — the data port's token. The
  token is read per request, so a SIGHUP reload takes effect at once.
* No token: only loopback clients are served.

:class:`.gate.RequestGate` applies this to every request, before its body is read; no route
checks it again.
"""
from __future__ import annotations

from fastapi import HTTPException, Request

from kvtier.daemon.admin.view import AdminStateView
from kvtier.daemon.config import is_loopback as is_loopback_host

AUTH_SCHEME = "bearer"
PUBLIC_PATHS = frozenset({"/healthz", "/readyz"})  # probes: served to anyone


def _is_loopback_client(request: Request) -> bool:
    client = request.client
    return client is not None and is_loopback_host(client.host)


def auth_refusal(view: AdminStateView, request: Request) -> HTTPException | None:
    """The 401/403 for a request that may not pass, or None."""
    token = view.token()
    if token is None:
        if not _is_loopback_client(request):
            return HTTPException(403, "the admin API has no token configured and serves loopback clients only")
        return None
    header = request.headers.get("authorization")
    if header is None:
        return HTTPException(401, "missing 'Authorization: Bearer <token>' header",
                             headers={"WWW-Authenticate": "Bearer"})
    scheme, _, presented = header.partition(" ")
    if scheme.lower() != AUTH_SCHEME or not presented:
        return HTTPException(401, "the Authorization header must be 'Bearer <token>'",
                             headers={"WWW-Authenticate": "Bearer"})
    if not view.check_token(presented.strip()):
        return HTTPException(401, "wrong token", headers={"WWW-Authenticate": "Bearer"})
    return None
