"""A small synchronous client of kvtierd's admin HTTP API (stdlib only).

Used by the ``kvtier`` CLI; usable from scripts::

    admin = AdminClient("127.0.0.1:7411", token=None)
    admin.stats()["tiers"]["warm"]["hit_ratio"]

Errors come back as :class:`AdminError` carrying the HTTP status and the
server's JSON message; a daemon that does not answer is an :class:`AdminError`
with status 0 naming the address.

A large body (``EXPECT_CONTINUE_BYTES_MIN`` or more) is sent the way RFC 9110 section 10.1.1
describes: the headers with ``Expect: 100-continue`` first, the body only once the daemon
says ``100 Continue``. A request the daemon refuses before reading its body (a bad token, a
body over the limit) gets its answer instead, and no byte of the body is sent. A server that
closes the connection while the body is still being sent has its answer read all the same.
"""
from __future__ import annotations

import http.client
import json
import re
import socket
from typing import Any

from kvtier.common.addresses import ADMIN_PORT_DEFAULT, format_address, parse_address

REQUEST_TIMEOUT_S = 30.0  # evicting a namespace on a large store can take a while
DEFAULT_ADMIN_ADDRESS = format_address("127.0.0.1", ADMIN_PORT_DEFAULT)
EXPECT_CONTINUE_BYTES_MIN = 1 << 20  # as curl: below this the extra round trip costs more than a refusal does
CONTINUE_WAIT_S = 1.0  # a server that ignores Expect stays silent; send the body after this (RFC 9110 10.1.1)
CONTINUE_STATUS = re.compile(rb"HTTP/1\.[01] 100 ")
STATUS_PREFIX_BYTES = len(b"HTTP/1.1 100 ")


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
        self._host, self._port = host, port
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
        conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)
        try:
            status, payload = self._exchange(conn, method, path, headers, data)
        except OSError as exc:
            raise AdminError(0, f"cannot reach the kvtierd admin API at {self.address}: {exc}") from None
        except http.client.HTTPException as exc:  # a peer that does not speak HTTP (a data port, say)
            raise AdminError(0, f"{self.address} did not answer as the kvtierd admin API does: "
                                f"{type(exc).__name__}") from None
        finally:
            conn.close()
        if not 200 <= status < 300:
            raise _error_from_response(status, payload)
        if not expect_json:
            return payload
        try:
            return json.loads(payload)
        except ValueError:
            raise AdminError(0, f"{self.address} answered {method} {path} with something other than "
                                "JSON: is it the kvtierd admin API?") from None

    def _exchange(self, conn: http.client.HTTPConnection, method: str, path: str, headers: dict,
                  data: bytes | None) -> tuple[int, bytes]:
        """Send one request and read its answer: (status, body)."""
        expect_continue = data is not None and len(data) >= EXPECT_CONTINUE_BYTES_MIN
        conn.putrequest(method, path)
        for name, value in headers.items():
            conn.putheader(name, value)
        if data is not None:
            conn.putheader("Content-Length", str(len(data)))
        if expect_continue:
            conn.putheader("Expect", "100-continue")
        conn.endheaders()
        if data is not None and (not expect_continue or not _answered_before_the_body(conn.sock, conn.timeout)):
            try:
                conn.send(data)
            except (BrokenPipeError, ConnectionResetError) as exc:  # it answered and closed: read that answer
                return self._answer_after_a_cut_body(conn, len(data), exc)
        response = conn.getresponse()
        return response.status, response.read()

    def _answer_after_a_cut_body(self, conn: http.client.HTTPConnection, size_bytes: int,
                                 cut: OSError) -> tuple[int, bytes]:
        """The answer a server sent before it closed the connection on a body it would not read."""
        try:
            response = conn.getresponse()
            return response.status, response.read()
        except (OSError, http.client.HTTPException):
            raise AdminError(0, f"{self.address} closed the connection while the {size_bytes}-byte request body "
                                f"was being sent ({cut.strerror or cut}) and gave no answer: it may refuse a body "
                                "that large") from None

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


def _answered_before_the_body(sock: socket.socket, timeout_s: float | None) -> bool:
    """After headers with ``Expect: 100-continue``: True when the server has given its final answer
    already (the body is not to be sent). False when it said ``100 Continue`` (``getresponse`` skips
    that head later), stayed silent ``CONTINUE_WAIT_S``, or sent too little yet to tell."""
    sock.settimeout(CONTINUE_WAIT_S)
    try:
        status = sock.recv(STATUS_PREFIX_BYTES, socket.MSG_PEEK)  # left in place for getresponse
    except TimeoutError:
        return False
    finally:
        sock.settimeout(timeout_s)
    return len(status) == STATUS_PREFIX_BYTES and not CONTINUE_STATUS.match(status)


def _error_from_response(status: int, raw: bytes) -> AdminError:
    try:
        body = json.loads(raw)
        message = body.get("message") or body.get("detail") or raw.decode(errors="replace")
    except (ValueError, AttributeError):
        body, message = {}, raw.decode(errors="replace") or http.client.responses.get(status, "error")
    return AdminError(status, f"HTTP {status}: {message}", body if isinstance(body, dict) else {})
