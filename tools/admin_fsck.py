"""``kvtier fsck``: run the engine's offline check on a stopped store and report it.

Exit status follows e2fsck: 0 clean; 1 problems found and repaired;
4 problems left in place (run again with ``--repair``).
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict

from kvtier.daemon.engine import EngineConfig
from kvtier.daemon.engine.fsck import FsckReport, check_store

EXIT_CLEAN, EXIT_REPAIRED, EXIT_UNCORRECTED, EXIT_NOT_RUN = 0, 1, 4, 8  # as e2fsck (8: an operational error)


def exit_status(report: FsckReport, repair: bool) -> int:
    if report.clean:
        return EXIT_CLEAN
    return EXIT_REPAIRED if repair and report.repaired_regions else EXIT_UNCORRECTED


def report_document(cfg: EngineConfig, report: FsckReport, repair: bool) -> dict:
    return {"devices": list(cfg.device_paths), "clean": report.clean, "repair": repair,
            "blocks_ok": report.blocks_ok, "blocks_bad": report.blocks_bad,
            "repaired_regions": list(report.repaired_regions),
            "regions": [{**asdict(r), "state": r.state.name.lower()} for r in report.regions]}


def render_report(doc: dict) -> str:
    regions = doc["regions"]
    states = {s: sum(r["state"] == s for r in regions) for s in ("sealed", "open", "free")}
    lines = [f"kvtier fsck: {len(doc['devices'])} device(s), {len(regions)} regions "
             f"({states['sealed']} sealed, {states['open']} open, {states['free']} free)"]
    shown = [r for r in regions if r["state"] != "free" or r["note"]]
    if shown:
        lines.append(f"  {'region':>6}  {'state':<7} {'ok':>7} {'bad':>5}  note")
    repaired = set(doc["repaired_regions"])
    for r in shown:
        flag = " [repaired]" if r["region"] in repaired else ""
        lines.append(f"  {r['region']:>6}  {r['state']:<7} {r['entries_ok']:>7} {r['entries_bad']:>5}  "
                     f"{r['note']}{flag}")
    if doc["clean"]:
        lines.append(f"clean: {doc['blocks_ok']} blocks verified")
    elif doc["repair"]:
        lines.append(f"repaired {len(repaired)} region(s): dropped {doc['blocks_bad']} bad entries, "
                     f"{doc['blocks_ok']} blocks verified")
    else:
        lines.append(f"NOT CLEAN: {doc['blocks_bad']} bad entries, {states['open']} unsealed region(s); "
                     "run `kvtier fsck --repair` on the stopped store to drop them")
    return "\n".join(lines)


def run_fsck(cfg: EngineConfig, repair: bool, as_json: bool) -> int:
    report = check_store(cfg, repair=repair)
    doc = report_document(cfg, report, repair)
    if as_json:
        json.dump(doc, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        print(render_report(doc))
    return exit_status(report, repair)
