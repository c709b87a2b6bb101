"""The admin API settles who may send a request and how big its body may be before it reads the body,
and takes JSON values of the declared types only (a real kvtierd with a token, real HTTP)."""
from __future__ import annotations

import asyncio
import socket

import pytest
from token_daemon import AUTH, open_state, token_daemon, token_http  # noqa: F401  (fixtures)

from kvtier.common.blockformat import encode_block
from kvtier.daemon.admin.app import build_app
from kvtier.daemon.admin.gate import JSON_BODY_BYTES_MAX
from kvtier.daemon.admin.view import AdminStateView
ANSWER_TIMEOUT_S = 10.0  # a refusal comes at once; the old behaviour waited for the whole body
DECLARED_BODY_BYTES = 1 << 30  # a body far too large to be read before the answer
SENT_PREFIX = b'{"keys": ["' + b"0" * 1000
BLOCK_PATH = "/v1/blocks/" + "00" * 16 + "/data"
REGION_BYTES = 4 << 20  # daemon_proc's default region: no block reaches it


def _answer_to_a_partial_body(daemon, path: str, declared: int, headers: dict, *, method: str = "POST",
                              sent: bytes = SENT_PREFIX) -> bytes:
    """Send the request line, headers declaring ``declared`` bytes and ``sent`` of them; the answer."""
    host, port = daemon.admin_addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=ANSWER_TIMEOUT_S) as sock:
        lines = [f"{method} {path} HTTP/1.1", f"Host: {daemon.admin_addr}", "Content-Type: application/json",
                 f"Content-Length: {declared}", *(f"{k}: {v}" for k, v in headers.items())]
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + sent)
        return _read_response(sock)


def _read_response(sock: socket.socket) -> bytes:
    """Status line, headers and the body its Content-Length names (what came before a timeout)."""
    answer = b""
    try:
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(4096)
            if not chunk:
                return answer
            answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length:
            chunk = sock.recv(4096)
            if not chunk:
                break
            body += chunk
        return head + b"\r\n\r\n" + body
    except TimeoutError:
        return answer


@pytest.mark.parametrize("path", ["/v1/lookup", "/v1/evict", "/v1/pin", "/v1/nowhere"])
def test_an_unauthenticated_request_is_refused_before_its_body_is_read(token_daemon, path):
    answer = _answer_to_a_partial_body(token_daemon, path, DECLARED_BODY_BYTES, {})
    assert answer.startswith(b"HTTP/1.1 401"), f"no 401 within {ANSWER_TIMEOUT_S} s: {answer[:200]!r}"
    assert b"Authorization" in answer and b"connection: close" in answer.lower()


def test_a_json_body_over_the_limit_is_refused_before_it_is_read(token_daemon):
    answer = _answer_to_a_partial_body(token_daemon, "/v1/lookup", JSON_BODY_BYTES_MAX + 1, AUTH)
    assert answer.startswith(b"HTTP/1.1 413"), f"no 413 within {ANSWER_TIMEOUT_S} s: {answer[:200]!r}"
    assert str(JSON_BODY_BYTES_MAX).encode() in answer


@pytest.mark.parametrize("expect", [{}, {"Expect": "100-continue"}])
def test_a_block_upload_over_a_region_is_refused_before_it_is_read_and_the_connection_closed(token_daemon, expect):
    answer = _answer_to_a_partial_body(token_daemon, BLOCK_PATH, REGION_BYTES + 1, {**AUTH, **expect}, method="PUT",
                                       sent=b"" if expect else SENT_PREFIX)
    assert answer.startswith(b"HTTP/1.1 413"), f"no 413 within {ANSWER_TIMEOUT_S} s: {answer[:200]!r}"
    assert b"the largest block a region holds" in answer and b"connection: close" in answer.lower()


def test_an_upload_that_expects_100_continue_gets_it_once_it_may_send(token_daemon):
    answer = _answer_to_a_partial_body(token_daemon, BLOCK_PATH, 1000, {**AUTH, "Expect": "100-continue"},
                                       method="PUT", sent=b"")
    assert answer.startswith(b"HTTP/1.1 100"), answer[:200]


def test_a_client_that_leaves_in_the_middle_of_an_upload_does_not_fail_the_engine(tmp_path):
    state = open_state(tmp_path)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "PUT", "scheme": "http",
             "path": BLOCK_PATH, "raw_path": BLOCK_PATH.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"kvtierd"), (b"content-length", b"1000")],
             "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 7411)}
    received = iter([{"type": "http.request", "body": b"x" * 10, "more_body": True}, {"type": "http.disconnect"}])
    sent = []

    async def receive():
        return next(received)

    async def send(message):
        sent.append(message)

    try:
        asyncio.run(build_app(AdminStateView(state))(scope, receive, send))
        assert sent[0]["status"] == 400, sent
        assert state.engine.get(bytes(16)) is None, "the engine still serves: it was not failed"
    finally:
        state.engine.close()


def test_a_streamed_json_body_over_the_limit_is_refused(token_http):
    chunk = b" " * (1 << 20)

    def body():
        for _ in range(JSON_BODY_BYTES_MAX // len(chunk) + 2):
            yield chunk

    resp = token_http.post("/v1/lookup", content=body(), headers={**AUTH, "Content-Type": "application/json"})
    assert resp.status_code == 413, resp.text
    assert resp.json()["error"] == "too_large" and str(JSON_BODY_BYTES_MAX) in resp.json()["message"]
    assert token_http.get("/v1/stats", headers=AUTH).status_code == 200


def _store_one(http) -> str:
    key = bytes(range(16))
    block = encode_block(key, bytes(16), 0, b"keep me" * 100)
    assert http.put(f"/v1/blocks/{key.hex()}/data", content=bytes(block), headers=AUTH).status_code == 200
    return key.hex()


@pytest.mark.parametrize("body", [{"all": "yes"}, {"all": 1}, {"keys": "00" * 16}])
def test_evict_takes_values_of_the_declared_types_only(token_http, body):
    key = _store_one(token_http)
    resp = token_http.post("/v1/evict", json=body, headers=AUTH)
    assert resp.status_code == 422, resp.text
    assert token_http.get(f"/v1/blocks/{key}", headers=AUTH).status_code == 200, "a refused evict dropped a block"


@pytest.mark.parametrize("layout_field, tokens", [("num_layers", [1, 2]), (None, [True, 2]), (None, ["1", 2]),
                                                   (None, [1.0, 2])])
def test_namespace_and_tokens_are_not_coerced(token_http, layout_field, tokens):
    layout = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "block_tokens": 1}
    if layout_field is not None:
        layout[layout_field] = True
    resp = token_http.post("/v1/lookup", json={"namespace": {"model": "m", "layout": layout}, "tokens": tokens},
                           headers=AUTH)
    assert resp.status_code == 422, resp.text
