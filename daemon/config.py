"""kvtierd configuration: command-line flags over an optional TOML file.

The TOML file takes the flags' names with ``_`` for ``-`` (all optional)::

    data_dir = "/var/lib/kvtier"
    device = ["/dev/nvme1n1", "/dev/nvme2n1"]   # or omit for the embedded default
    device_size = "1g"          # k/m/g suffixes, or an integer byte count
    stripe_size = "1m"
    region_size = "64m"
    eviction = "lru"            # or "fifo"
    reinsert_hits = 0           # reinsert blocks read this often on eviction (0: pinned only)
    pinned_fraction_max = 0.5   # pins (hard and soft) may hold this share of the capacity; PINs past it are refused
    clean_regions_target = 2    # clean regions the background reclaim keeps ready (at most 1/8 of the regions)
    listen = "127.0.0.1:7410"
    admin = "127.0.0.1:7411"    # or "none"
    token_file = "/etc/kvtier/token"
    log_level = "info"
    max_connections = 1024
    max_connections_per_peer = 256  # from one client address (IP)
    frame_timeout = 30.0        # seconds a peer may stall mid-frame
    idle_timeout = 600.0        # seconds an authenticated connection may sit idle between requests
    cluster = "etcd://127.0.0.1:2379/kvtier"   # join a cluster (omit: a standalone node)
    advertise = "10.0.0.5:7410" # the data address clients dial (default: listen's)
    node_id = "node-a"          # default: made once and kept in data_dir/node-id
    lease_ttl = 5               # seconds a dead node stays a member (2..300)
    upstream = "region-a:7410"  # pull misses from this daemon (or etcd://HOST:PORT/PREFIX: a region's members)
    upstream_token_file = "/etc/kvtier/upstream-token"  # the token the upstream expects
    upstream_timeout_ms = 1000  # an upstream slower than this is a miss
    kv_events_endpoint = "tcp://127.0.0.1:7412"         # publish KV events (vLLM's format) on ZMQ PUB
    kv_events_replay_endpoint = "tcp://127.0.0.1:7413"  # and replay recent ones (ZMQ ROUTER)
    nixl = "auto"               # the NIXL transport (docs/nixl.md): auto (where installed), on, off
    nixl_tls = "self,sm,tcp"    # UCX transports for it (default: detected; shared memory, RDMA, TCP)
    nixl_trusted = "loopback"   # the clients NIXL is served to (docs/nixl.md, "Trust"): loopback, none, or
                                # addresses and networks ("loopback,10.0.0.0/24"); the others are served over TCP
    preplace_edges = "edge-a:7410,edge-b:7410"  # push hot prefixes to these edges (or etcd://HOST:PORT/PREFIX)
    preplace_bytes = "1g"       # per edge: the most the pusher keeps soft-pinned there
    preplace_ttl_s = 600        # a pushed prefix stays soft-pinned this long after its last push
    preplace_interval_s = 60    # how often the pusher ranks and pushes
    preplace_token_file = "/etc/kvtier/edge-token"  # the token the edges expect

An unknown or ill-typed key is an error that names it. Pure: parses, does no I/O
beyond reading the config file it is pointed at.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import tomllib
from dataclasses import asdict, dataclass, fields, replace

from kvtier.common.addresses import AddressError, parse_address
from kvtier.common.cluster_url import ClusterUrl, ClusterUrlError, check_node_id, is_cluster_url, parse_cluster_url
from kvtier.daemon.cluster.lease_keeper import LEASE_TTL_S_DEFAULT, LEASE_TTL_S_MAX, LEASE_TTL_S_MIN
from kvtier.daemon.engine.config import (CLEAN_REGIONS_TARGET_MAX, REGION_SIZE_DEFAULT_BYTES,
                                        STRIPE_SIZE_DEFAULT_BYTES)
from kvtier.daemon.engine.eviction import EVICTION_POLICIES
from kvtier.daemon.engine.index import HITS_MAX
from kvtier.daemon.nixl import NIXL_MODES
from kvtier.daemon.nixl.trust import NIXL_TRUSTED_DEFAULT, NixlTrust, NixlTrustError
from kvtier.daemon.preplace.settings import (PREPLACE_BYTES_DEFAULT, PREPLACE_INTERVAL_S_DEFAULT,
                                             PREPLACE_TTL_S_DEFAULT, PreplaceConfigError, PreplaceSettings)

EMBEDDED_DEVICE_COUNT = 4  # the embedded default: 4 file-backed devices, RAID0
EMBEDDED_DEVICE_SIZE_BYTES = 1 << 30  # 1 GiB each: room to try kvtier without a disk to spare
MAX_CONNECTIONS_LIMIT = 65536  # one thread per connection: beyond this, use more daemons
TIMEOUT_S_MAX = 7 * 24 * 3600.0  # frame and idle timeouts: a socket timeout and a poll() in ms must hold them
REINSERT_HITS_MAX = HITS_MAX  # the engine counts reads in one byte per index slot
LOG_LEVELS = ("debug", "info", "warning", "error")
EVICTIONS = EVICTION_POLICIES
UPSTREAM_TIMEOUT_MS_DEFAULT = 1000  # a WAN round trip and a few MiB at 1 Gbit/s, with room to spare
UPSTREAM_TIMEOUT_MS_MAX = 60_000  # beyond this a request waits on a dead upstream longer than clients do
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::"})  # a bind on every address: it overlaps any other host's
_SUFFIXES = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class ConfigError(ValueError):
    """A setting that cannot be used; the message names it."""


def parse_size(text, name: str = "size") -> int:
    """``"64m"`` -> 67108864; plain integers pass through (k/m/g/t, base 1024)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    elif isinstance(text, str):
        s = text.strip().lower().removesuffix("ib").removesuffix("b")
        suffix = s[-1:] if s[-1:] in _SUFFIXES and s[-1:] else ""
        number = s[:-1] if suffix else s
        try:
            value = int(number) * _SUFFIXES[suffix]
        except ValueError:
            raise ConfigError(f"{name}: {text!r} is not a size (a number with an optional k/m/g/t suffix)") from None
    else:
        raise ConfigError(f"{name}: expected a size such as '64m', got {type(text).__name__} {text!r}")
    if value <= 0:
        raise ConfigError(f"{name}: must be positive, got {text!r}")
    return value


