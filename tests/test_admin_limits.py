"""The admin API settles who may send a request and how big its body may be before it reads the body,
and takes JSON values of the declared types only (a real kvtierd with a token, real HTTP)."""
from __future__ import annotations

import socket

import httpx
import pytest
from daemon_proc import start_kvtierd

from kvtier.common.blockformat import encode_block
from kvtier.daemon.admin.gate import JSON_BODY_BYTES_MAX

TOKEN = "limits-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ANSWER_TIMEOUT_S = 10.0  # a refusal comes at once; the old behaviour waited for the whole body
DECLARED_BODY_BYTES = 1 << 30  # a body far too large to be read before the answer
SENT_PREFIX = b'{"keys": ["' + b"0" * 1000


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("limits")
    (root / "token").write_text(TOKEN)
    d = start_kvtierd(root / "store", "--token-file", str(root / "token"), admin="127.0.0.1:0")
    yield d
    assert d.stop() == 0, d.log_tail()


@pytest.fixture(scope="module")
def http(daemon):
    with httpx.Client(base_url=f"http://{daemon.admin_addr}", timeout=30) as client:
        yield client


def _answer_to_a_partial_body(daemon, path: str, declared: int, headers: dict) -> bytes:
    """Send the request line, headers declaring ``declared`` bytes and a small part of them; the answer."""
    host, port = daemon.admin_addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=ANSWER_TIMEOUT_S) as sock:
        lines = [f"POST {path} HTTP/1.1", f"Host: {daemon.admin_addr}", "Content-Type: application/json",
                 f"Content-Length: {declared}", *(f"{k}: {v}" for k, v in headers.items())]
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + SENT_PREFIX)
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
def test_an_unauthenticated_request_is_refused_before_its_body_is_read(daemon, path):
    answer = _answer_to_a_partial_body(daemon, path, DECLARED_BODY_BYTES, {})
    assert answer.startswith(b"HTTP/1.1 401"), f"no 401 within {ANSWER_TIMEOUT_S} s: {answer[:200]!r}"
    assert b"Authorization" in answer


def test_a_json_body_over_the_limit_is_refused_before_it_is_read(daemon):
    answer = _answer_to_a_partial_body(daemon, "/v1/lookup", JSON_BODY_BYTES_MAX + 1, AUTH)
    assert answer.startswith(b"HTTP/1.1 413"), f"no 413 within {ANSWER_TIMEOUT_S} s: {answer[:200]!r}"
    assert str(JSON_BODY_BYTES_MAX).encode() in answer


def test_a_streamed_json_body_over_the_limit_is_refused(http):
    chunk = b" " * (1 << 20)

    def body():
        for _ in range(JSON_BODY_BYTES_MAX // len(chunk) + 2):
            yield chunk

    resp = http.post("/v1/lookup", content=body(), headers={**AUTH, "Content-Type": "application/json"})
    assert resp.status_code == 413, resp.text
    assert resp.json()["error"] == "too_large" and str(JSON_BODY_BYTES_MAX) in resp.json()["message"]
    assert http.get("/v1/stats", headers=AUTH).status_code == 200


def _store_one(http) -> str:
    key = bytes(range(16))
    block = encode_block(key, bytes(16), 0, b"keep me" * 100)
    assert http.put(f"/v1/blocks/{key.hex()}/data", content=bytes(block), headers=AUTH).status_code == 200
    return key.hex()


@pytest.mark.parametrize("body", [{"all": "yes"}, {"all": 1}, {"keys": "00" * 16}])
def test_evict_takes_values_of_the_declared_types_only(http, body):
    key = _store_one(http)
    resp = http.post("/v1/evict", json=body, headers=AUTH)
    assert resp.status_code == 422, resp.text
    assert http.get(f"/v1/blocks/{key}", headers=AUTH).status_code == 200, "a refused evict dropped a block"


@pytest.mark.parametrize("layout_field, tokens", [("num_layers", [1, 2]), (None, [True, 2]), (None, ["1", 2]),
                                                   (None, [1.0, 2])])
def test_namespace_and_tokens_are_not_coerced(http, layout_field, tokens):
    layout = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "block_tokens": 1}
    if layout_field is not None:
        layout[layout_field] = True
    resp = http.post("/v1/lookup", json={"namespace": {"model": "m", "layout": layout}, "tokens": tokens},
                     headers=AUTH)
    assert resp.status_code == 422, resp.text
