"""Where a job sends its requests.

- ``tcp://HOST:PORT``: one daemon; several, comma-separated, spread the
  blocks over them: each key goes to its owner by rendezvous hashing over
  the ``HOST:PORT`` names, the rule engines use (:mod:`kvtier.client.routing`).
- ``direct:MAP@tcp://HOST:PORT``: reads go straight to the daemon's devices
  (the NVMe-oF path) after a LOOKUP for their locations; writes and lookups go
  over TCP. MAP is ``ID=PATH,ID=PATH`` (daemon device id to local path), or
  just ``PATH,PATH`` in the daemon's device order.
- ``etcd://HOST:PORT[,HOST:PORT...]/PREFIX``: the live members of a kvtier cluster
  (``kvtierd --cluster``), read from etcd when the job connects; each key goes to its
  owner by rendezvous hashing over the members' node ids, as cluster clients route.
- ``token_file``: the daemon's shared token, read once and never printed.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvtier.common.addresses import AddressError, format_address, parse_daemon_address
from kvtier.common.cluster_url import ClusterUrl, ClusterUrlError, is_cluster_url, parse_cluster_url
from kvtier.common.tokens import TokenFileError, read_token_file

from .units import UsageError

TARGETS_MAX = 64  # daemons one job spreads over


@dataclass(frozen=True)
class TcpTarget:
    host: str
    port: int

    @property
    def addr(self) -> str:
        return format_address(self.host, self.port)


@dataclass(frozen=True)
class DirectMap:
    """Device map for direct reads: by id, or positional (ids None)."""

    ids: tuple[str, ...] | None
    paths: tuple[str, ...]

    def for_devices(self, device_ids: tuple[str, ...]) -> dict[str, str]:
        if self.ids is None:
            if len(self.paths) != len(device_ids):
                raise UsageError(f"direct: {len(self.paths)} device paths given but the daemon has "
                                 f"{len(device_ids)} devices ({', '.join(device_ids)})")
            return dict(zip(device_ids, self.paths))
        mapping = dict(zip(self.ids, self.paths))
        missing = [d for d in device_ids if d not in mapping]
        if missing:
            raise UsageError(f"direct: no path for daemon device(s) {', '.join(missing)}")
        return mapping


@dataclass(frozen=True)
class Targets:
    tcp: tuple[TcpTarget, ...]  # empty for a cluster: its members are read when the job connects
    direct: DirectMap | None = None
    cluster: ClusterUrl | None = None


def _tcp(text: str) -> TcpTarget:
    body = text[len("tcp://"):] if text.startswith("tcp://") else None
    if body is None:
        raise UsageError(f"target {text!r}: expected tcp://HOST:PORT, etcd://HOST:PORT/PREFIX "
                         "or direct:MAP@tcp://HOST:PORT")
    try:
        host, port = parse_daemon_address(body, what=f"target {text!r}")
    except AddressError as exc:
        raise UsageError(f"{exc} (expected tcp://HOST:PORT)") from None
    return TcpTarget(host, port)


def parse_targets(text: str) -> Targets:
    text = text.strip()
    if text.startswith("direct:"):
        spec, sep, tcp = text[len("direct:"):].rpartition("@")
        if not sep or not spec:
            raise UsageError(f"target {text!r}: direct needs a device map and the daemon's address, "
                             "as direct:ID=PATH[,ID=PATH...]@tcp://HOST:PORT")
        items = [i.strip() for i in spec.split(",") if i.strip()]
        if all("=" in i for i in items):
            ids, paths = zip(*(i.split("=", 1) for i in items))
            dmap = DirectMap(tuple(ids), tuple(paths))
        elif any("=" in i for i in items):
            raise UsageError(f"target {text!r}: give every device as ID=PATH, or only paths in device order")
        else:
            dmap = DirectMap(None, tuple(items))
        return Targets((_tcp(tcp.strip()),), dmap)
    if is_cluster_url(text):
        try:
            return Targets((), cluster=parse_cluster_url(text, what="target"))
        except ClusterUrlError as exc:
            raise UsageError(str(exc)) from None
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise UsageError("target is empty")
    if len(parts) > TARGETS_MAX:
        raise UsageError(f"{len(parts)} targets is over the limit {TARGETS_MAX}")
    tcp = tuple(_tcp(p) for p in parts)
    twice = sorted({t.addr for t in tcp if tcp.count(t) > 1})
    if twice:
        raise UsageError(f"target {', '.join(twice)} given more than once")
    return Targets(tcp)


def read_token(path: str) -> str | None:
    """The token in ``path``, None for no path."""
    if not path:
        return None
    try:
        return read_token_file(path)
    except TokenFileError as exc:
        raise UsageError(str(exc)) from None
