"""``kvtier cluster repair``: background re-replication, bounded and rate-limited.

::

    kvtier cluster repair --cluster etcd://HOST:PORT/PREFIX [--replicas 2] [--rate 64m] [--once]

A pass lists every member's keys (admin API ``GET /v1/keys``) and the keys it deleted lately
(``GET /v1/keys/deleted``), plans which owners lack which keys (:mod:`.cluster_repair_plan`)
and copies them: GET from a member that holds the block (verified as every read is), PUT
(buffered) to the owner that lacks it, at most ``rate`` bytes a second and ``batch`` blocks a
request. A key one of its owners deleted is deleted where it is still held, never copied.
Without ``--once`` it runs a pass at start, at every membership change (a join, a rejoin, a
leave) and every ``interval``.

It runs as its own process (next to etcd, or as a sidecar of any one node): a daemon never
imports the client, and an engine should not spend its CPU listing other nodes' keys. Each
pass's figures are written to etcd under ``/PREFIX/repair/status``, where
``kvtier cluster status`` reads them.

Clients' read-repair fills what they read; this fills the rest, and a node that joins
therefore receives about its share of the keys (its rendezvous share), never the whole cluster.
"""
from __future__ import annotations

import base64
import json
import logging
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from kvtier.client.block_client import BlockClient
from kvtier.client.cluster_etcd import EtcdError, EtcdReader
from kvtier.client.cluster_members import ClusterUnavailable, MemberTable, MemberView, open_members
from kvtier.common.cluster_url import REPAIR_CLIENT_NAME, REPLICAS_DEFAULT, ClusterUrl, parse_cluster_url
from kvtier.tools.admin_client import AdminClient, AdminError
from kvtier.tools.cluster_repair_plan import BATCH_KEYS_DEFAULT, RepairPlan, plan_repairs

log = logging.getLogger("kvtier.tools.cluster_repair")

RATE_BYTES_S_DEFAULT = 64 << 20  # a background copy: well under a node's bandwidth
RATE_BYTES_S_MIN = 1 << 20
INTERVAL_S_DEFAULT = 60.0  # a pass this often even without a membership change
LIST_PAGE_KEYS = 16384
LISTED_KEYS_MAX = 16 << 20  # 256 MiB of keys in memory across the members; more wants another scheme
NODE_TIMEOUT_S = 10.0


class RepairError(Exception):
    """A pass could not start (etcd, or no member to list); names what failed."""


def status_key(url: ClusterUrl) -> str:
    return f"/{url.prefix}/repair/status"


@dataclass
class RepairFigures:
    """What one pass (or all of them, summed) did."""

    passes: int = 0
    keys_listed: int = 0
    copies_missing: int = 0
    blocks_copied: int = 0
    bytes_moved: int = 0
    blocks_failed: int = 0  # a GET miss at the source or a refused PUT: left for the next pass
    keys_deleted: int = 0  # stored keys an owner deleted lately: not copied
    blocks_deleted: int = 0  # copies of those deleted where they were still held
    blocks_declined: int = 0  # copies the target did not take: it deleted the key after the listing
    nodes_unlisted: int = 0  # members whose keys could not be listed (no admin API, unreachable)
    bytes_moved_to: dict = field(default_factory=dict)  # node id -> bytes it received
    last_pass_s: float = 0.0
    last_pass_unix_s: float = 0.0


class ByteRate:
    """A token bucket in bytes: ``delay_s(n)`` is how long to wait before sending ``n`` bytes."""

    def __init__(self, rate_bytes_s: float, clock: Callable[[], float]) -> None:
        if rate_bytes_s < RATE_BYTES_S_MIN:
            raise ValueError(f"rate {rate_bytes_s:.0f} B/s is under the minimum {RATE_BYTES_S_MIN} B/s")
        self.rate = float(rate_bytes_s)
        self._clock = clock
        self._free_at = clock()

    def delay_s(self, nbytes: int) -> float:
        now = self._clock()
        start = max(now, self._free_at)
        self._free_at = start + nbytes / self.rate
        return start - now


def list_keys(admin_address: str, token: str | None, path: str = "/v1/keys") -> bytes:
    """A member's stored keys (or, ``path="/v1/keys/deleted"``, those it deleted lately), joined,
    through its admin API."""
    client = AdminClient(admin_address, token, timeout_s=NODE_TIMEOUT_S)
    out, cursor = [], 0
    total = 0
    while True:
        page = client.request("GET", f"{path}?cursor={cursor}&limit={LIST_PAGE_KEYS}")
        out.extend(bytes.fromhex(k) for k in page["keys"])
        total += len(page["keys"])
        if total > LISTED_KEYS_MAX:
            raise RepairError(f"{admin_address} lists over {LISTED_KEYS_MAX} keys")
        cursor = int(page["next_cursor"])
        if not cursor:
            return b"".join(out)


