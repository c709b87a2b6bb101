"""A small synchronous client of kvtierd's admin HTTP API (stdlib only).

Used by the ``kvtier`` CLI; usable from scripts::

    admin = AdminClient("127.0.0.1:7411", token=None)
    admin.stats()["tiers"]["warm"]["hit_ratio"]

Errors come back as :class:`AdminError` carrying the HTTP status and the
server's JSON message; a daemon that does not answer is an :class:`AdminError`
with status 0 naming the address.
"""
from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any

from kvtier.common.addresses import ADMIN_PORT_DEFAULT, format_address, parse_address

REQUEST_TIMEOUT_S = 30.0  # evicting a namespace on a large store can take a while
DEFAULT_ADMIN_ADDRESS = format_address("127.0.0.1", ADMIN_PORT_DEFAULT)


class AdminError(Exception):
    """The admin API refused a request (status > 0) or could not be reached (status 0)."""

    def __init__(self, status: int, message: str, body: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.body = body or {}


class AdminClient:
    def __init__(self, address: str = DEFAULT_ADMIN_ADDRESS, token: str | None = None,
                 timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        host, port = parse_address(address, what="admin address")
        if host in ("0.0.0.0", "::"):
            host = "127.0.0.1"  # a wildcard bind is reachable on loopback
        self.address = format_address(host, port)
        self.base_url = f"http://{self.address}"
        self._token = token
        self._timeout_s = timeout_s

    # -- plumbing --------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
                expect_json: bool = True):
        headers = {"Accept": "application/json"}
        data = None
        if raw is not None:
            data = raw
            headers["Content-Type"] = "application/octet-stream"
        elif body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        req = urllib.request.Request(self.base_url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self._timeout_s) as resp:
                payload = resp.read()
        except urllib.error.HTTPError as exc:
            raise _error_from_response(exc) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise AdminError(0, f"cannot reach the kvtierd admin API at {self.address}: {reason}") from None
        except http.client.HTTPException as exc:  # a peer that does not speak HTTP (a data port, say)
            raise AdminError(0, f"{self.address} did not answer as the kvtierd admin API does: "
                                f"{type(exc).__name__}") from None
        if not expect_json:
            return payload
        try:
            return json.loads(payload)
        except ValueError:
            raise AdminError(0, f"{self.address} answered {method} {path} with something other than "
                                "JSON: is it the kvtierd admin API?") from None

    # -- endpoints -------------------------------------------------------------------
    def healthz(self) -> dict:
        return self.request("GET", "/healthz")

    def readyz(self) -> dict:
        try:
            return self.request("GET", "/readyz")
        except AdminError as exc:
            if exc.status == 503:
                return {"ready": False, "message": exc.message}
            raise

    def stats(self) -> dict:
        return self.request("GET", "/v1/stats")

    def config(self) -> dict:
        return self.request("GET", "/v1/config")

    def devices(self) -> dict:
        return self.request("GET", "/v1/devices")

    def block_info(self, key: bytes) -> dict | None:
        try:
            return self.request("GET", f"/v1/blocks/{key.hex()}")
        except AdminError as exc:
            if exc.status == 404:
                return None
            raise

    def get_block(self, key: bytes) -> bytes | None:
        try:
            return self.request("GET", f"/v1/blocks/{key.hex()}/data", expect_json=False)
        except AdminError as exc:
            if exc.status == 404:
                return None
            raise

    def put_block(self, key: bytes, block: bytes, durable: bool = False) -> dict:
        suffix = "?durable=true" if durable else ""
        return self.request("PUT", f"/v1/blocks/{key.hex()}/data{suffix}", raw=block)

    def lookup(self, selection: dict) -> dict:
        return self.request("POST", "/v1/lookup", selection)

    def pin(self, selection: dict) -> dict:
        return self.request("POST", "/v1/pin", selection)

    def unpin(self, selection: dict) -> dict:
        return self.request("POST", "/v1/unpin", selection)

    def evict(self, request: dict) -> dict:
        return self.request("POST", "/v1/evict", request)


def _error_from_response(exc: urllib.error.HTTPError) -> AdminError:
    raw = exc.read()
    try:
        body = json.loads(raw)
        message = body.get("message") or body.get("detail") or raw.decode(errors="replace")
    except (ValueError, AttributeError):
        body, message = {}, raw.decode(errors="replace") or exc.reason
    return AdminError(exc.code, f"HTTP {exc.code}: {message}", body if isinstance(body, dict) else {})
