"""``kvtier-router``: a routing table of N kvtierd nodes, kept from their KV events, behind an
HTTP API (:mod:`.http_api`).

    kvtier-router --listen 127.0.0.1:7420 \\
        --node edge-1,events=tcp://10.0.0.1:7412,replay=tcp://10.0.0.1:7413,admin=http://10.0.0.1:7411,data=10.0.0.1:7410 \\
        --node edge-2,...  [--token-file FILE] [--probe-fraction 0.05]

Prints ``kvtier-router ready http=HOST:PORT`` and serves until SIGTERM or SIGINT.
``--token-file`` is the nodes' token (admin API snapshots, LOOKUP probes) and the router's own.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from kvtier.common.addresses import AddressError, format_address, parse_address
from kvtier.common.tokens import TokenFileError, read_token_file

PROBE_FRACTION_DEFAULT = 0.05  # one answer in 20 checked with a LOOKUP on every node


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvtier-router", description="KV-aware router over kvtierd nodes' KV events")
    ap.add_argument("--listen", default="127.0.0.1:7420", help="HTTP address HOST:PORT (default 127.0.0.1:7420)")
    ap.add_argument("--node", action="append", required=True, metavar="ID,events=...,admin=...[,replay=...][,data=...]",
                    help="a node to follow (repeatable)")
    ap.add_argument("--token-file", help="the nodes' token, also required of the router's clients")
    ap.add_argument("--probe-fraction", type=float, default=PROBE_FRACTION_DEFAULT,
                    help=f"answers checked against every node's LOOKUP (default {PROBE_FRACTION_DEFAULT}; 0: none)")
    ap.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return ap


def start_router(nodes, host: str, port: int, token: str | None, probe_fraction: float):
    """(http server, subscriber, probe), started; the caller stops them in reverse order."""
    from .accuracy import AccuracyProbe
    from .http_api import RouterHTTPServer
    from .node_lookup import NodeLookups
    from .router import Router
    from .routing_table import RoutingTable
    from .subscriber import EventSubscriber

    table = RoutingTable()
    lookups = NodeLookups(nodes, token)
    probe = AccuracyProbe([n.node_id for n in nodes], lookups.lookup, probe_fraction, lookups.errors) \
        if probe_fraction > 0 else None
    subscriber = EventSubscriber(table, nodes)
    subscriber.start()
    server = RouterHTTPServer(Router(table, nodes, probe), host, port, token, subscriber.statistics)
    server.start()
    return server, subscriber, probe, lookups


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        from .node_sources import NodeSpec
        token = read_token_file(args.token_file) if args.token_file else None
        nodes = [NodeSpec.parse(text, token) for text in args.node]
        host, port = parse_address(args.listen, what="--listen")
    except ModuleNotFoundError as exc:
        print(f"kvtier-router: error: needs {exc.name}, from the events extra: pip install 'kvtier[events]'",
              file=sys.stderr)
        return 2
    except (TokenFileError, AddressError, ValueError) as exc:
        print(f"kvtier-router: error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        server, subscriber, probe, lookups = start_router(nodes, host, port, token, args.probe_fraction)
    except OSError as exc:
        print(f"kvtier-router: error: {exc}", file=sys.stderr)
        return 1
    print(f"kvtier-router ready http={format_address(*server.address)}", flush=True)
    stop.wait()
    server.stop()
    subscriber.stop()
    if probe is not None:
        probe.stop()
    lookups.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
