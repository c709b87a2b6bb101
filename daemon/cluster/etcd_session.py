"""The daemon's etcd calls, over etcd's JSON gateway (``/v3/``, etcd 3.4 and later) with
etcd3gw as the HTTP client. The one file of the daemon that talks to etcd.

Endpoints are tried in the URL's order, starting from the last one that answered;
when none answers, :class:`EtcdUnavailable` names the URL and the last error. Every
request has a timeout shorter than a keepalive interval, so a hung endpoint never
costs the lease.
"""
from __future__ import annotations

import base64
from typing import Any

from kvtier.common.addresses import format_address
from kvtier.common.cluster_url import ClusterUrl

API_PATH = "/v3/"  # etcd >= 3.4 serves its gateway here (3.3 had /v3beta/)


class EtcdUnavailable(Exception):
    """No endpoint of the cluster URL answered (or one refused the request); names the URL."""


def _b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


def _prefix_end(prefix: str) -> str:
    """etcd's range end for "every key starting with prefix" (the last byte plus one)."""
    raw = prefix.encode()
    assert raw and raw[-1] < 0xFF, f"prefix {prefix!r}"
    return _b64(raw[:-1] + bytes([raw[-1] + 1]))


def _import_etcd3gw():
    try:
        import etcd3gw
        from etcd3gw import exceptions
    except ModuleNotFoundError as exc:
        raise EtcdUnavailable(f"--cluster needs {exc.name}, from the cluster extra: pip install 'kvtier[cluster]'") \
            from None
    return etcd3gw, exceptions


class EtcdSession:
    """Lease and key calls against one etcd cluster; not thread-safe (one lease keeper uses it)."""

    def __init__(self, url: ClusterUrl, timeout_s: float) -> None:
        etcd3gw, exceptions = _import_etcd3gw()
        self.url = url
        self._errors = (exceptions.Etcd3Exception,)
        self._clients = [etcd3gw.Etcd3Client(host=h, port=p, timeout=timeout_s, api_path=API_PATH)
                         for h, p in url.endpoints]
        self._current = 0

    def _post(self, path: str, payload: dict) -> dict[str, Any]:
        last = None
        for step in range(len(self._clients)):
            i = (self._current + step) % len(self._clients)
            client = self._clients[i]
            try:
                out = client.post(client.get_url(path), json=payload)
            except self._errors as exc:
                last = f"{format_address(client.host, client.port)}: {type(exc).__name__}: " \
                       f"{exc.detail_text or exc}"
                continue
            self._current = i
            return out
        raise EtcdUnavailable(f"etcd at {self.url.text} did not answer ({last})")

    def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: (id, TTL granted; etcd may raise a TTL below its minimum)."""
        out = self._post("/lease/grant", {"TTL": ttl_s, "ID": 0})
        return int(out["ID"]), int(out["TTL"])

    def keepalive(self, lease_id: int) -> int:
        """The lease's TTL after renewing it; 0 or less when the lease is gone."""
        out = self._post("/lease/keepalive", {"ID": lease_id})
        return int(out.get("result", {}).get("TTL", -1))

    def put(self, key: str, value: bytes, lease_id: int) -> None:
        self._post("/kv/put", {"key": _b64(key), "value": _b64(value), "lease": lease_id})

    def revoke(self, lease_id: int) -> None:
        self._post("/kv/lease/revoke", {"ID": lease_id})

    def list_prefix(self, prefix: str) -> list[tuple[str, bytes]]:
        """Every ``(key, value)`` under ``prefix`` now (one range request)."""
        out = self._post("/kv/range", {"key": _b64(prefix), "range_end": _prefix_end(prefix)})
        # a key that is not UTF-8 reads with U+FFFD, and its record is then refused as any bad one
        return [(base64.b64decode(kv["key"]).decode(errors="replace"), base64.b64decode(kv.get("value", "")))
                for kv in out.get("kvs", [])]

    def count_prefix(self, prefix: str) -> int:
        """Keys under ``prefix`` now (one range request, counting only)."""
        out = self._post("/kv/range", {"key": _b64(prefix), "range_end": _prefix_end(prefix), "count_only": True})
        return int(out.get("count", 0))