def parse_listen_address(text: str, name: str) -> tuple[str, int]:
    """``"127.0.0.1:7410"`` or ``"[::1]:0"`` -> (host, port); ConfigError names the setting."""
    try:
        return parse_address(text, what=name)
    except AddressError as exc:
        raise ConfigError(str(exc)) from None


def check_zmq_endpoint(text: str, name: str) -> None:
    """``tcp://HOST:PORT`` (port 0: the kernel picks one) or ``ipc://PATH``; ConfigError names the setting."""
    if text.startswith("ipc://") and len(text) > len("ipc://"):
        return
    if not text.startswith("tcp://"):
        raise ConfigError(f"{name}: {text!r} is not a ZMQ endpoint tcp://HOST:PORT or ipc://PATH")
    address = text[len("tcp://"):]
    if address.startswith("*:"):
        address = "0.0.0.0" + address[1:]
    parse_listen_address(address, name)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class DaemonConfig:
    data_dir: str = "./data"
    devices: tuple[str, ...] = ()
    device_size_bytes: int = EMBEDDED_DEVICE_SIZE_BYTES
    stripe_size_bytes: int = STRIPE_SIZE_DEFAULT_BYTES
    region_size_bytes: int = REGION_SIZE_DEFAULT_BYTES
    eviction: str = "lru"  # measured better than fifo on the prefix trace (perf/sim_eviction.py)
    reinsert_hits: int = 0
    pinned_fraction_max: float = 0.5
    clean_regions_target: int = 2
    listen: str = "127.0.0.1:7410"
    admin: str = "127.0.0.1:7411"
    token_file: str | None = None
    log_level: str = "info"
    max_connections: int = 1024
    max_connections_per_peer: int = 256
    frame_timeout_s: float = 30.0
    idle_timeout_s: float = 600.0
    cluster: str | None = None  # etcd://HOST:PORT[,HOST:PORT...]/PREFIX
    advertise: str | None = None
    node_id: str | None = None
    lease_ttl_s: int = LEASE_TTL_S_DEFAULT
    upstream: str | None = None  # HOST:PORT or etcd://HOST:PORT[,HOST:PORT...]/PREFIX
    upstream_token_file: str | None = None
    upstream_timeout_ms: int = UPSTREAM_TIMEOUT_MS_DEFAULT
    kv_events_endpoint: str | None = None  # tcp://HOST:PORT the KV-events PUB socket binds (None: off)
    kv_events_replay_endpoint: str | None = None  # tcp://HOST:PORT of its replay ROUTER socket
    nixl: str = "auto"  # the NIXL transport: auto (offered where nixl is importable), on (required), off
    nixl_tls: str | None = None  # UCX_TLS for the NIXL agent (None: detected, kvtier.common.ucx_env)
    nixl_trusted: str = NIXL_TRUSTED_DEFAULT  # the clients NIXL is served to (kvtier.daemon.nixl.trust)
    preplace_edges: str | None = None  # HOST:PORT,... or etcd://HOST:PORT/PREFIX of the edges (None: off)
    preplace_bytes: int = PREPLACE_BYTES_DEFAULT
    preplace_ttl_s: float = PREPLACE_TTL_S_DEFAULT
    preplace_interval_s: float = PREPLACE_INTERVAL_S_DEFAULT
    preplace_token_file: str | None = None
    format: bool = False
    force: bool = False
    config_file: str | None = None
    from_flags: frozenset[str] = frozenset()  # settings the command line gave: a SIGHUP keeps them

    def __post_init__(self) -> None:
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level: {self.log_level!r} is not one of {LOG_LEVELS}")
        if self.eviction not in EVICTIONS:
            raise ConfigError(f"eviction: {self.eviction!r} is not one of {EVICTIONS}")
        if not 0 <= self.reinsert_hits <= REINSERT_HITS_MAX:
            raise ConfigError(f"reinsert_hits: {self.reinsert_hits} is outside 0..{REINSERT_HITS_MAX}")
        if not 1 <= self.clean_regions_target <= CLEAN_REGIONS_TARGET_MAX:
            raise ConfigError(f"clean_regions_target: {self.clean_regions_target} is outside 1..{CLEAN_REGIONS_TARGET_MAX}")
        if not 0 <= self.pinned_fraction_max <= 1:
            raise ConfigError(f"pinned_fraction_max: {self.pinned_fraction_max} is outside 0..1 (a fraction of the "
                              f"capacity)")
        if not 1 <= self.max_connections <= MAX_CONNECTIONS_LIMIT:
            raise ConfigError(f"max_connections: {self.max_connections} is outside 1..{MAX_CONNECTIONS_LIMIT}")
        if not 1 <= self.max_connections_per_peer <= MAX_CONNECTIONS_LIMIT:
            raise ConfigError(f"max_connections_per_peer: {self.max_connections_per_peer} is outside "
                              f"1..{MAX_CONNECTIONS_LIMIT}")
        for name, seconds in (("frame_timeout", self.frame_timeout_s), ("idle_timeout", self.idle_timeout_s)):
            if not 0 < seconds <= TIMEOUT_S_MAX:
                raise ConfigError(f"{name}: must be positive and at most {TIMEOUT_S_MAX:.0f} s (7 days), got {seconds}")
        for name in ("token_file", "upstream_token_file", "preplace_token_file"):
            if getattr(self, name) == "":
                raise ConfigError(f"{name}: is an empty path (omit the setting for no token)")
        host, _ = self.listen_address
        if self.admin != "none":
            parse_listen_address(self.admin, "admin")
            self._check_admin_is_not_listen()
        if self.token_file is None and not is_loopback(host):
            raise ConfigError(f"listen: refusing to bind non-loopback address {host!r} without token_file")
        if self.admin != "none" and self.token_file is None and not is_loopback(self.admin_address[0]):
            raise ConfigError(f"admin: refusing to bind non-loopback address {self.admin!r} without token_file")
        self._check_cluster(host)
        self._check_upstream()
        self._check_kv_events()
        if self.nixl not in NIXL_MODES:
            raise ConfigError(f"nixl: {self.nixl!r} is not one of {NIXL_MODES}")
        if self.nixl_tls is not None and not self.nixl_tls.strip(" ,"):
            raise ConfigError("nixl_tls: names no UCX transport (e.g. 'self,sm,tcp')")
        self.nixl_trust  # checks nixl_trusted
        self._check_preplace()
        self.engine_config()  # the geometry: sizes, a device listed twice

    def _check_admin_is_not_listen(self) -> None:
        (data_host, data_port), (admin_host, admin_port) = self.listen_address, self.admin_address
        overlap = data_host == admin_host or data_host in WILDCARD_HOSTS or admin_host in WILDCARD_HOSTS
        if data_port != 0 and data_port == admin_port and overlap:
            raise ConfigError(f"admin: {self.admin!r} is the data address (listen {self.listen!r}) too; "
                              "give the admin API a port of its own")

    def _check_preplace(self) -> None:
        if self.preplace_edges is None:
            if self.preplace_token_file is not None:
                raise ConfigError("preplace_token_file: only makes sense with preplace_edges")
            return
        self.preplace_settings(token=None)  # checks every preplace_* setting

    def preplace_settings(self, token: str | None):
        """The :class:`kvtier.daemon.preplace.settings.PreplaceSettings` these settings describe
        (None without preplace_edges); ``token`` is the one read from preplace_token_file."""
        if self.preplace_edges is None:
            return None
        try:
            return PreplaceSettings(self.preplace_edges, self.preplace_bytes, self.preplace_ttl_s,
                                    self.preplace_interval_s, token)
        except PreplaceConfigError as exc:
            raise ConfigError(str(exc)) from None

    def _check_kv_events(self) -> None:
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value is not None:
                check_zmq_endpoint(value, name)
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ConfigError("kv_events_replay_endpoint: only makes sense with kv_events_endpoint")
        if self.kv_events_endpoint is not None and self.kv_events_endpoint == self.kv_events_replay_endpoint:
            raise ConfigError(f"kv_events_replay_endpoint: {self.kv_events_replay_endpoint!r} is the PUB "
                              "endpoint too; give it a port of its own")

    def _check_upstream(self) -> None:
        if self.upstream is None:
            if self.upstream_token_file is not None:
                raise ConfigError("upstream_token_file: only makes sense with upstream (HOST:PORT or etcd://...)")
        elif is_cluster_url(self.upstream):
            try:
                parse_cluster_url(self.upstream, what="upstream")
            except ClusterUrlError as exc:
                raise ConfigError(str(exc)) from None
        else:
            parse_listen_address(self.upstream, "upstream")
        if isinstance(self.upstream_timeout_ms, bool) or not 1 <= self.upstream_timeout_ms <= UPSTREAM_TIMEOUT_MS_MAX:
            raise ConfigError(f"upstream_timeout_ms: {self.upstream_timeout_ms} is outside 1..{UPSTREAM_TIMEOUT_MS_MAX}")

    def _check_cluster(self, listen_host: str) -> None:
        if self.cluster is None:
            for name in ("advertise", "node_id"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"{name}: only makes sense with cluster (etcd://HOST:PORT/PREFIX)")
            return
        self.cluster_url  # parses or raises
        if self.advertise is not None and self.advertise_address[1] == 0:
            raise ConfigError(f"advertise: {self.advertise!r} has port 0; give the port clients dial")
        if self.advertise is None and listen_host in ("0.0.0.0", "::"):
            raise ConfigError(f"cluster: listen {self.listen!r} is a wildcard; set advertise to the address "
                              "clients dial")
        if self.node_id is not None:
            try:
                check_node_id(self.node_id)
            except ClusterUrlError as exc:
                raise ConfigError(f"node_id: {exc}") from None
        if isinstance(self.lease_ttl_s, bool) or not LEASE_TTL_S_MIN <= self.lease_ttl_s <= LEASE_TTL_S_MAX:
            raise ConfigError(f"lease_ttl: {self.lease_ttl_s} s is outside {LEASE_TTL_S_MIN}..{LEASE_TTL_S_MAX}")

    @property
    def cluster_url(self) -> ClusterUrl | None:
        if self.cluster is None:
            return None
        try:
            return parse_cluster_url(self.cluster, what="cluster")
        except ClusterUrlError as exc:
            raise ConfigError(str(exc)) from None

    @property
    def advertise_address(self) -> tuple[str, int] | None:
        return None if self.advertise is None else parse_listen_address(self.advertise, "advertise")

    @property
    def nixl_trust(self) -> NixlTrust:
        try:
            return NixlTrust.parse(self.nixl_trusted)
        except NixlTrustError as exc:
            raise ConfigError(str(exc)) from None

    @property
    def listen_address(self) -> tuple[str, int]:
        return parse_listen_address(self.listen, "listen")

    @property
    def admin_address(self) -> tuple[str, int] | None:
        return None if self.admin == "none" else parse_listen_address(self.admin, "admin")

    @property
    def device_paths(self) -> tuple[str, ...]:
        """The devices, or the embedded default's files in ``data_dir``."""
        if self.devices:
            return self.devices
        return tuple(os.path.join(self.data_dir, f"device{i}.img") for i in range(EMBEDDED_DEVICE_COUNT))

    def redacted(self) -> dict:
        """The effective settings for display (the admin API's /config).
        The token never lives here, only its file's path."""
        doc = asdict(self)
        doc["devices"] = list(self.device_paths)
        doc["token_file"] = None if self.token_file is None else "<set>"
        doc["upstream_token_file"] = None if self.upstream_token_file is None else "<set>"
        doc["preplace_token_file"] = None if self.preplace_token_file is None else "<set>"
        doc["from_flags"] = sorted(self.from_flags)
        return doc

    def engine_config(self):
        """The :class:`kvtier.daemon.engine.EngineConfig` these settings describe."""
        from kvtier.daemon.engine import EngineConfig
        try:
            return EngineConfig(device_paths=self.device_paths, device_size_bytes=self.device_size_bytes,
                                stripe_size_bytes=self.stripe_size_bytes, region_size_bytes=self.region_size_bytes,
                                eviction=self.eviction, reinsertion_hits_min=self.reinsert_hits,
                                pinned_fraction_max=self.pinned_fraction_max,
                                clean_regions_target=self.clean_regions_target, rescue_dir=str(self.data_dir))
        except ValueError as exc:  # EngineConfig names its field: region_size_bytes, device_paths, ...
            raise ConfigError(str(exc).removeprefix("EngineConfig.")) from None


