"""Cluster membership as the daemon writes it and clients read it: the ``etcd://`` URL, the
key layout under its prefix, and the member record. Pure: parses and encodes, no I/O.

::

    etcd://HOST:PORT[,HOST:PORT...]/PREFIX          one or more etcd client endpoints
    /PREFIX/members/NODE_ID  ->  MemberRecord JSON  one key per live daemon, on its lease

A daemon (``kvtierd --cluster``) puts its record under its lease and keeps the lease
alive; when the lease ends (SIGTERM revokes it, kill -9 lets it expire) etcd deletes the
key, and every client watching the prefix sees the member leave.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from kvtier.common.addresses import AddressError, format_address, parse_address

SCHEME = "etcd://"
ETCD_PORT_DEFAULT = 2379  # etcd's client port
ENDPOINTS_MAX = 16  # etcd clusters have 3, 5 or 7 members; more is a typo
PREFIX_BYTES_MAX = 200  # keeps every member key well under etcd's 1.5 MiB request limit
PREFIX_DEFAULT = "kvtier"  # etcd://HOST:PORT with no path
NODE_ID_BYTES_MAX = 64  # a host name and a suffix
RECORD_BYTES_MAX = 4096  # a member record is a few addresses; more is not ours
RECORD_VERSION = 1
REPLICAS_DEFAULT = 2  # copies of each block in a cluster (clients, repair and edges agree): one node may die
PREPLACE_CLIENT_NAME = "kvtierd-preplace"  # HELLO client name of a region pushing prefixes: edges never pull for it
REPAIR_CLIENT_NAME = "kvtier-repair"  # HELLO client name of kvtier cluster repair: nodes count what it moves
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$")


class ClusterUrlError(ValueError):
    """Text that is not a usable ``etcd://`` URL or member record; the message says which part."""


@dataclass(frozen=True)
class ClusterUrl:
    """A parsed ``etcd://`` URL: where etcd answers and which prefix is this cluster's."""

    endpoints: tuple[tuple[str, int], ...]
    prefix: str  # without leading or trailing "/"

    def __post_init__(self) -> None:
        if not 1 <= len(self.endpoints) <= ENDPOINTS_MAX:
            raise ClusterUrlError(f"{len(self.endpoints)} etcd endpoints; 1..{ENDPOINTS_MAX} allowed")
        if not _PREFIX_RE.match(self.prefix) or len(self.prefix.encode()) > PREFIX_BYTES_MAX:
            raise ClusterUrlError(f"prefix {self.prefix!r}: letters, digits, '.', '_', '-' in '/'-separated "
                                  f"parts, at most {PREFIX_BYTES_MAX} bytes")

    @property
    def text(self) -> str:
        """The URL as :func:`parse_cluster_url` reads it back."""
        return SCHEME + ",".join(format_address(h, p) for h, p in self.endpoints) + "/" + self.prefix

    @property
    def members_prefix(self) -> str:
        """The key prefix under which every member record lives (ends with "/")."""
        return f"/{self.prefix}/members/"

    def member_key(self, node_id: str) -> str:
        check_node_id(node_id)
        return self.members_prefix + node_id

    def node_id_of(self, key: str) -> str:
        """The node id a member key names; ClusterUrlError for a key outside the prefix."""
        if not key.startswith(self.members_prefix):
            raise ClusterUrlError(f"key {key!r} is not under {self.members_prefix!r}")
        node_id = key[len(self.members_prefix):]
        check_node_id(node_id)
        return node_id

    def __str__(self) -> str:
        return self.text


def is_cluster_url(text: str) -> bool:
    return isinstance(text, str) and text.strip().startswith(SCHEME)