class ClusterRepairer:
    """Passes over one cluster (see the module doc)."""

    def __init__(self, url: str, *, replicas: int = REPLICAS_DEFAULT, rate_bytes_s: float = RATE_BYTES_S_DEFAULT,
                 batch_keys: int = BATCH_KEYS_DEFAULT, token: str | None = None) -> None:
        self.url = parse_cluster_url(url, what="--cluster")
        if replicas < 1:
            raise ValueError(f"replicas must be 1 or more, got {replicas}")
        self.replicas, self.batch_keys, self.token = replicas, batch_keys, token
        self.rate = ByteRate(rate_bytes_s, time.monotonic)
        self.total = RepairFigures()
        self._passed = threading.Condition()  # notified after every pass (wait_passes)
        self._stop = threading.Event()
        self._clients: dict[str, BlockClient] = {}

    def stop(self) -> None:
        self._stop.set()

    def wait_passes(self, passes: int, timeout_s: float) -> RepairFigures:
        """The totals once ``passes`` passes have run (or after ``timeout_s``, as they are)."""
        with self._passed:
            self._passed.wait_for(lambda: self.total.passes >= passes, timeout_s)
            return RepairFigures(**asdict(self.total))

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients = {}

    # -- one pass ----------------------------------------------------------------------
    def view_now(self) -> MemberView:
        try:
            reader = EtcdReader(self.url)
            kvs, revision = reader.members()
        except (EtcdError, ClusterUnavailable) as exc:
            raise RepairError(f"cannot read the members at {self.url.text}: {exc}") from None
        table = MemberTable(self.url)
        table.reset(kvs, revision)
        return table.view()

    def run_pass(self, view: MemberView | None = None) -> RepairFigures:
        """List, plan and copy once; the pass's figures (also added to :attr:`total` and
        written to etcd)."""
        started = time.monotonic()
        view = view if view is not None else self.view_now()
        figures = RepairFigures(passes=1)
        listings, deleted, listed = [], [], []
        for m in view.members:
            try:
                if m.admin is None:
                    raise RepairError(f"{m.node_id} runs no admin API")
                stored = list_keys(m.admin, self.token)
                gone = list_keys(m.admin, self.token, "/v1/keys/deleted")
                listings.append(stored)
                deleted.append(gone)
                listed.append(m)
            except (AdminError, OSError, RepairError) as exc:
                figures.nodes_unlisted += 1
                log.warning("event=repair_list_failed node=%s error=%s", m.node_id, exc)
        # owners are computed over every member: with one unlisted, the pass copies nothing
        if listed:
            plan = plan_repairs([m.node_id for m in listed], listings, self.replicas, self.batch_keys, deleted)
            if len(listed) == len(view.members):
                figures.keys_listed, figures.copies_missing = plan.keys_listed, plan.copies_missing
                figures.keys_deleted = plan.keys_deleted
                self._delete(plan, listed, figures)
                self._copy(plan, listed, figures)
            else:
                figures.keys_listed = plan.keys_listed
                log.warning("event=repair_pass_skipped reason=unlisted_members count=%d", figures.nodes_unlisted)
        figures.last_pass_s = time.monotonic() - started
        figures.last_pass_unix_s = time.time()
        self._add(figures)
        self._publish()
        log.info("event=repair_pass keys=%d missing=%d copied=%d bytes=%d deleted=%d failed=%d seconds=%.2f",
                 figures.keys_listed, figures.copies_missing, figures.blocks_copied, figures.bytes_moved,
                 figures.blocks_deleted, figures.blocks_failed, figures.last_pass_s)
        return figures

    def _client(self, address: str) -> BlockClient:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = BlockClient(address, self.token, pool_size=1, timeout_s=NODE_TIMEOUT_S,
                                                          client_name=REPAIR_CLIENT_NAME)
        return client

    def _copy(self, plan: RepairPlan, members, figures: RepairFigures) -> None:
        from kvtier.wire import events as p

        for transfer in plan.transfers:
            if self._stop.is_set():
                return
            source, target = members[transfer.source], members[transfer.target]
            try:
                blocks = self._client(source.address).get_many(list(transfer.keys))
                items = [(k, memoryview(b)) for k, b in zip(transfer.keys, blocks) if b is not None]
                nbytes = sum(v.nbytes for _, v in items)
                if self._stop.wait(self.rate.delay_s(nbytes)):
                    return
                seqs = self._client(target.address).put_many(items, durable=False, repair=True) if items else []
            except (p.ConnectionLost, p.RemoteError, OSError) as exc:
                figures.blocks_failed += len(transfer.keys)
                log.warning("event=repair_copy_failed source=%s target=%s blocks=%d error=%s", source.node_id,
                            target.node_id, len(transfer.keys), exc)
                continue
            declined = seqs.count(0)  # the target deleted them since the pass listed its keys
            figures.blocks_copied += len(items) - declined
            figures.blocks_declined += declined
            figures.blocks_failed += len(transfer.keys) - len(items)
            figures.bytes_moved += nbytes
            figures.bytes_moved_to[target.node_id] = figures.bytes_moved_to.get(target.node_id, 0) + nbytes

    def _delete(self, plan: RepairPlan, members, figures: RepairFigures) -> None:
        from kvtier.wire import events as p

        for deletion in plan.deletions:
            if self._stop.is_set():
                return
            target = members[deletion.target]
            try:
                gone = self._client(target.address).delete_many(list(deletion.keys))
            except (p.ConnectionLost, p.RemoteError, OSError) as exc:
                figures.blocks_failed += len(deletion.keys)
                log.warning("event=repair_delete_failed target=%s blocks=%d error=%s", target.node_id,
                            len(deletion.keys), exc)
                continue
            figures.blocks_deleted += sum(gone)

    def _add(self, f: RepairFigures) -> None:
        with self._passed:
            self._add_locked(f)
            self._passed.notify_all()

    def _add_locked(self, f: RepairFigures) -> None:
        t = self.total
        for name in ("passes", "keys_listed", "copies_missing", "blocks_copied", "bytes_moved", "blocks_failed",
                     "nodes_unlisted", "keys_deleted", "blocks_deleted", "blocks_declined"):
            setattr(t, name, getattr(t, name) + getattr(f, name))
        for node, n in f.bytes_moved_to.items():
            t.bytes_moved_to[node] = t.bytes_moved_to.get(node, 0) + n
        t.last_pass_s, t.last_pass_unix_s = f.last_pass_s, f.last_pass_unix_s

    def _publish(self) -> None:
        """The totals under /PREFIX/repair/status (no lease: the last figures outlive the process)."""
        with self._passed:
            doc = json.dumps(asdict(self.total), sort_keys=True).encode()
        try:
            EtcdReader(self.url).post("/kv/put", {"key": base64.b64encode(status_key(self.url).encode()).decode(),
                                                  "value": base64.b64encode(doc).decode()})
        except EtcdError as exc:
            log.warning("event=repair_status_not_written error=%s", exc)

    # -- the loop ------------------------------------------------------------------------
    def run(self, interval_s: float = INTERVAL_S_DEFAULT) -> None:
        """A pass now, then at every membership change and every ``interval_s``, until :meth:`stop`."""
        members = open_members(self.url.text)
        try:
            view = members.current()
            while not self._stop.is_set():
                try:
                    self.run_pass(view if not view.stale else None)
                except RepairError as exc:
                    log.error("event=repair_pass_failed error=%s", exc)
                deadline = time.monotonic() + interval_s
                version = view.version
                while not self._stop.is_set() and time.monotonic() < deadline:
                    view = members.wait_changed(version, min(1.0, max(0.0, deadline - time.monotonic())))
                    if view.version != version:
                        break
        finally:
            members.close()


