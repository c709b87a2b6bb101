"""Who may use the admin API: the data port's token (bearer), or loopback only without one."""
from __future__ import annotations

import httpx
import pytest
from daemon_proc import start_kvtierd
from starlette.testclient import TestClient

from kvtier.client import BlockClient, RemoteError
from kvtier.common.blockformat import encode_block
from kvtier.daemon.admin import AdminServer, AdminServerError
from kvtier.daemon.admin.app import build_app
from kvtier.daemon.admin.view import AdminStateView
from kvtier.daemon.config import DaemonConfig
from kvtier.daemon.engine import Engine
from kvtier.daemon.state import DaemonState

TOKEN = "s3cret-token-for-tests"
PROTECTED = [("GET", "/v1/stats"), ("GET", "/v1/config"), ("GET", "/metrics"), ("GET", "/v1/blocks/" + "00" * 16),
             ("POST", "/v1/pin"), ("POST", "/v1/unpin"), ("POST", "/v1/evict"), ("POST", "/v1/lookup"),
             ("GET", "/v1/blocks/" + "00" * 16 + "/data"),
             ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc")]  # the API's description too


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("auth")
    token_file = root / "token"
    token_file.write_text(TOKEN + "\n")
    d = start_kvtierd(root / "store", "--token-file", str(token_file), admin="127.0.0.1:0")
    yield d
    assert d.stop() == 0, d.log_tail()


@pytest.fixture(scope="module")
def http(daemon):
    with httpx.Client(base_url=f"http://{daemon.admin_addr}", timeout=30) as client:
        yield client


@pytest.mark.parametrize("method,path", PROTECTED)
def test_without_a_token_every_protected_endpoint_is_refused(http, method, path):
    resp = http.request(method, path, json={"all": True} if method == "POST" else None)
    assert resp.status_code == 401, resp.text
    assert resp.headers["www-authenticate"] == "Bearer"
    assert resp.json()["error"] == "unauthorized" and "Authorization" in resp.json()["message"]


@pytest.mark.parametrize("header,fragment", [
    (f"Bearer {TOKEN}x", "wrong token"),
    ("Bearer wrong", "wrong token"),
    (f"Basic {TOKEN}", "Bearer <token>"),
    ("Bearer", "Bearer <token>"),
])
def test_wrong_tokens_are_refused(http, header, fragment):
    resp = http.get("/v1/stats", headers={"Authorization": header})
    assert resp.status_code == 401
    assert fragment in resp.json()["message"]


def test_the_right_token_is_accepted_everywhere(http, daemon):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert http.get("/v1/stats", headers=auth).status_code == 200
    assert http.get("/metrics", headers=auth).text.startswith("# HELP")
    config = http.get("/v1/config", headers=auth).json()
    assert config["token_file"] == "<set>"
    assert TOKEN not in http.get("/v1/config", headers=auth).text, "the token never appears in the config"
    assert http.post("/v1/evict", headers=auth, json={"all": True}).status_code == 200


def test_the_api_docs_are_served_with_the_token(http):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    doc = http.get("/openapi.json", headers=auth).json()
    assert "/v1/stats" in doc["paths"] and "/openapi.json" not in doc["paths"]
    for path in ("/docs", "/redoc"):
        page = http.get(path, headers=auth)
        assert page.status_code == 200 and "/openapi.json" in page.text


def test_health_endpoints_need_no_token(http):
    assert http.get("/healthz").status_code == 200
    assert http.get("/readyz").status_code == 200


def test_the_data_port_takes_the_same_token(daemon):
    key = bytes(range(16))
    with BlockClient(daemon.data_addr, token=TOKEN) as client:
        client.put(key, encode_block(key, bytes(16), 0, b"with token"))
        assert client.get(key) is not None
    with pytest.raises(RemoteError):
        with BlockClient(daemon.data_addr, token="wrong") as client:
            client.get(key)


# -- in process: a real engine and state, the app's loopback rule ---------------------
@pytest.fixture
def state(tmp_path):
    cfg = DaemonConfig(data_dir=str(tmp_path), device_size_bytes=8 << 20, stripe_size_bytes=64 << 10,
                       region_size_bytes=1 << 20)
    engine = Engine.open(cfg.engine_config(), create_if_missing=True)
    s = DaemonState(cfg, engine)
    s.set_ready(True)
    yield s
    engine.close()


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
