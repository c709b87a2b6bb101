"""``kvtier preplace``: soft-pin a prefix on a region's edges, or push the hot prefixes now.

::

    kvtier [--admin REGION_ADMIN] preplace (KEY... | --namespace NS.json --tokens LIST|@FILE)
           [--edge NAME|HOST:PORT]... [--ttl-s SECONDS]
    kvtier [--admin REGION_ADMIN] preplace --push      one push round of the hot prefixes now
    kvtier [--admin REGION_ADMIN] preplace --status    the edges, settings and figures

Talks to the region's admin API (``POST /v1/preplace``); without ``--edge`` every edge
gets the prefix. Exit 1 when an edge failed or the region lacks part of the prefix.
"""
from __future__ import annotations



def _render_edges(doc: dict) -> list[str]:
    lines = []
    for e in doc["edges"]:
        if e["ok"]:
            lines.append(f"  {e['edge']}: put {e['blocks_put']} blocks ({e['bytes_put']} B), "
                         f"soft-pinned {e['blocks_pinned']} ({e['bytes_pinned']} B)")
        else:
            lines.append(f"  {e['edge']}: FAILED: {e['error']}")
    return lines


def cmd_preplace(args) -> int:
    admin_cli = args.cli  # the running admin CLI module: its UsageError is the one its main() catches
    admin = admin_cli.resolve_admin(args)
    if args.status or args.push:
        if args.keys or args.namespace or args.tokens or args.edge or args.ttl_s is not None:
            raise admin_cli.UsageError("--status and --push take no prefix, --edge or --ttl-s")
    if args.status:
        doc = admin.request("GET", "/v1/preplace")
        s = doc["statistics"]
        lines = [f"{len(doc['edges'])} edges, budget {doc['settings']['budget_bytes']} B each, "
                 f"ttl {doc['settings']['ttl_s']:g} s, every {doc['settings']['interval_s']:g} s; "
                 f"{s['rounds']} rounds, {s['heads_tracked']} prefixes tracked"]
        lines += [f"  {name}: {f['pushes']} pushes, {f['failures']} failures, {f['preplaced_bytes']} B placed, "
                  f"{f['soft_pinned_bytes']} B soft-pinned now" for name, f in s["edges"].items()]
        admin_cli._emit(args, doc, "\n".join(lines))
        return admin_cli.EXIT_OK
    if args.push:
        doc = admin.request("POST", "/v1/preplace/push", {})
        admin_cli._emit(args, doc, "\n".join([f"pushed {doc['prefixes']} prefixes"] + _render_edges(doc)))
        return admin_cli.EXIT_OK if all(e["ok"] for e in doc["edges"]) else admin_cli.EXIT_FAILED
    body = admin_cli.key_selection(args)
    body["edges"] = args.edge if args.edge else "all"
    if args.ttl_s is not None:
        body["ttl_s"] = args.ttl_s
    doc = admin.request("POST", "/v1/preplace", body)
    lines = [f"{doc['held_blocks']} of {doc['requested']} blocks held at the region, soft-pinned for "
             f"{doc['ttl_s']:g} s on:"] + _render_edges(doc)
    lines += [f"  not held at the region: {k}" for k in doc["missing"]]
    admin_cli._emit(args, doc, "\n".join(lines))
    ok = all(e["ok"] for e in doc["edges"]) and not doc["missing"]
    return admin_cli.EXIT_OK if ok else admin_cli.EXIT_FAILED


def add_preplace_parser(sub, cli) -> None:
    """The ``preplace`` subcommand, for ``cli``: the :mod:`kvtier.tools.admin_cli` module that builds
    the parser (passed in, not imported: under ``python -m`` it runs as ``__main__``)."""
    sp = sub.add_parser("preplace", help="soft-pin a prefix on the region's edges (or push the hot ones now)")
    cli._add_selection(sp, "pre-place")
    sp.add_argument("--edge", action="append", metavar="NAME|HOST:PORT",
                    help="an edge to pin it on (repeatable; default: every edge)")
    sp.add_argument("--ttl-s", type=float, help="seconds the soft pins last (default: the region's preplace_ttl_s)")
    sp.add_argument("--push", action="store_true", help="run one push round of the hot prefixes now")
    sp.add_argument("--status", action="store_true", help="the edges, settings and pre-placement figures")
    sp.set_defaults(fn=cmd_preplace, cli=cli)
