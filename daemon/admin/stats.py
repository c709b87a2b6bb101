"""The /v1/stats document: one snapshot of the engine and of the data server.

::

    {"uptime_s", "ready", "addresses": {"data", "admin"},
     "engine":     EngineStatistics as a dict,
     "server":     the data server's statistics() as a dict,
     "tiers":      {"warm": {"hits", "misses", "hit_ratio", "read_bytes", "written_bytes"}},
     "lookup":     {"keys_asked", "keys_hit", "prefix_hit_ratio"},
     "namespaces": {ns_id_hex: {"hits", "misses", "hit_ratio"}},
     "upstream":   with --upstream: the pull-through's statistics and its prefix_hit_ratio
                   {"local", "upstream"}; null without one}

The derived figures (ratios, per-tier view) come from the same snapshots the
Prometheus collector reads, through :func:`derived_figures`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.daemon.admin.view import AdminStateView


def ratio(part: float, whole: float) -> float | None:
    """part / whole, or None when nothing was asked yet (not 0: 'no data' is not 'all missed')."""
    return part / whole if whole else None


@dataclass(frozen=True)
class NamespaceFigures:
    hits: int
    misses: int


@dataclass(frozen=True)
class DerivedFigures:
    """The figures operators watch, taken from one engine and one server snapshot."""

    warm_hits: int
    warm_misses: int
    warm_read_bytes: int
    warm_written_bytes: int
    lookup_keys_asked: int
    lookup_keys_hit: int
    namespaces: dict[str, NamespaceFigures] = field(default_factory=dict)


def _namespaces(server: dict) -> dict[str, NamespaceFigures]:
    table = server.get("namespaces") or {}
    out = {}
    for ns, figures in table.items():
        ns_hex = ns.hex() if isinstance(ns, (bytes, bytearray)) else str(ns)
        out[ns_hex] = NamespaceFigures(int(figures.get("hits", 0)), int(figures.get("misses", 0)))
    return out


def derived_figures(engine: dict, server: dict) -> DerivedFigures:
    return DerivedFigures(
        warm_hits=int(engine.get("hits", 0)),
        warm_misses=int(engine.get("misses", 0)),
        warm_read_bytes=int(engine.get("get_bytes", 0)),
        warm_written_bytes=int(engine.get("put_bytes", 0)),
        lookup_keys_asked=int(server.get("lookup_keys_asked", 0)),
        lookup_keys_hit=int(server.get("lookup_keys_hit", 0)),
        namespaces=_namespaces(server),
    )


def _jsonable(value):
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if isinstance(value, dict):
        return {(k.hex() if isinstance(k, (bytes, bytearray)) else str(k)): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def upstream_section(upstream: dict) -> dict | None:
    """The pull-through's snapshot with its prefix hit ratio per tier; None without an upstream."""
    if not upstream:
        return None
    asked = upstream["prefix_blocks_local"] + upstream["prefix_blocks_upstream"] + upstream["prefix_blocks_missed"]
    return dict(upstream, prefix_hit_ratio={"local": ratio(upstream["prefix_blocks_local"], asked),
                                            "upstream": ratio(upstream["prefix_blocks_upstream"], asked)})


def stats_document(view: AdminStateView) -> dict:
    engine = view.engine_statistics()
    server = view.server_statistics()
    d = derived_figures(engine, server)
    return {
        "uptime_s": round(view.uptime_s(), 3),
        "ready": view.ready(),
        "addresses": view.addresses(),
        "engine": _jsonable(engine),
        "server": _jsonable(server),
        "tiers": {"warm": {
            "hits": d.warm_hits, "misses": d.warm_misses,
            "hit_ratio": ratio(d.warm_hits, d.warm_hits + d.warm_misses),
            "read_bytes": d.warm_read_bytes, "written_bytes": d.warm_written_bytes,
        }},
        "lookup": {"keys_asked": d.lookup_keys_asked, "keys_hit": d.lookup_keys_hit,
                   "prefix_hit_ratio": ratio(d.lookup_keys_hit, d.lookup_keys_asked)},
        "namespaces": {ns: {"hits": f.hits, "misses": f.misses, "hit_ratio": ratio(f.hits, f.hits + f.misses)}
                       for ns, f in sorted(d.namespaces.items())},
        "upstream": upstream_section(view.upstream_statistics()),  # pull-through (--upstream)
        "cluster": view.cluster_statistics() or None,  # membership (--cluster): state, members seen, lease
        "preplace": view.preplace_statistics() or None,  # pre-placement (--preplace-edges): per-edge figures
    }
