"""The router's HTTP API (standard library server, one thread per request).

=======  ===========  ===================================================================
POST     /v1/route    a chain (keys, or namespace + tokens, or ns_id + block_tokens + tokens):
                      the chosen node, its data address, every node holding the longest
                      prefix and that prefix's length in blocks
GET      /v1/stats    routes, accuracy, the table per node, the subscriber's counters
GET      /metrics     the same as Prometheus text
GET      /healthz     alive (no auth)
=======  ===========  ===================================================================

With a token, every route but /healthz needs ``Authorization: Bearer <token>``; without one,
only loopback clients are served. Errors are JSON ``{"error": "..."}``.
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from kvtier.common.tokens import token_matches
from kvtier.daemon.config import is_loopback

from .route_requests import RouteRequestError, route_keys
from .router import Router

BODY_BYTES_MAX = 64 << 20  # a 4M-token request as JSON fits well under this


def metrics_text(stats: dict) -> str:
    accuracy = stats["accuracy"] or {}
    lines = []

    def metric(name: str, kind: str, value, help_text: str, labels: str = "") -> None:
        if not any(line.startswith(f"# HELP {name} ") for line in lines):
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
        lines.append(f"{name}{labels} {0 if value is None else value}")

    metric("kvtier_router_routes_total", "counter", stats["routes"], "route requests answered")
    metric("kvtier_router_routes_to_holder_total", "counter", stats["routes_to_a_holder"],
           "route answers that named a node holding the first block")
    metric("kvtier_router_probed_total", "counter", accuracy.get("probed"), "route answers probed with LOOKUP")
    metric("kvtier_router_accurate_total", "counter", accuracy.get("accurate"),
           "probed answers whose node held the longest stored prefix")
    metric("kvtier_router_accuracy_ratio", "gauge", accuracy.get("accuracy"),
           "accurate / probed (routing-table accuracy)")
    table = stats["table"]
    metric("kvtier_router_gaps_total", "counter", table["gaps"], "event sequence gaps seen")
    metric("kvtier_router_snapshots_total", "counter", table["snapshots_loaded"], "node snapshots loaded")
    for node, figures in table["nodes"].items():
        metric("kvtier_router_node_keys", "gauge", figures["keys"], "blocks the table holds for a node",
               f'{{node="{node}"}}')
        metric("kvtier_router_node_up", "gauge", int(figures["up"]), "node connected and synced once",
               f'{{node="{node}"}}')
    return "\n".join(lines) + "\n"


class RouterHTTPServer:
    def __init__(self, router: Router, host: str, port: int, token: str | None = None,
                 extra_statistics: Callable[[], dict] = dict):
        self.router = router
        self._token = token
        self._extra = extra_statistics
        self._server = ThreadingHTTPServer((host, port), self._handler_class())
        self._server.daemon_threads = True
        self.address = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvtier-router-http", daemon=True)

    def start(self) -> tuple[str, int]:
        self._thread.start()
        return self.address

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def statistics(self) -> dict:
        return dict(self.router.statistics(), subscriber=self._extra())

    def _handler_class(self):
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # requests are counted, not logged one by one
                pass

            def _reply(self, code: int, doc: dict | None = None, text: str | None = None) -> None:
                body = (text if text is not None else json.dumps(doc)).encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain; version=0.0.4" if text is not None else "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _authorized(self) -> bool:
                if api._token is None:
                    if is_loopback(self.client_address[0]):
                        return True
                    self._reply(403, {"error": "the router has no token configured and serves loopback clients only"})
                    return False
                scheme, _, presented = (self.headers.get("Authorization") or "").partition(" ")
                if scheme != "Bearer" or not token_matches(presented, api._token):
                    self._reply(401, {"error": "give 'Authorization: Bearer <token>' with the router's token"})
                    return False
                return True

            def do_GET(self) -> None:
                if self.path == "/healthz":
                    return self._reply(200, {"status": "ok"})
                if not self._authorized():
                    return
                if self.path == "/v1/stats":
                    return self._reply(200, api.statistics())
                if self.path == "/metrics":
                    return self._reply(200, text=metrics_text(api.statistics()))
                self._reply(404, {"error": f"no route GET {self.path}"})

            def do_POST(self) -> None:
                if not self._authorized():
                    return
                if self.path != "/v1/route":
                    return self._reply(404, {"error": f"no route POST {self.path}"})
                length = self.headers.get("Content-Length")
                if length is None or not length.isdigit() or int(length) > BODY_BYTES_MAX:
                    return self._reply(413 if length and length.isdigit() else 411,
                                       {"error": f"give a Content-Length of at most {BODY_BYTES_MAX} bytes"})
                try:
                    keys = route_keys(json.loads(self.rfile.read(int(length))))
                except json.JSONDecodeError as exc:
                    return self._reply(400, {"error": f"the body is not JSON: {exc}"})
                except RouteRequestError as exc:
                    return self._reply(400, {"error": str(exc)})
                self._reply(200, api.router.route(keys).as_dict(api.router.nodes))

        return Handler