# TOML key -> (DaemonConfig field, converter)
def _str(name):
    def conv(v):
        if not isinstance(v, str):
            raise ConfigError(f"{name}: expected a string, got {type(v).__name__} {v!r}")
        return v
    return conv


def _devices(v):
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ConfigError(f"device: expected a list of paths, got {v!r}")
    return tuple(v)


def _int(name):
    def conv(v):
        if not isinstance(v, int) or isinstance(v, bool):
            raise ConfigError(f"{name}: expected an integer, got {type(v).__name__} {v!r}")
        return v
    return conv


def _seconds(name):
    def convert(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{name}: expected seconds as a number, got {type(v).__name__} {v!r}")
        return float(v)
    return convert


def _size(name):
    return lambda v: parse_size(v, name)


def _fraction(name):
    def convert(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{name}: expected a fraction (a number in 0..1), got {type(v).__name__} {v!r}")
        return float(v)
    return convert


def _number(name):
    def convert(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{name}: expected seconds as a number, got {type(v).__name__} {v!r}")
        return float(v)
    return convert


_TOML_KEYS = {
    "data_dir": ("data_dir", _str("data_dir")),
    "device": ("devices", _devices),
    "device_size": ("device_size_bytes", _size("device_size")),
    "stripe_size": ("stripe_size_bytes", _size("stripe_size")),
    "region_size": ("region_size_bytes", _size("region_size")),
    "eviction": ("eviction", _str("eviction")),
    "reinsert_hits": ("reinsert_hits", _int("reinsert_hits")),
    "pinned_fraction_max": ("pinned_fraction_max", _fraction("pinned_fraction_max")),
    "clean_regions_target": ("clean_regions_target", _int("clean_regions_target")),
    "listen": ("listen", _str("listen")),
    "admin": ("admin", _str("admin")),
    "token_file": ("token_file", _str("token_file")),
    "log_level": ("log_level", _str("log_level")),
    "max_connections": ("max_connections", _int("max_connections")),
    "max_connections_per_peer": ("max_connections_per_peer", _int("max_connections_per_peer")),
    "frame_timeout": ("frame_timeout_s", _seconds("frame_timeout")),
    "idle_timeout": ("idle_timeout_s", _seconds("idle_timeout")),
    "cluster": ("cluster", _str("cluster")),
    "advertise": ("advertise", _str("advertise")),
    "node_id": ("node_id", _str("node_id")),
    "lease_ttl": ("lease_ttl_s", _int("lease_ttl")),
    "upstream": ("upstream", _str("upstream")),
    "upstream_token_file": ("upstream_token_file", _str("upstream_token_file")),
    "upstream_timeout_ms": ("upstream_timeout_ms", _int("upstream_timeout_ms")),
    "kv_events_endpoint": ("kv_events_endpoint", _str("kv_events_endpoint")),
    "kv_events_replay_endpoint": ("kv_events_replay_endpoint", _str("kv_events_replay_endpoint")),
    "nixl": ("nixl", _str("nixl")),
    "nixl_tls": ("nixl_tls", _str("nixl_tls")),
    "nixl_trusted": ("nixl_trusted", _str("nixl_trusted")),
    "preplace_edges": ("preplace_edges", _str("preplace_edges")),
    "preplace_bytes": ("preplace_bytes", _size("preplace_bytes")),
    "preplace_ttl_s": ("preplace_ttl_s", _number("preplace_ttl_s")),
    "preplace_interval_s": ("preplace_interval_s", _number("preplace_interval_s")),
    "preplace_token_file": ("preplace_token_file", _str("preplace_token_file")),
}
assert {v[0] for v in _TOML_KEYS.values()} <= {f.name for f in fields(DaemonConfig)}


def load_toml(path: str) -> dict:
    """The DaemonConfig fields a TOML file sets; ConfigError names a bad key."""
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: not valid TOML: {exc}") from None
    out = {}
    for key, value in doc.items():
        if key not in _TOML_KEYS:
            raise ConfigError(f"config file {path}: unknown key {key!r}; known keys: {sorted(_TOML_KEYS)}")
        field_name, conv = _TOML_KEYS[key]
        try:
            out[field_name] = conv(value)
        except ConfigError as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvtierd", description="kvtier storage daemon")
    ap.add_argument("--config", help="TOML config file (flags override it)")
    ap.add_argument("--data-dir", help="directory of the embedded default's device files (default ./data)")
    ap.add_argument("--device", action="append", help="device file or block device (repeatable)")
    ap.add_argument("--device-size", help="size of device files created if missing (k/m/g)")
    ap.add_argument("--stripe-size", help="RAID0 stripe unit (default 1m)")
    ap.add_argument("--region-size", help="region size (default 64m)")
    ap.add_argument("--eviction", choices=EVICTIONS, help="region eviction order when full (default lru)")
    ap.add_argument("--reinsert-hits", type=int,
                    help="on eviction, keep blocks read at least this often since written (default 0: pinned only)")
    ap.add_argument("--pinned-fraction-max", type=float,
                    help="share of the capacity pinned blocks (hard and soft pins) may hold; a PIN past it is "
                         "refused (default 0.5)")
    ap.add_argument("--clean-regions-target", type=int,
                    help="clean regions the background reclaim keeps ready; a PUT waits only when they are all "
                         "taken (default 2, at most an eighth of the regions)")
    ap.add_argument("--listen", help="data address HOST:PORT (default 127.0.0.1:7410; port 0 = free)")
    ap.add_argument("--admin", help="admin HTTP address HOST:PORT or 'none' (default 127.0.0.1:7411)")
    ap.add_argument("--token-file", help="file holding the shared auth token")
    ap.add_argument("--log-level", choices=LOG_LEVELS)
    ap.add_argument("--max-connections", type=int, help="open data connections allowed (default 1024)")
    ap.add_argument("--frame-timeout", type=float, help="seconds a client may stall mid-frame (default 30)")
    ap.add_argument("--max-connections-per-peer", type=int,
                    help="open data connections allowed from one client address (default 256)")
    ap.add_argument("--idle-timeout", type=float,
                    help="seconds an authenticated connection may idle between requests (default 600)")
    ap.add_argument("--cluster", metavar="etcd://HOST:PORT[,HOST:PORT...]/PREFIX",
                    help="join the cluster whose membership lives in this etcd (default: standalone)")
    ap.add_argument("--advertise", metavar="HOST:PORT", help="data address registered for clients (default: listen's)")
    ap.add_argument("--node-id", help="this node's id in the cluster (default: made once, kept in the data dir)")
    ap.add_argument("--lease-ttl", type=int, metavar="SECONDS",
                    help=f"etcd lease TTL: a killed node leaves within this (default {LEASE_TTL_S_DEFAULT})")
    ap.add_argument("--upstream", metavar="HOST:PORT|etcd://HOST:PORT/PREFIX",
                    help="answer misses from this daemon (or a region's etcd members) and store them here "
                         "(default: none)")
    ap.add_argument("--upstream-token-file", help="file holding the token the upstream expects")
    ap.add_argument("--upstream-timeout-ms", type=int,
                    help=f"an upstream slower than this is a miss (default {UPSTREAM_TIMEOUT_MS_DEFAULT})")
    ap.add_argument("--kv-events-endpoint", metavar="tcp://HOST:PORT",
                    help="publish block stored/removed/cleared events in vLLM's KV-events format on a ZMQ PUB "
                         "socket bound here (default: off)")
    ap.add_argument("--kv-events-replay-endpoint", metavar="tcp://HOST:PORT",
                    help="ZMQ ROUTER socket that replays recent KV-event batches from a sequence number")
    ap.add_argument("--nixl", choices=NIXL_MODES,
                    help="the NIXL transport (GETs written into clients' registered buffers over UCX): auto "
                         "(offered where nixl is importable; default), on (fail to start without it), off")
    ap.add_argument("--nixl-tls", metavar="LIST",
                    help="UCX_TLS for the NIXL agent, e.g. 'self,sm,tcp' (default: detected)")
    ap.add_argument("--nixl-trusted", metavar="loopback|none|NETWORK,...",
                    help="the clients NIXL is served to, trusted with the daemon's memory (UCX's shared-memory "
                         "and TCP transports do not check remote keys): 'loopback' (default: this host's "
                         "processes), 'none', or addresses and networks, e.g. 'loopback,10.0.0.0/24'; the others "
                         "are served over TCP")
    ap.add_argument("--preplace-edges", metavar="HOST:PORT,...|etcd://HOST:PORT/PREFIX",
                    help="push the most asked-for prefixes to these edges as soft pins (default: off)")
    ap.add_argument("--preplace-bytes", help="per edge: the most the pusher keeps soft-pinned there (k/m/g; "
                                             "default 1g)")
    ap.add_argument("--preplace-ttl-s", type=float,
                    help=f"a pushed prefix stays soft-pinned this long after its last push (default "
                         f"{PREPLACE_TTL_S_DEFAULT:.0f})")
    ap.add_argument("--preplace-interval-s", type=float,
                    help=f"seconds between push rounds (default {PREPLACE_INTERVAL_S_DEFAULT:.0f})")
    ap.add_argument("--preplace-token-file", help="file holding the token the edges expect")
    ap.add_argument("--format", action="store_true", help="format the devices, then serve")
    ap.add_argument("--force", action="store_true", help="with --format: overwrite an existing store")
    return ap


def config_from_args(argv: list[str] | None = None) -> DaemonConfig:
    """Flags over the TOML file over the defaults."""
    args = build_parser().parse_args(argv)
    settings = load_toml(args.config) if args.config else {}
    flag_map = {
        "data_dir": ("data_dir", str), "device": ("devices", tuple),
        "device_size": ("device_size_bytes", _size("--device-size")),
        "stripe_size": ("stripe_size_bytes", _size("--stripe-size")),
        "region_size": ("region_size_bytes", _size("--region-size")),
        "eviction": ("eviction", str), "reinsert_hits": ("reinsert_hits", int), "listen": ("listen", str), "admin": ("admin", str),
        "token_file": ("token_file", str), "log_level": ("log_level", str),
        "max_connections": ("max_connections", int), "frame_timeout": ("frame_timeout_s", float),
        "max_connections_per_peer": ("max_connections_per_peer", int), "idle_timeout": ("idle_timeout_s", float),
        "cluster": ("cluster", str), "advertise": ("advertise", str), "node_id": ("node_id", str),
        "lease_ttl": ("lease_ttl_s", int), "pinned_fraction_max": ("pinned_fraction_max", float),
        "clean_regions_target": ("clean_regions_target", int),
        "upstream": ("upstream", str), "upstream_token_file": ("upstream_token_file", str),
        "upstream_timeout_ms": ("upstream_timeout_ms", int),
        "kv_events_endpoint": ("kv_events_endpoint", str), "kv_events_replay_endpoint": ("kv_events_replay_endpoint", str),
        "nixl": ("nixl", str), "nixl_tls": ("nixl_tls", str), "nixl_trusted": ("nixl_trusted", str),
        "preplace_edges": ("preplace_edges", str), "preplace_bytes": ("preplace_bytes", _size("--preplace-bytes")),
        "preplace_ttl_s": ("preplace_ttl_s", float), "preplace_interval_s": ("preplace_interval_s", float),
        "preplace_token_file": ("preplace_token_file", str),
    }
    from_flags = set()
    for arg, (field_name, conv) in flag_map.items():
        value = getattr(args, arg)
        if value is not None:
            settings[field_name] = conv(value)
            from_flags.add(field_name)
    if args.force and not args.format:
        raise ConfigError("--force only makes sense with --format")
    return DaemonConfig(**settings, format=args.format, force=args.force, config_file=args.config,
                        from_flags=frozenset(from_flags))


def reload_log_level(cfg: DaemonConfig) -> DaemonConfig:
    """On SIGHUP: the config file's log level (and token file), other settings kept, and so are
    those the command line gave (flags over the file, as at start)."""
    if not cfg.config_file:
        return cfg
    doc = load_toml(cfg.config_file)
    reloaded = ("log_level", "token_file")
    return replace(cfg, **{k: doc[k] for k in reloaded if k in doc and k not in cfg.from_flags})
