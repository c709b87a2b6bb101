"""Pre-placement settings (``kvtierd --preplace-*``), checked when made. Pure: no I/O.

::

    preplace_edges = "10.0.1.5:7410,10.0.2.5:7410"   # or "etcd://HOST:PORT/PREFIX" of the edges' cluster
    preplace_bytes = "8g"         # per edge: the most the pusher keeps soft-pinned there
    preplace_ttl_s = 600          # each soft pin expires this long after its last push
    preplace_interval_s = 60      # how often the pusher ranks and pushes
    preplace_token_file = "/etc/kvtier/edge-token"   # the edges' data-port token
"""
from __future__ import annotations

from dataclasses import dataclass

from kvtier.common.addresses import AddressError, format_address, parse_daemon_address
from kvtier.common.cluster_url import ClusterUrl, ClusterUrlError, is_cluster_url, parse_cluster_url

PREPLACE_BYTES_DEFAULT = 1 << 30  # 1 GiB per edge: a few hundred hot system prompts of a 7B model
PREPLACE_TTL_S_DEFAULT = 600.0  # ten pushes at the default interval: a prefix that cools lasts 10 minutes
PREPLACE_INTERVAL_S_DEFAULT = 60.0  # a minute: popularity moves slower than requests
PREPLACE_INTERVAL_S_MIN = 0.1  # below this the pusher would only rank, never finish a round
PREPLACE_INTERVAL_S_MAX = 24 * 3600.0  # a day between rounds: longer is a typo (and soft pins outlive no round)
PIN_TTL_S_MAX = (2**32 - 1) / 1000.0  # the wire carries a soft pin's TTL as u32 milliseconds (~49.7 days)
PIN_TTL_S_MIN = 0.001  # one millisecond: the wire's unit
EDGES_MAX = 256  # edges one region pushes to; more is a typo (or a tier of its own)


class PreplaceConfigError(ValueError):
    """A pre-placement setting that cannot be used; the message names it."""


def check_ttl_s(ttl_s, name: str = "preplace_ttl_s") -> float:
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not PIN_TTL_S_MIN <= ttl_s <= PIN_TTL_S_MAX:
        raise PreplaceConfigError(f"{name}: {ttl_s!r} is outside {PIN_TTL_S_MIN}..{PIN_TTL_S_MAX:.0f} seconds")
    return float(ttl_s)


def parse_edge_list(text: str) -> tuple[str, ...]:
    """``"HOST:PORT,HOST:PORT"`` -> the addresses as ``format_address`` writes them."""
    parts = [part.strip() for part in text.split(",")]
    if not text.strip() or not all(parts):
        raise PreplaceConfigError(f"preplace_edges: {text!r} names no edge (HOST:PORT,... or etcd://HOST:PORT/PREFIX)")
    out = []
    for part in parts:
        try:
            host, port = parse_daemon_address(part, what="preplace_edges")
        except AddressError as exc:
            raise PreplaceConfigError(str(exc)) from None
        out.append(format_address(host, port))
    if len(set(out)) != len(out):
        raise PreplaceConfigError(f"preplace_edges: {text!r} names an edge twice")
    if len(out) > EDGES_MAX:
        raise PreplaceConfigError(f"preplace_edges: {len(out)} edges; at most {EDGES_MAX}")
    return tuple(out)


@dataclass(frozen=True)
class PreplaceSettings:
    edges: str  # HOST:PORT,... or etcd://HOST:PORT/PREFIX
    budget_bytes: int = PREPLACE_BYTES_DEFAULT
    ttl_s: float = PREPLACE_TTL_S_DEFAULT
    interval_s: float = PREPLACE_INTERVAL_S_DEFAULT
    token: str | None = None  # the edges' data-port token (read from preplace_token_file)

    def __post_init__(self) -> None:
        if is_cluster_url(self.edges):
            self.cluster_url  # parses or raises
        else:
            parse_edge_list(self.edges)
        if isinstance(self.budget_bytes, bool) or not isinstance(self.budget_bytes, int) or self.budget_bytes <= 0:
            raise PreplaceConfigError(f"preplace_bytes: must be a positive size, got {self.budget_bytes!r}")
        check_ttl_s(self.ttl_s)
        if isinstance(self.interval_s, bool) or not isinstance(self.interval_s, (int, float)) \
                or not PREPLACE_INTERVAL_S_MIN <= self.interval_s <= PREPLACE_INTERVAL_S_MAX:
            raise PreplaceConfigError(f"preplace_interval_s: {self.interval_s!r} is outside "
                                      f"{PREPLACE_INTERVAL_S_MIN}..{PREPLACE_INTERVAL_S_MAX:.0f} seconds")

    @property
    def cluster_url(self) -> ClusterUrl | None:
        if not is_cluster_url(self.edges):
            return None
        try:
            return parse_cluster_url(self.edges, what="preplace_edges")
        except ClusterUrlError as exc:
            raise PreplaceConfigError(str(exc)) from None

    @property
    def static_edges(self) -> tuple[str, ...]:
        return () if is_cluster_url(self.edges) else parse_edge_list(self.edges)