def read_status(url: ClusterUrl, reader: EtcdReader) -> dict | None:
    """The figures the last repair pass wrote, or None when no repairer has run."""
    out = reader.post("/kv/range", {"key": base64.b64encode(status_key(url).encode()).decode()})
    kvs = out.get("kvs", [])
    if not kvs:
        return None
    try:
        return json.loads(base64.b64decode(kvs[0].get("value", "")))
    except ValueError:
        return None


def run_repair_command(args, url: str, token: str | None, emit) -> int:
    """``kvtier cluster repair``: exit 0 after a clean ``--once`` (or SIGINT); 1 when a pass cannot start,
    or ``--once`` left members unlisted or blocks not copied; 2 for a bad option."""
    from kvtier.tools.kvperf.units import parse_size

    if not args.interval > 0:
        print(f"kvtier: cluster repair: --interval must be a positive number of seconds, got {args.interval}",
              file=sys.stderr)
        return 2
    try:
        repairer = ClusterRepairer(url, replicas=args.replicas, rate_bytes_s=parse_size("--rate", args.rate),
                                   token=token)
    except ValueError as exc:  # a bad --rate, --replicas or URL
        print(f"kvtier: cluster repair: {exc}", file=sys.stderr)
        return 2
    try:
        if args.once:
            figures = repairer.run_pass()
            emit(args, asdict(figures), f"repair pass: {figures.keys_listed} keys listed, "
                                        f"{figures.copies_missing} copies missing, {figures.blocks_copied} blocks "
                                        f"copied ({figures.bytes_moved} bytes), {figures.blocks_deleted} deleted "
                                        f"(deleted lately by an owner), {figures.blocks_declined} declined, "
                                        f"{figures.blocks_failed} failed, "
                                        f"{figures.nodes_unlisted} members not listed")
            return 0 if not figures.nodes_unlisted and not figures.blocks_failed else 1
        try:
            repairer.run(args.interval)
        except KeyboardInterrupt:
            repairer.stop()
        return 0
    except (RepairError, ClusterUnavailable) as exc:
        print(f"kvtier: {exc}", file=sys.stderr)
        return 1
    finally:
        repairer.close()
