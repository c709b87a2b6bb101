"""Who may use the admin API: the data port's token (bearer), or loopback only without one."""
from __future__ import annotations

import re

import httpx
import pytest
from starlette.routing import Route
from starlette.testclient import TestClient
from token_daemon import AUTH, TOKEN, open_state, token_daemon, token_http  # noqa: F401  (fixtures)

from kvtier.client import BlockClient, RemoteError
from kvtier.common.blockformat import encode_block
from kvtier.daemon.admin import AdminServer, AdminServerError
from kvtier.daemon.admin.app import build_app
from kvtier.daemon.admin.view import AdminStateView

PROTECTED = [("GET", "/v1/stats"), ("GET", "/v1/config"), ("GET", "/metrics"), ("GET", "/v1/blocks/" + "00" * 16),
             ("POST", "/v1/pin"), ("POST", "/v1/unpin"), ("POST", "/v1/evict"), ("POST", "/v1/lookup"),
             ("GET", "/v1/blocks/" + "00" * 16 + "/data"),
             ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc")]  # the API's description too
OPEN_PATHS = {"/healthz", "/readyz"}  # the probes (docs/operations.md): served to anyone
WALKED_AT_LEAST = {"/v1/stats", "/metrics", "/openapi.json", "/v1/blocks/{key_hex}/data", "/v1/keys", "/v1/preplace",
                   "/v1/kv-events/snapshot"}  # a walk that missed these would not be walking the app
PATH_PARAM = re.compile(r"\{[^}]*\}")


@pytest.mark.parametrize("method,path", PROTECTED)
def test_without_a_token_every_protected_endpoint_is_refused(token_http, method, path):
    resp = token_http.request(method, path, json={"all": True} if method == "POST" else None)
    assert resp.status_code == 401, resp.text
    assert resp.headers["www-authenticate"] == "Bearer"
    assert resp.json()["error"] == "unauthorized" and "Authorization" in resp.json()["message"]


@pytest.mark.parametrize("header,fragment", [
    (f"Bearer {TOKEN}x", "wrong token"),
    ("Bearer wrong", "wrong token"),
    (f"Basic {TOKEN}", "Bearer <token>"),
    ("Bearer", "Bearer <token>"),
])
def test_wrong_tokens_are_refused(token_http, header, fragment):
    resp = token_http.get("/v1/stats", headers={"Authorization": header})
    assert resp.status_code == 401
    assert fragment in resp.json()["message"]


def test_the_right_token_is_accepted_everywhere(token_http):
    assert token_http.get("/v1/stats", headers=AUTH).status_code == 200
    assert token_http.get("/metrics", headers=AUTH).text.startswith("# HELP")
    config = token_http.get("/v1/config", headers=AUTH).json()
    assert config["token_file"] == "<set>"
    assert TOKEN not in token_http.get("/v1/config", headers=AUTH).text, "the token never appears in the config"
    assert token_http.post("/v1/evict", headers=AUTH, json={"all": True}).status_code == 200


def test_the_api_docs_are_served_with_the_token(token_http):
    doc = token_http.get("/openapi.json", headers=AUTH).json()
    assert "/v1/stats" in doc["paths"] and "/openapi.json" not in doc["paths"]
    for path in ("/docs", "/redoc"):
        page = token_http.get(path, headers=AUTH)
        assert page.status_code == 200 and "/openapi.json" in page.text


def test_health_endpoints_need_no_token(token_http):
    assert token_http.get("/healthz").status_code == 200
    assert token_http.get("/readyz").status_code == 200


def test_the_data_port_takes_the_same_token(token_daemon):
    key = bytes(range(16))
    with BlockClient(token_daemon.data_addr, token=TOKEN) as client:
        client.put(key, encode_block(key, bytes(16), 0, b"with token"))
        assert client.get(key) is not None
    with pytest.raises(RemoteError):
        with BlockClient(token_daemon.data_addr, token="wrong") as client:
            client.get(key)


# -- in process: a real engine and state, the app's loopback rule ---------------------
@pytest.fixture
def state(tmp_path):
    s = open_state(tmp_path)
    yield s
    s.engine.close()


@pytest.fixture
def token_state(tmp_path):
    """A daemon's state whose token is ``TOKEN``, over a real engine."""
    (tmp_path / "token").write_text(TOKEN)
    s = open_state(tmp_path, token_file=str(tmp_path / "token"))
    yield s
    s.engine.close()


def _routes(routes, prefix: str = ""):
    """(path, methods) of every route, those of included routers too."""
    for route in routes:
        if isinstance(route, Route):
            yield prefix + route.path, route.methods
            continue
        included = getattr(route, "original_router", None)  # FastAPI keeps an included router whole
        assert included is not None, f"{route!r} is neither a route nor an included router: walk what it holds"
        yield from _routes(included.routes, prefix + route.include_context.prefix)


def test_every_route_but_the_probes_asks_for_the_token(token_state):
    app = build_app(AdminStateView(token_state))
    walked = set()
    with TestClient(app, client=("127.0.0.1", 40000)) as local:  # loopback too: a token binds everyone
        for template, methods in _routes(app.routes):
            path = PATH_PARAM.sub("00" * 16, template)
            for method in sorted(methods - {"HEAD"}):
                resp = local.request(method, path, json={"all": True} if method in ("POST", "PUT") else None)
                expected = 200 if template in OPEN_PATHS else 401
                assert resp.status_code == expected, (method, template, resp.text)
                walked.add(template)
    assert OPEN_PATHS | WALKED_AT_LEAST <= walked, sorted(walked)


def test_auth_is_checked_once_a_request(token_state, monkeypatch):
    view = AdminStateView(token_state)
    checked = []
    check_token = view.check_token
    monkeypatch.setattr(view, "check_token", lambda presented: checked.append(presented) or check_token(presented))
    app = build_app(view)
    with TestClient(app, client=("127.0.0.1", 40000)) as local:
        assert local.get("/v1/stats", headers=AUTH).status_code == 200
        assert local.post("/v1/pin", headers=AUTH, json={"keys": ["00" * 16]}).status_code == 200
        assert local.get("/healthz").status_code == 200
    assert checked == [TOKEN, TOKEN], "one check a request, by the gate; none for the probes"


def test_without_a_token_only_loopback_clients_are_served(state):
    app = build_app(AdminStateView(state))
    with TestClient(app, client=("192.0.2.7", 40000)) as remote:
        resp = remote.get("/v1/stats")
        assert resp.status_code == 403
        assert "loopback" in resp.json()["message"]
        assert remote.get("/healthz").status_code == 200
    with TestClient(app, client=("127.0.0.1", 40000)) as local:
        assert local.get("/v1/stats").status_code == 200
    with TestClient(app, client=("::1", 40000)) as local6:
        assert local6.get("/v1/stats").status_code == 200


def test_admin_server_refuses_a_public_address_without_a_token(state):
    with pytest.raises(AdminServerError, match="non-loopback"):
        AdminServer(state, "0.0.0.0", 0).start()


def test_admin_server_reports_a_busy_port(state):
    first = AdminServer(state, "127.0.0.1", 0)
    host, port = first.start()
    try:
        with pytest.raises(AdminServerError, match=f"127.0.0.1:{port}"):
            AdminServer(state, "127.0.0.1", port).start()
        assert httpx.get(f"http://{host}:{port}/healthz").status_code == 200
    finally:
        first.stop()
    first.stop()  # idempotent


def test_block_endpoints_refuse_while_not_ready(state):
    app = build_app(AdminStateView(state))
    state.set_ready(False)
    with TestClient(app, client=("127.0.0.1", 40000)) as local:
        ready = local.get("/readyz")
        assert ready.status_code == 503 and ready.json()["ready"] is False
        pin = local.post("/v1/pin", json={"keys": ["00" * 16]})
        assert pin.status_code == 503 and "not ready" in pin.json()["message"]
        assert local.get("/v1/stats").json()["ready"] is False
        assert local.get("/healthz").status_code == 200
    state.set_ready(True)
    with TestClient(app, client=("127.0.0.1", 40000)) as local:
        assert local.post("/v1/pin", json={"keys": ["00" * 16]}).json()["missing"] == ["00" * 16]
