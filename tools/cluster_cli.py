"""``kvtier cluster status``: the members etcd lists, their leases, and each node's figures.

::

    kvtier [--token-file F] [--json] cluster status --cluster etcd://HOST:PORT/PREFIX

For each member: node id, data and admin addresses, the lease's remaining TTL (from etcd)
and, where the node answers, its headline figures (admin API ``/v1/stats``, else the data
port's STATS) with the members it sees and the bytes the repairer moved to it; then the
cluster's re-replication figures (``kvtier cluster repair`` writes them to etcd). The URL comes from ``--cluster``, else ``$KVTIER_CLUSTER``, else the
config file's ``cluster`` key. etcd not answering is exit 1 with the URL; a member that
does not answer is listed as unreachable.
"""
from __future__ import annotations

from kvtier.client.cluster_etcd import EtcdError, EtcdReader
from kvtier.client.cluster_members import ClusterUnavailable, Member, MemberTable
from kvtier.common.cluster_url import ClusterUrlError, parse_cluster_url
from kvtier.tools.cluster_repair import read_status
from kvtier.tools.admin_client import AdminClient, AdminError
from kvtier.tools.admin_render import human_bytes, percent

STATS_SHOWN = ("blocks", "bytes_stored", "regions_free", "open_connections")  # the human table's columns
NODE_TIMEOUT_S = 2.0  # a member that does not answer this fast is listed as unreachable


class ClusterCliError(Exception):
    """etcd did not answer, or the URL is bad; the message names the URL."""


def _admin_figures(member: Member, token: str | None) -> dict:
    stats = AdminClient(member.admin, token, timeout_s=NODE_TIMEOUT_S).stats()
    engine, warm = stats.get("engine", {}), stats.get("tiers", {}).get("warm", {})
    cluster = stats.get("cluster") or {}
    return {"source": "admin", "blocks": engine.get("blocks", 0), "bytes_stored": engine.get("bytes_stored", 0),
            "regions_free": engine.get("regions_free", 0), "hit_ratio": warm.get("hit_ratio"),
            "open_connections": stats.get("server", {}).get("open_connections", 0),
            "members_seen": cluster.get("members_seen"), "re_registrations": cluster.get("re_registrations")}


def _data_figures(member: Member, token: str | None) -> dict:
    from kvtier.client.block_client import BlockClient

    with BlockClient(member.address, token, pool_size=1, timeout_s=NODE_TIMEOUT_S) as client:
        stats = client.stats()
    flat = {}
    for k, v in stats.items():  # STATS nests one level (engine, server): keep the scalars, dotted
        for name, value in (v.items() if isinstance(v, dict) else [("", v)]):
            if isinstance(value, (int, float, str)) and not isinstance(value, bool):
                flat[f"{k}.{name}" if name else k] = value
    return {"source": "stats", **flat}


def node_figures(member: Member, token: str | None) -> tuple[dict | None, str | None]:
    """(figures, None) from the node's admin API (else its data port), or (None, why not)."""
    try:
        if member.admin is not None:
            return _admin_figures(member, token), None
        return _data_figures(member, token), None
    except (AdminError, OSError, ConnectionError, TimeoutError) as exc:
        return None, str(getattr(exc, "message", exc)) or type(exc).__name__
    except Exception as exc:  # a protocol refusal from the data port (wire.events errors): report, go on
        return None, f"{type(exc).__name__}: {exc}"


def cluster_status(url_text: str, token: str | None = None) -> dict:
    """The status document ``kvtier cluster status --json`` prints."""
    try:
        url = parse_cluster_url(url_text, what="--cluster")
        reader = EtcdReader(url)
        kvs, revision = reader.members()
        table = MemberTable(url)
        table.reset(kvs, revision)
        members = table.view().members
        ttls = {m.node_id: reader.lease_ttl_s(m.lease_id) if m.lease_id else None for m in members}
        repair = read_status(url, reader)
    except (ClusterUrlError, ClusterUnavailable, EtcdError) as exc:
        raise ClusterCliError(str(exc)) from None
    nodes = []
    moved_to = (repair or {}).get("bytes_moved_to", {})
    for m in members:
        figures, error = node_figures(m, token)
        nodes.append({"node_id": m.node_id, "data": m.address, "admin": m.admin, "lease_id": m.lease_id,
                      "lease_ttl_s": ttls[m.node_id], "reachable": figures is not None, "figures": figures,
                      "error": error, "repair_bytes_received": moved_to.get(m.node_id, 0)})
    return {"cluster": url.text, "revision": revision, "members": nodes, "bad_records": table.bad_records,
            "repair": repair}


def render_cluster_status(doc: dict) -> str:
    lines = [f"cluster {doc['cluster']}: {len(doc['members'])} member(s) at etcd revision {doc['revision']}"]
    if doc["bad_records"]:
        lines.append(f"  {doc['bad_records']} member key(s) with an unreadable record skipped")
    header = f"  {'NODE':<24} {'DATA':<22} {'ADMIN':<22} {'TTL':>4}  FIGURES"
    lines.append(header)
    for n in doc["members"]:
        ttl = "-" if n["lease_ttl_s"] is None else f"{n['lease_ttl_s']}s"
        f = n["figures"]
        if f is None:
            figures = f"unreachable: {n['error']}"
        elif f["source"] == "admin":
            figures = (f"{f['blocks']} blocks ({human_bytes(f['bytes_stored'])}), hit {percent(f['hit_ratio'])}, "
                       f"{f['open_connections']} connections, sees {f['members_seen']} members, "
                       f"{human_bytes(n['repair_bytes_received'])} repaired in")
        else:
            picked = {k: v for k, v in f.items() if k.rsplit(".", 1)[-1] in STATS_SHOWN}
            figures = ", ".join(f"{k}={v}" for k, v in sorted(picked.items()))
        lines.append(f"  {n['node_id']:<24} {n['data']:<22} {n['admin'] or '-':<22} {ttl:>4}  {figures}")
    r = doc.get("repair")
    lines.append("  repair: none run yet (kvtier cluster repair)" if r is None else
                 f"  repair: {r['passes']} passes, {r['blocks_copied']} blocks copied "
                 f"({human_bytes(r['bytes_moved'])} moved), {r['blocks_failed']} failed, last pass "
                 f"{r['last_pass_s']:.1f} s")
    return "\n".join(lines)
