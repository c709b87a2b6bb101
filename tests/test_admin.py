"""The admin HTTP API against a real kvtierd (no token: loopback clients only).

Each endpoint is exercised with real blocks put over the data port, and every
kind of bad input gets its JSON error while the daemon keeps serving.
"""
from __future__ import annotations

import time

import httpx
import pytest
from daemon_proc import start_kvtierd

from kvtier.client import BlockClient
from kvtier.common.blockformat import HEADER_SIZE, encode_block, payload_of, verify_block
from kvtier.common.keys import KVLayout, Namespace
from kvtier.daemon.admin.models import KEYS_PER_REQUEST_MAX
from kvtier.common.codec_ids import codec_id

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=4)
NS = Namespace("test-model", LAYOUT, "raw")
NS_SPEC = {"model": "test-model", "codec": "raw",
           "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "dtype": "float16", "block_tokens": 4}}
TOKENS = list(range(100, 116))  # 4 full blocks of 4 tokens


def _payload(i: int, size: int = 3000) -> bytes:
    return bytes((i * 7 + j) & 0xFF for j in range(size))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_kvtierd(tmp_path_factory.mktemp("admin"), admin="127.0.0.1:0")
    yield d
    code = d.stop()
    assert code == 0, d.log_tail()


@pytest.fixture(scope="module")
def http(daemon):
    with httpx.Client(base_url=f"http://{daemon.admin_addr}", timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def data(daemon):
    with BlockClient(daemon.data_addr) as client:
        yield client


def _put_chain(data: BlockClient, count: int) -> list[bytes]:
    """The first ``count`` blocks of TOKENS' chain, put over the data port."""
    keys = NS.keys(TOKENS)[:count]
    for i, key in enumerate(keys):
        data.put(key, encode_block(key, NS.id, codec_id("raw"), _payload(i)))
    return keys


def _assert_error(resp: httpx.Response, status: int, *fragments: str) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert isinstance(body["error"], str) and isinstance(body["message"], str)
    for fragment in fragments:
        assert fragment in body["message"], body
    return body


def test_healthz_and_readyz(http):
    health = http.get("/healthz")
    assert health.status_code == 200
    assert health.json()["status"] == "ok" and health.json()["uptime_s"] >= 0
    ready = http.get("/readyz")
    assert ready.status_code == 200 and ready.json() == {"status": "ready", "ready": True}


def test_openapi_lists_every_endpoint(http):
    doc = http.get("/openapi.json").json()
    expected = {"/healthz", "/readyz", "/v1/stats", "/v1/blocks/{key_hex}", "/v1/blocks/{key_hex}/data",
                "/v1/lookup", "/v1/pin", "/v1/unpin", "/v1/evict", "/v1/config", "/metrics"}
    assert expected <= set(doc["paths"])
    assert "post" in doc["paths"]["/v1/evict"] and "put" in doc["paths"]["/v1/blocks/{key_hex}/data"]
    assert http.get("/docs").status_code == 200


def test_block_info_of_a_block_put_over_the_data_port(http, data):
    before = time.time()
    keys = _put_chain(data, 2)
    assert data.get(keys[0]) is not None  # touches the region
    info = http.get(f"/v1/blocks/{keys[1].hex()}")
    assert info.status_code == 200, info.text
    doc = info.json()
    assert doc["key"] == keys[1].hex() and doc["present"] is True
    assert doc["size_bytes"] == HEADER_SIZE + len(_payload(1))
    assert doc["codec"] == "raw" and doc["codec_id"] == codec_id("raw")
    assert doc["ns_id"] == NS.id.hex()
    assert doc["pinned"] is False
    assert isinstance(doc["region"], int) and doc["seq"] > 0
    assert before - 5 <= doc["region_last_access"] <= time.time() + 5


def test_block_info_unknown_and_malformed_keys(http):
    absent = _assert_error(http.get("/v1/blocks/" + "ab" * 16), 404, "not stored")
    assert absent["present"] is False and absent["key"] == "ab" * 16
    _assert_error(http.get("/v1/blocks/abc"), 400, "32 hex digits")
    _assert_error(http.get("/v1/blocks/" + "zz" * 16), 400, "not hexadecimal")


def test_block_data_roundtrip_between_admin_and_data_port(http, data):
    key = bytes(range(50, 66))
    block = encode_block(key, NS.id, codec_id("int8"), _payload(9, 5000))
    put = http.put(f"/v1/blocks/{key.hex()}/data", content=block, params={"durable": "true"})
    assert put.status_code == 200, put.text
    assert put.json()["size_bytes"] == len(block) and put.json()["durable"] is True
    got = data.get(key)
    assert got is not None and bytes(payload_of(got)) == _payload(9, 5000)
    assert verify_block(got, expected_key=key).seq == put.json()["seq"]
    via_admin = http.get(f"/v1/blocks/{key.hex()}/data")
    assert via_admin.status_code == 200
    assert via_admin.headers["content-type"] == "application/octet-stream"
    assert via_admin.content == bytes(got)


def test_block_data_put_bad_input(http, data, daemon):
    key = bytes(range(16))
    other = bytes(range(1, 17))
    good = encode_block(key, NS.id, 0, b"payload")
    _assert_error(http.put(f"/v1/blocks/{key.hex()}/data", content=b"garbage"), 400, "not a valid block")
    _assert_error(http.put(f"/v1/blocks/{other.hex()}/data", content=good), 400, "not the expected")
    corrupt = bytearray(good)
    corrupt[-1] ^= 0xFF
    _assert_error(http.put(f"/v1/blocks/{key.hex()}/data", content=bytes(corrupt)), 400, "CRC")
    huge = encode_block(key, NS.id, 0, bytes(5 << 20))  # regions are 4 MiB in this daemon
    _assert_error(http.put(f"/v1/blocks/{key.hex()}/data", content=huge), 413, "over the limit")
    _assert_error(http.get(f"/v1/blocks/{key.hex()}/data"), 404, "not stored")
    assert data.get(key) is None


def test_lookup_by_keys_and_by_namespace_tokens(http, data):
    keys = _put_chain(data, 3)
    all_keys = NS.keys(TOKENS)
    by_tokens = http.post("/v1/lookup", json={"namespace": NS_SPEC, "tokens": TOKENS})
    assert by_tokens.status_code == 200, by_tokens.text
    assert by_tokens.json() == {"requested": 4, "hit_blocks": 3}
    by_keys = http.post("/v1/lookup", json={"keys": [all_keys[3].hex(), keys[0].hex()]})
    assert by_keys.json() == {"requested": 2, "hit_blocks": 0}
    assert data.lookup(all_keys) == 3


def test_pin_and_unpin_by_keys_and_by_namespace_tokens(http, data):
    keys = _put_chain(data, 3)
    missing = NS.keys(TOKENS)[3]
    pin = http.post("/v1/pin", json={"keys": [keys[0].hex(), keys[1].hex(), missing.hex()]})
    assert pin.status_code == 200, pin.text
    assert pin.json() == {"requested": 3, "pinned": 2, "missing": [missing.hex()]}
    assert http.get(f"/v1/blocks/{keys[0].hex()}").json()["pinned"] is True
    assert http.get(f"/v1/blocks/{keys[2].hex()}").json()["pinned"] is False
    unpin = http.post("/v1/unpin", json={"namespace": NS_SPEC, "tokens": TOKENS[:8]})
    assert unpin.json() == {"requested": 2, "unpinned": 2, "missing": []}
    assert http.get(f"/v1/blocks/{keys[0].hex()}").json()["pinned"] is False
    pin_ns = http.post("/v1/pin", json={"namespace": NS_SPEC, "tokens": TOKENS[:12]})
    assert pin_ns.json()["pinned"] == 3
    assert all(http.get(f"/v1/blocks/{k.hex()}").json()["pinned"] for k in keys)
    http.post("/v1/unpin", json={"keys": [k.hex() for k in keys]})


def test_evict_by_keys_namespace_and_all(http, data):
    keys = _put_chain(data, 4)
    other_ns = Namespace("other-model", LAYOUT)
    other = other_ns.keys(TOKENS)[:2]
    for i, key in enumerate(other):
        data.put(key, encode_block(key, other_ns.id, 0, _payload(i)))

    by_keys = http.post("/v1/evict", json={"keys": [keys[3].hex()]})
    assert by_keys.json() == {"scope": "keys", "requested": 1, "evicted_blocks": 1}
    assert http.get(f"/v1/blocks/{keys[3].hex()}").status_code == 404
    assert data.get(keys[3]) is None

    by_ns = http.post("/v1/evict", json={"namespace": NS_SPEC})
    assert by_ns.status_code == 200, by_ns.text
    assert by_ns.json()["scope"] == "namespace" and by_ns.json()["namespace_id"] == NS.id.hex()
    assert by_ns.json()["evicted_blocks"] >= 3
    assert data.lookup(keys) == 0
    assert data.get(other[0]) is not None, "another namespace is untouched"

    by_id = http.post("/v1/evict", json={"namespace_id": other_ns.id.hex()})
    assert by_id.json()["evicted_blocks"] == 2
    assert data.get(other[1]) is None

    _put_chain(data, 2)
    everything = http.post("/v1/evict", json={"all": True})
    assert everything.json()["scope"] == "all" and everything.json()["evicted_blocks"] >= 2
    assert http.get("/v1/stats").json()["engine"]["blocks"] == 0


@pytest.mark.parametrize("path,body,fragment", [
    ("/v1/evict", {}, "exactly one of"),
    ("/v1/evict", {"all": True, "keys": []}, "exactly one of"),
    ("/v1/evict", {"namespace_id": "xyz"}, "namespace_id"),
    ("/v1/pin", {}, "either 'keys'"),
    ("/v1/pin", {"keys": ["00" * 16], "namespace": NS_SPEC, "tokens": [1]}, "either 'keys'"),
    ("/v1/pin", {"namespace": NS_SPEC}, "go together"),
    ("/v1/pin", {"keys": ["00" * 15]}, "keys.0"),
    ("/v1/pin", {"keys": ["00" * 16], "ttl_s": True}, "ttl_s"),
    ("/v1/pin", {"keys": ["00" * 16], "ttl_s": "60"}, "ttl_s"),
    ("/v1/unpin", {"keys": "00" * 16}, "keys"),
    ("/v1/lookup", {"namespace": NS_SPEC, "tokens": [-1]}, "tokens.0"),
    ("/v1/lookup", {"namespace": {**NS_SPEC, "layout": {**NS_SPEC["layout"], "dtype": "int3"}}, "tokens": [1]},
     "dtype"),
    ("/v1/lookup", {"namespace": {**NS_SPEC, "colour": "red"}, "tokens": [1]}, "colour"),
    ("/v1/lookup", {"keys": ["00" * 16] * (KEYS_PER_REQUEST_MAX + 1)}, "keys"),
])
def test_bad_request_bodies_get_json_errors(http, path, body, fragment):
    _assert_error(http.post(path, json=body), 422, fragment)


def test_malformed_json_unknown_route_and_wrong_method(http, data):
    _assert_error(http.post("/v1/pin", content=b"{not json", headers={"content-type": "application/json"}),
                  422, "JSON")
    _assert_error(http.get("/v1/nothing"), 404)
    _assert_error(http.delete("/v1/stats"), 405)
    # the daemon keeps serving admin and data clients afterwards
    assert http.get("/healthz").status_code == 200
    key = bytes(range(200, 216))
    data.put(key, encode_block(key, NS.id, 0, b"still here"))
    assert bytes(payload_of(data.get(key))) == b"still here"


def test_config_is_the_effective_redacted_config(http, daemon):
    doc = http.get("/v1/config").json()
    assert doc["region_size_bytes"] == 4 << 20 and doc["stripe_size_bytes"] == 256 << 10
    assert doc["device_size_bytes"] == 64 << 20
    assert doc["listen"] == "127.0.0.1:0" and doc["admin"] == "127.0.0.1:0"
    assert doc["token_file"] is None
    assert len(doc["devices"]) == 4


def test_stats_document_matches_what_happened(http, data):
    http.post("/v1/evict", json={"all": True})
    before = http.get("/v1/stats").json()
    keys = _put_chain(data, 2)
    assert data.get_many(keys + [NS.keys(TOKENS)[3]], ns_id=NS.id)[2] is None
    after = http.get("/v1/stats").json()
    assert after["engine"]["blocks"] == 2
    assert after["engine"]["puts"] - before["engine"]["puts"] == 2
    assert after["tiers"]["warm"]["hits"] - before["tiers"]["warm"]["hits"] == 2
    assert after["tiers"]["warm"]["misses"] - before["tiers"]["warm"]["misses"] == 1
    ns = after["namespaces"][NS.id.hex()]
    assert ns["hits"] - before["namespaces"].get(NS.id.hex(), {"hits": 0})["hits"] == 2
    assert after["server"]["requests"]["put"] - before["server"]["requests"].get("put", 0) == 2
    assert after["server"]["open_connections"] >= 1
    assert after["ready"] is True and after["uptime_s"] > 0


def test_stats_names_the_bound_addresses(http, daemon):
    addresses = http.get("/v1/stats").json()["addresses"]
    assert addresses == {"data": daemon.data_addr, "admin": daemon.admin_addr}


def test_devices_give_a_working_direct_read_map(http, data):
    """/v1/devices names each device's superblock id and local path in stripe
    order: exactly the map the direct reader needs to read sealed blocks."""
    from kvtier.client.direct_reader import DirectLocation, DirectReader

    doc = http.get("/v1/devices").json()
    geometry = data.geometry()
    assert [d["device_id"] for d in doc["devices"]] == list(geometry.device_ids)
    assert [d["index"] for d in doc["devices"]] == [0, 1, 2, 3]
    assert (doc["stripe_size_bytes"], doc["data_offset_bytes"], doc["device_data_bytes"]) == (
        geometry.stripe_size_bytes, geometry.data_offset_bytes, geometry.device_data_bytes)
    device_map = {d["device_id"]: d["path"] for d in doc["devices"]}
    key = bytes(range(100, 116))
    data.put(key, encode_block(key, NS.id, 0, b"read me directly" * 1000))
    data.flush()
    present, (loc,) = data.lookup_locations([key])
    assert present == 1 and loc.sealed
    with DirectReader(geometry, device_map) as reader:
        (block,) = reader.read_many([key], [DirectLocation(loc.logical_offset, loc.length, loc.seq)])
    assert bytes(block) == data.get(key)
