"""kvtierd: the storage daemon's entry point.

Opens (formatting on first run) the engine, serves the data protocol and, unless
``--admin none``, the admin HTTP API; prints ``kvtierd ready data=HOST:PORT
[admin=HOST:PORT]`` and sends READY=1 to systemd. Signals:

- SIGTERM / SIGINT: leave the cluster (``--cluster``: delete the member key, revoke the
  lease), stop accepting, finish in-flight requests, seal and sync, exit 0.
- SIGHUP: re-read the config file's log level and token file; connections stay.

An unexpected exception inside the engine fails it closed (``Engine.fail``): readiness goes
false at once and the daemon stops, without sealing, exiting 4 (EXIT_ENGINE_FAILED) for
systemd (``Restart=on-failure``) to start it again; the restart recovers from flash.
"""
from __future__ import annotations

import logging
import os
import select
import signal
import sys

from kvtier.common.addresses import format_address
from kvtier.daemon.config import ConfigError, DaemonConfig, config_from_args, reload_log_level
from kvtier.daemon.notify import Notifier
from kvtier.daemon.state import DaemonState

log = logging.getLogger("kvtier.daemon")

EXIT_CONFIG = 2  # bad flags or config: fix the command line
EXIT_STARTUP = 1  # the store or a port could not be opened
EXIT_UNCLEAN = 3  # stopped, but the open region could not be sealed (a device failed): unacknowledged puts lost
EXIT_ENGINE_FAILED = 4  # the engine failed closed (an unexpected exception): restart, recovering from flash