def parse_cluster_url(text: str, *, what: str = "cluster") -> ClusterUrl:
    """``etcd://10.0.0.1:2379,10.0.0.2:2379/kvtier/prod`` -> ClusterUrl; a host without a port
    means etcd's 2379. ClusterUrlError names ``what`` and the text."""
    text = text.strip()
    if not text.startswith(SCHEME):
        raise ClusterUrlError(f"{what}: {text!r} is not an etcd://HOST:PORT[,HOST:PORT...]/PREFIX URL")
    hosts, _, prefix = text[len(SCHEME):].partition("/")
    parts = [p.strip() for p in hosts.split(",")]
    if not hosts or not all(parts):
        raise ClusterUrlError(f"{what}: {text!r} names no etcd endpoint (etcd://HOST:PORT/PREFIX)")
    endpoints = []
    for part in parts:
        try:
            host, port = parse_address(part, what=f"{what} endpoint", default_port=ETCD_PORT_DEFAULT)
        except AddressError as exc:
            raise ClusterUrlError(f"{exc} in {text!r}") from None
        if port == 0:
            raise ClusterUrlError(f"{what}: endpoint {part!r} in {text!r} has port 0")
        endpoints.append((host, port))
    if len(set(endpoints)) != len(endpoints):
        raise ClusterUrlError(f"{what}: {text!r} names an endpoint twice")
    try:
        return ClusterUrl(tuple(endpoints), prefix.strip("/") or PREFIX_DEFAULT)
    except ClusterUrlError as exc:
        raise ClusterUrlError(f"{what}: {text!r}: {exc}") from None


def check_node_id(node_id: str) -> str:
    """A node id is one etcd key segment: letters, digits, '.', '_', '-' (not first), 64 bytes at most."""
    if not isinstance(node_id, str) or not _NAME_RE.match(node_id) or len(node_id) > NODE_ID_BYTES_MAX:
        raise ClusterUrlError(f"node id {node_id!r}: letters, digits, '.', '_', '-' (a letter or digit first), "
                              f"1..{NODE_ID_BYTES_MAX} characters")
    return node_id


@dataclass(frozen=True)
class MemberRecord:
    """What a member key holds: the daemon's node id, data address and (optional) admin address."""

    node_id: str
    data: str  # HOST:PORT clients connect to
    admin: str | None = None  # HOST:PORT of the admin API, None when it is off
    started_unix_s: float = 0.0

    def __post_init__(self) -> None:
        check_node_id(self.node_id)
        for name, value in (("data", self.data), ("admin", self.admin)):
            if value is None and name == "admin":
                continue
            try:
                _, port = parse_address(value, what=f"member {self.node_id} {name}")
            except (AddressError, AttributeError) as exc:
                raise ClusterUrlError(str(exc)) from None
            if port == 0:
                raise ClusterUrlError(f"member {self.node_id} {name}: {value!r} has port 0")

    def encode(self) -> bytes:
        doc = {"version": RECORD_VERSION, "node_id": self.node_id, "data": self.data, "admin": self.admin,
               "started_unix_s": self.started_unix_s}
        out = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        assert len(out) <= RECORD_BYTES_MAX, f"member record of {self.node_id} is {len(out)} bytes"
        return out

    @classmethod
    def decode(cls, raw: bytes) -> "MemberRecord":
        """Check the bytes read back; ClusterUrlError for anything a daemon would not write."""
        if len(raw) > RECORD_BYTES_MAX:
            raise ClusterUrlError(f"member record of {len(raw)} bytes is over {RECORD_BYTES_MAX}")
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ClusterUrlError(f"member record is not JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("version") != RECORD_VERSION:
            raise ClusterUrlError(f"member record version {doc.get('version') if isinstance(doc, dict) else doc!r}"
                                  f" is not {RECORD_VERSION}")
        started = doc.get("started_unix_s", 0.0)
        if isinstance(started, bool) or not isinstance(started, (int, float)):
            raise ClusterUrlError(f"member record started_unix_s {started!r} is not a number")
        return cls(node_id=doc.get("node_id"), data=doc.get("data"), admin=doc.get("admin"),
                   started_unix_s=float(started))
