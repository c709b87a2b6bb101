"""Human-readable renderings of admin API documents for the ``kvtier`` CLI."""
from __future__ import annotations

import datetime

_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: float) -> str:
    value = float(n)
    for unit in _BINARY_UNITS:
        if abs(value) < 1024 or unit == _BINARY_UNITS[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_duration(seconds: float) -> str:
    s = int(seconds)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    parts = [f"{days}d"] if days else []
    if days or hours:
        parts.append(f"{hours}h")
    if days or hours or minutes:
        parts.append(f"{minutes}m")
    parts.append(f"{s}s")
    return " ".join(parts)


def percent(ratio) -> str:
    return "n/a" if ratio is None else f"{100 * ratio:.1f} %"


def render_status(doc: dict) -> str:
    stats = doc["stats"]
    eng = stats.get("engine", {})
    warm = stats.get("tiers", {}).get("warm", {})
    server = stats.get("server", {})
    return "\n".join([
        f"kvtierd at {doc['address']}: {'ready' if doc['ready'] else 'NOT READY'}, "
        f"up {human_duration(doc['health'].get('uptime_s', 0))}",
        f"  data port   {stats.get('addresses', {}).get('data')}",
        f"  blocks      {eng.get('blocks', 0)} ({human_bytes(eng.get('bytes_stored', 0))})",
        f"  regions     {eng.get('regions_total', 0)} total, {eng.get('regions_free', 0)} free, "
        f"{eng.get('regions_sealed', 0)} sealed",
        f"  hit ratio   {percent(warm.get('hit_ratio'))} (warm), prefix {percent(stats.get('lookup', {}).get('prefix_hit_ratio'))}",
        f"  connections {server.get('open_connections', 0)} open",
        f"  errors      {eng.get('device_errors', 0)} device, {eng.get('alloc_failures', 0)} allocation, "
        f"{eng.get('corrupt_reads', 0)} corrupt reads",
    ])


def _section(title: str, rows: dict) -> list[str]:
    lines = [title]
    for key in sorted(rows):
        value = rows[key]
        if isinstance(value, dict):
            continue
        if "bytes" in key.split("_") and isinstance(value, (int, float)):
            shown = human_bytes(value)
        elif isinstance(value, float):
            shown = f"{value:.3f}"
        else:
            shown = value
        lines.append(f"  {key:<24} {shown}")
    return lines


def render_stats(doc: dict) -> str:
    lines = [f"uptime {human_duration(doc.get('uptime_s', 0))}, {'ready' if doc.get('ready') else 'NOT READY'}"]
    lines += _section("engine", doc.get("engine", {}))
    for tier, figures in sorted(doc.get("tiers", {}).items()):
        lines.append(f"tier {tier}: {figures['hits']} hits, {figures['misses']} misses, "
                     f"hit ratio {percent(figures['hit_ratio'])}, read {human_bytes(figures['read_bytes'])}, "
                     f"written {human_bytes(figures['written_bytes'])}")
    lk = doc.get("lookup", {})
    lines.append(f"lookup: {lk.get('keys_hit', 0)} of {lk.get('keys_asked', 0)} keys, "
                 f"prefix hit ratio {percent(lk.get('prefix_hit_ratio'))}")
    server = doc.get("server", {})
    if server:
        lines += _section("server", server)
        for op, count in sorted(server.get("requests", {}).items()):
            hist = server.get("latency", {}).get(op, {})
            mean_ms = 1000 * hist["sum_s"] / hist["count"] if hist.get("count") else 0.0
            lines.append(f"  op {op:<10} {count:>10} requests, mean {mean_ms:.3f} ms")
    for ns, figures in sorted(doc.get("namespaces", {}).items()):
        lines.append(f"namespace {ns}: {figures['hits']} hits, {figures['misses']} misses, "
                     f"hit ratio {percent(figures['hit_ratio'])}")
    return "\n".join(lines)


def render_block_info(doc: dict) -> str:
    lines = [f"{doc['key']}: stored"]
    for key in sorted(doc):
        if key in ("key", "present"):
            continue
        value = doc[key]
        if key == "region_last_access" and isinstance(value, (int, float)) and value > 0:
            value = datetime.datetime.fromtimestamp(value, datetime.timezone.utc).isoformat(timespec="seconds")
        lines.append(f"  {key:<20} {value}")
    return "\n".join(lines)