def _setup_logging(level: str) -> None:
    logging.basicConfig(stream=sys.stderr, level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger().setLevel(level.upper())


def open_engine(cfg: DaemonConfig):
    """Format if asked, then open the store.

    Only ``--format`` or a first run of the embedded default (a data dir with none
    of its device files) creates device files; any other missing device is an
    error naming it, and nothing is created."""
    from kvtier.daemon.engine import Engine, GeometryError
    if not cfg.devices:
        os.makedirs(cfg.data_dir, exist_ok=True)
    ecfg = cfg.engine_config()
    if cfg.format:
        Engine.format(ecfg, force=cfg.force, force_hint="--force")
        log.info("event=formatted devices=%s", ",".join(ecfg.device_paths))
        return Engine.open(ecfg)
    missing = [path for path in ecfg.device_paths if not os.path.exists(path)]
    first_run = not cfg.devices and len(missing) == len(ecfg.device_paths)
    if missing and not first_run:
        what = f"device {missing[0]} is" if len(missing) == 1 else f"devices {', '.join(missing)} are"
        raise GeometryError(f"{what} missing (nothing was created; start with --format to create and "
                            f"format a new store)")
    return Engine.open(ecfg, create_if_missing=True)


class Daemon:
    """Runs until :meth:`request_stop`; one instance per process."""

    def __init__(self, cfg: DaemonConfig, notifier: Notifier | None = None):
        self.cfg = cfg
        self.notifier = notifier or Notifier()
        self._stop_requested = False
        self._reload_requested = False
        self.state: DaemonState | None = None
        self._admin = None
        self._cluster = None  # a kvtier.daemon.cluster.ClusterMember with --cluster
        self.engine_failure: str | None = None  # why the engine failed closed (Engine.fail), if it did
        self._wake_w: int | None = None  # the main loop's wakeup pipe while it runs

    def start(self) -> str:
        """Open the store and start serving; returns the ready line."""
        from kvtier.daemon.server import DataServer
        self.notifier.notify("STATUS=opening devices and recovering the index")
        engine = open_engine(self.cfg)
        engine.on_failure = self._engine_failed
        kv_events = state = None
        try:
            state = DaemonState(self.cfg, engine)
            if self.cfg.kv_events_endpoint is not None:  # before the data port opens: every change is published
                kv_events = state.kv_events = _start_kv_events(self.cfg, engine)
            host, port = self.cfg.listen_address
            server = DataServer(engine, host, port, token=lambda: state.token,
                                region_size_bytes=self.cfg.region_size_bytes,
                                max_connections=self.cfg.max_connections, frame_timeout_s=self.cfg.frame_timeout_s,
                                max_connections_per_peer=self.cfg.max_connections_per_peer,
                                idle_timeout_s=self.cfg.idle_timeout_s)
            state.data_server = server
            state.nixl = _start_nixl(self.cfg, server)
            if state.kv_events is not None:
                from kvtier.wire.events import FEATURE_KV_EVENTS
                server.add_feature(FEATURE_KV_EVENTS)
            if self.cfg.upstream is not None:
                state.upstream = _open_upstream(self.cfg, engine)
                server.set_upstream(state.upstream)
            if self.cfg.preplace_edges is not None:
                state.preplacer = _preplacer(self.cfg, engine)
                server.set_chain_observer(state.preplacer.observer.observe)
            state.data_address = server.start()
            if state.preplacer is not None:
                state.preplacer.start()
            self.state = state
            line = f"kvtierd ready data={format_address(*state.data_address[:2])}"
            if self.cfg.admin_address is not None:
                AdminServer = _admin_server_class()
                self._admin = AdminServer(state, *self.cfg.admin_address)
                state.admin_address = tuple(self._admin.start())
                line += f" admin={format_address(*state.admin_address[:2])}"
            if state.kv_events is not None:
                line += f" kv_events={state.kv_events.endpoint}"
            if state.nixl is not None:
                line += f" nixl_served_to={self.cfg.nixl_trust.describe().replace(', ', ',').replace(' ', '-')}"
            if self.cfg.cluster is not None:
                self._cluster = _join_cluster(self.cfg, state)
                state.cluster = self._cluster  # the admin view's cluster figures read it
        except BaseException:
            if self._admin is not None:
                self._admin.stop()
            if kv_events is not None:
                kv_events.stop()
            if self.state is not None and self.state.data_server is not None:
                self.state.data_server.stop()
            if state is not None and state.preplacer is not None:
                state.preplacer.stop()
            if state is not None and state.upstream is not None:
                state.upstream.close()
            engine.close()
            raise
        state.set_ready(True)
        return line

    def request_stop(self, *_args) -> None:
        """Signal handler (SIGTERM, SIGINT); runs in the main thread."""
        self._stop_requested = True

    def request_reload(self, *_args) -> None:
        """Signal handler (SIGHUP); runs in the main thread."""
        self._reload_requested = True

    def _engine_failed(self, reason: str) -> None:
        """Engine.on_failure, from any thread: readiness goes false now, and the main thread stops
        the daemon (exit EXIT_ENGINE_FAILED) without sealing what it can no longer trust."""
        self.engine_failure = reason
        if self.state is not None:
            self.state.set_ready(False)
        log.critical("event=engine_failed reason=%r (not ready; exiting %d to be restarted and recover from flash)",
                     reason, EXIT_ENGINE_FAILED)
        self._stop_requested = True
        wake = self._wake_w
        if wake is not None:
            try:
                os.write(wake, b"\0")
            except OSError:  # the loop is ending anyway (pipe full or closed)
                pass

    def run_until_stopped(self) -> None:
        """Watchdog pings and reloads until a stop is requested.

        Signals may be delivered to any thread, so the main thread waits on
        the signal wakeup fd rather than on a lock a signal might not interrupt."""
        interval = self.notifier.watchdog_interval_s
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        previous = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        self._wake_w = wake_w
        try:
            while not self._stop_requested:
                if self._reload_requested:  # checked first: a SIGHUP may have come before the wakeup fd was set
                    self._reload_requested = False
                    self._reload()
                    continue
                select.select([wake_r], [], [], interval)
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
                if interval is not None and not self._stop_requested:
                    self.notifier.watchdog()
        finally:
            self._wake_w = None
            signal.set_wakeup_fd(previous)
            os.close(wake_r)
            os.close(wake_w)

    def _reload(self) -> None:
        self.notifier.reloading()
        try:
            cfg = reload_log_level(self.state.config)
            self.state.set_config(cfg)
            logging.getLogger().setLevel(cfg.log_level.upper())
            log.info("event=reloaded log_level=%s token=%s", cfg.log_level,
                     "set" if self.state.token is not None else "none")
        except ConfigError as exc:
            log.error("event=reload_failed error=%s (kept the previous settings)", exc)
        self.notifier.notify("READY=1", "STATUS=serving")

    def shutdown(self) -> bool:
        """Stop accepting, finish in-flight requests, seal and sync; False if the
        seal failed (every durable put was synced when acknowledged, so only
        buffered ones are lost)."""
        self.notifier.stopping()
        state = self.state
        state.set_ready(False)
        log.info("event=stopping")
        if self._cluster is not None:
            self._cluster.stop()  # clients stop routing here before the data port closes
        if state.preplacer is not None:
            state.preplacer.stop()  # no push reads the engine past this
        state.data_server.stop()
        if self._admin is not None:
            self._admin.stop()
        if state.upstream is not None:
            state.upstream.close()  # after the last request: what it fetched is stored (bounded), then closed
        if state.kv_events is not None:
            state.kv_events.stop()  # after the last request: its changes are published
        from kvtier.daemon.engine import EngineError
        try:
            state.engine.close()  # seals and syncs the open region, then closes the devices
        except EngineError as exc:
            log.error("event=stopped_unclean error=%s (puts not acknowledged as durable were lost)", exc)
            return False
        log.info("event=stopped uptime_s=%.1f", state.uptime_s)
        return True


def _join_cluster(cfg: DaemonConfig, state: DaemonState):
    """Register under ``cfg.cluster``; ClusterError (exit 1) names the URL when etcd does not
    answer, or the extra to install when etcd3gw is missing."""
    from kvtier.daemon.cluster import join_cluster
    return join_cluster(cfg.cluster_url, data_dir=cfg.data_dir, data_address=state.data_address,
                        admin_address=state.admin_address, advertise=cfg.advertise_address,
                        node_id=cfg.node_id, lease_ttl_s=cfg.lease_ttl_s)


def _preplacer(cfg: DaemonConfig, engine):
    """The pre-placement pusher of ``--preplace-edges`` (ConfigError names a bad token file, or
    the extra to install when the edges are an etcd cluster and etcd3gw is missing)."""
    from kvtier.daemon.preplace.pusher import PrePlacer
    from kvtier.daemon.state import read_token
    token = read_token(cfg.preplace_token_file) if cfg.preplace_token_file else None
    try:
        return PrePlacer(engine, cfg.preplace_settings(token))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _open_upstream(cfg: DaemonConfig, engine):
    """The pull-through from ``--upstream``, with its own token (ConfigError names a bad token file)."""
    from kvtier.daemon.state import read_token
    from kvtier.daemon.upstream import open_pull_through
    token = read_token(cfg.upstream_token_file) if cfg.upstream_token_file else None
    try:
        return open_pull_through(cfg.upstream, token, cfg.upstream_timeout_ms / 1000.0, engine)
    except ValueError as exc:
        raise ConfigError(f"upstream: {exc}") from None


def _start_nixl(cfg: DaemonConfig, server):
    """The NIXL transport's service attached to ``server`` (None: off, or auto without NIXL);
    ConfigError says why ``--nixl on`` cannot start it."""
    from kvtier.daemon.config import is_loopback
    from kvtier.daemon.nixl import start_nixl
    from kvtier.daemon.nixl.agent import NixlUnavailable
    try:
        service = start_nixl(cfg.nixl, is_loopback(cfg.listen_address[0]), cfg.nixl_tls, cfg.nixl_trust)
    except NixlUnavailable as exc:
        raise ConfigError(f"nixl = on: {exc}") from None
    if service is not None:
        server.attach_nixl(service)
        trust = cfg.nixl_trust
        if is_loopback(cfg.listen_address[0]) or trust.network_clients:
            log.info("event=nixl_trust served_to=%r (nixl_trusted)", trust.describe())
        else:
            log.warning("event=nixl_trust served_to=%r: clients on the network are served over TCP, not NIXL; "
                        "list the hosts trusted with this daemon's memory in nixl_trusted (docs/nixl.md, Trust)",
                        trust.describe())
    return service


def _start_kv_events(cfg: DaemonConfig, engine):
    """The KV-events publisher; ConfigError names the extra when pyzmq or msgspec is missing."""
    try:
        from kvtier.daemon.events.service import KVEvents
    except ModuleNotFoundError as exc:
        raise ConfigError(f"kv_events_endpoint needs {exc.name}, from the events extra: "
                          "pip install 'kvtier[events]'") from None
    return KVEvents(engine, cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint)


def _admin_server_class():
    """The admin API's server; FastAPI and uvicorn are imported only when it is asked for."""
    try:
        from kvtier.daemon.admin import AdminServer
    except ModuleNotFoundError as exc:
        raise ConfigError(f"the admin API needs {exc.name}, from the daemon extra: pip install 'kvtier[daemon]' "
                          "(or set admin = \"none\")") from None
    return AdminServer


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
MMAP_THRESHOLD_BYTES = 1 << 20  # allocations this large are mmap'ed, and unmapped when freed


def _return_large_frees_to_the_os() -> None:
    """Fix glibc's mmap threshold. Left dynamic, it rises to the size of the last large block freed
    (up to 32 MiB), so the index's old columns, freed when it grows, stay in the heap and in the
    RSS; fixed, they are unmapped. A no-op where the C library is not glibc."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    _return_large_frees_to_the_os()
    try:
        cfg = config_from_args(argv)
    except ConfigError as exc:
        print(f"kvtierd: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    _setup_logging(cfg.log_level)
    daemon = Daemon(cfg)
    signal.signal(signal.SIGTERM, daemon.request_stop)
    signal.signal(signal.SIGINT, daemon.request_stop)
    signal.signal(signal.SIGHUP, daemon.request_reload)
    try:
        line = daemon.start()
    except ConfigError as exc:
        print(f"kvtierd: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except Exception as exc:  # GeometryError, a busy port, an unreadable device: say which and exit
        log.error("event=startup_failed error=%s: %s", type(exc).__name__, exc)
        print(f"kvtierd: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_STARTUP
    print(line, flush=True)
    log.info("event=ready %s config=%s", line.removeprefix("kvtierd ready "), daemon.state.config.redacted())
    daemon.notifier.ready(f"serving {line.removeprefix('kvtierd ready ')}")
    daemon.run_until_stopped()
    code = 0 if daemon.shutdown() else EXIT_UNCLEAN
    if daemon.engine_failure is not None:
        code = EXIT_ENGINE_FAILED
    if daemon.state.nixl is not None and daemon.state.nixl.started:
        from kvtier.daemon.nixl import exit_process
        exit_process(code)  # UCX's teardown at interpreter exit can crash: the store is closed, skip it
    return code


if __name__ == "__main__":
    sys.exit(main())
