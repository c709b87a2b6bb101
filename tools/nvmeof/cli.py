"""``kvtier nvmeof export | unexport | connect``: the command-line side of NVMe-oF.

::

    kvtier nvmeof export   --addr IP --host HOSTNQN... [--transport tcp|rdma] [--trsvcid 4420]
                           [--port-id 1] [--nqn NQN] [--devices-json F] [--configfs DIR] [--dry-run]
    kvtier nvmeof unexport [--nqn NQN | --devices-json F] [--configfs DIR] [--dry-run]
    kvtier nvmeof connect  --addr IP [--transport tcp|rdma] [--trsvcid 4420] [--nqn NQN]
                           [--hostnqn NQN] [--devices-json F | --data HOST:PORT] [--device-map F]
                           [--run] [--write-protect] [--wait-s 30] [--sysfs DIR] [--dev DIR]

The daemon's devices (ids and paths) come from ``--devices-json`` (what
``kvtier --json devices`` prints, or its ``--map`` form), else from ``--data`` (the HELLO
geometry; ids only, enough for connect), else from the admin API (``kvtier --admin``).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

from .configfs import ApplyError, ConfigfsApplier, check_nvmet_root, read_state
from .connect_plan import (ConnectConfig, connect_command, read_only_commands, resolve_device_map,
                           write_protect_commands)
from .export_plan import (DEFAULT_PORT_ID, DEFAULT_TRSVCID, TRANSPORTS, ExportConfig, ExportDevice, PlanError,
                          default_nqn, export_plan, render_shell, unexport_plan)
from .host_devices import WAIT_S_MAX, read_namespace_uuids, wait_for_namespaces

DEFAULT_CONFIGFS = "/sys/kernel/config"
DEFAULT_WAIT_S = 30.0  # namespaces appear within seconds of a connect on a healthy fabric
COMMAND_TIMEOUT_S = 120.0  # nvme connect retries a dead target for about a minute by itself
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


# -- the daemon's devices --------------------------------------------------------------
def devices_from_doc(doc, paths_needed: bool = True) -> list[ExportDevice | str]:
    """Devices from ``/v1/devices`` (``{"devices": [{"device_id", "path"}, ...]}``) or from
    its map form (``{id: path}``), in stripe order."""
    if isinstance(doc, dict) and isinstance(doc.get("devices"), list):
        entries = doc["devices"]
        for i, d in enumerate(entries):
            if not (isinstance(d, dict) and isinstance(d.get("device_id"), str)
                    and (isinstance(d.get("path"), str) or not paths_needed)):
                raise PlanError(f"devices: entry {i} needs a device_id and a path (the output of 'kvtier --json "
                                "devices' on the daemon's host)")
        return [ExportDevice(d["device_id"], d.get("path") or "/") for d in entries]
    if isinstance(doc, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in doc.items()):
        return [ExportDevice(k, v) for k, v in doc.items()]
    raise PlanError("devices: expected the output of 'kvtier --json devices' (or of 'devices --map')")


def _usage_error(message: str):
    from kvtier.tools.admin_cli import UsageError  # the CLI's own error class, turned into exit 2

    return UsageError(message)


def load_devices(args, *, paths_needed: bool) -> list[ExportDevice]:
    if args.devices_json:
        try:
            with open(args.devices_json, "rb") as fh:
                doc = json.load(fh)
        except OSError as exc:
            raise _usage_error(f"devices file {args.devices_json}: {exc.strerror}") from None
        except ValueError as exc:
            raise _usage_error(f"devices file {args.devices_json}: not JSON: {exc}") from None
        return devices_from_doc(doc, paths_needed)
    if getattr(args, "data", None):
        if paths_needed:
            raise _usage_error("--data gives device ids only; export needs their paths (--devices-json or --admin)")
        return [ExportDevice(dev, "/") for dev in _hello_device_ids(args)]
    from kvtier.tools.admin_cli import resolve_admin

    return devices_from_doc(resolve_admin(args).devices(), paths_needed)


def _hello_device_ids(args) -> tuple[str, ...]:
    from kvtier.client import BlockClient, ClientError
    from kvtier.tools.admin_cli import read_token_file

    token = args.token or os.environ.get("KVTIER_TOKEN")
    token_file = args.token_file or os.environ.get("KVTIER_TOKEN_FILE")
    if token is None and token_file:
        token = read_token_file(token_file)
    try:
        with BlockClient(args.data, token=token) as client:
            return client.geometry().device_ids
    except (OSError, ClientError) as exc:
        raise RuntimeError(f"daemon {args.data}: {exc}") from None


# -- export / unexport -----------------------------------------------------------------
def _apply(args, ops, what: str) -> int:
    if args.dry_run:
        sys.stdout.write(render_shell(ops, args.configfs) + "\n")
        return EXIT_OK
    try:
        check_nvmet_root(args.configfs)
    except FileNotFoundError as exc:
        print(f"kvtier: {exc.strerror}", file=sys.stderr)
        return EXIT_FAILED
    try:
        result = ConfigfsApplier(args.configfs).apply(ops)
    except ApplyError as exc:
        hint = "; 'kvtier nvmeof unexport' removes what was made" if what == "export" and exc.done else ""
        print(f"kvtier: {what} failed at operation {exc.done + 1} of {len(ops)}: {exc}{hint}", file=sys.stderr)
        return EXIT_FAILED
    doc = {what: True, "operations": len(ops), "applied": result.applied, "skipped": result.skipped}
    _emit(args, doc, f"{what}: {result.applied} operations applied, {result.skipped} already in effect")
    return EXIT_OK


def cmd_export(args) -> int:
    devices = load_devices(args, paths_needed=True)
    cfg = ExportConfig(nqn=args.nqn or default_nqn([d.device_id for d in devices]), devices=tuple(devices),
                       traddr=args.addr, hosts=tuple(args.host or ()), transport=args.transport,
                       trsvcid=args.trsvcid, port_id=args.port_id)
    code = _apply(args, export_plan(cfg), "export")
    if code == EXIT_OK and not args.dry_run and not args.json:
        print(f"subsystem {cfg.nqn}: {len(cfg.devices)} namespaces on {cfg.transport}://{cfg.traddr}:{cfg.trsvcid} "
              f"for {len(cfg.hosts)} host(s)")
    return code


def cmd_unexport(args) -> int:
    nqn = args.nqn or default_nqn([d.device_id for d in load_devices(args, paths_needed=False)])
    try:
        check_nvmet_root(args.configfs)
    except FileNotFoundError as exc:
        print(f"kvtier: {exc.strerror}", file=sys.stderr)
        return EXIT_FAILED
    state = read_state(args.configfs, nqn)
    if not state.exists:
        _emit(args, {"unexport": False, "nqn": nqn}, f"subsystem {nqn} is not exported under {args.configfs}")
        return EXIT_OK
    return _apply(args, unexport_plan(state), "unexport")


# -- connect ---------------------------------------------------------------------------
def _run(argv: list[str]) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except FileNotFoundError:
        raise RuntimeError(f"{argv[0]}: not found (install nvme-cli / util-linux, or give its path)") from None
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{shlex.join(argv)}: no answer in {COMMAND_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} exited {done.returncode}: {(done.stderr or done.stdout).strip()}")


def write_device_map(path: str, device_map: dict[str, str]) -> None:
    """Written whole or not at all (a reader never sees half a map)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".device-map-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(device_map, fh, indent=2)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def cmd_connect(args) -> int:
    ids = tuple(d.device_id for d in load_devices(args, paths_needed=False))
    cfg = ConnectConfig(nqn=args.nqn or default_nqn(list(ids)), traddr=args.addr, device_ids=ids,
                        transport=args.transport, trsvcid=args.trsvcid, hostnqn=args.hostnqn)
    connect = connect_command(cfg, args.nvme_cli)
    visible = resolve_device_map(ids, read_namespace_uuids(args.sysfs), args.dev)
    ran: list[list[str]] = []
    if args.run:
        if not 0 <= args.wait_s <= WAIT_S_MAX:
            raise PlanError(f"--wait-s {args.wait_s:g} is outside 0..{WAIT_S_MAX:g}")
        if visible.missing:  # connected already when every namespace shows: a second connect fails
            _run(connect)
            ran.append(connect)
        visible = wait_for_namespaces(ids, args.sysfs, args.dev, args.wait_s)
        if visible.missing:
            raise RuntimeError(f"after {args.wait_s:g} s no namespace shows daemon device(s) "
                               f"{', '.join(visible.missing)} (ls {args.sysfs}/block/nvme*/uuid)")
        follow = read_only_commands(visible.device_map, args.blockdev)
        if args.write_protect:
            follow += write_protect_commands(visible.device_map, ids, args.nvme_cli)
        for argv in follow:
            _run(argv)
            ran.append(argv)
    planned = [connect] + read_only_commands(visible.device_map or _placeholders(ids), args.blockdev)
    if args.write_protect:
        planned += write_protect_commands(visible.device_map or _placeholders(ids), ids, args.nvme_cli)
    complete = not visible.missing
    if complete and args.device_map:
        write_device_map(args.device_map, visible.device_map)
    doc = {"nqn": cfg.nqn, "commands": [shlex.join(a) for a in (ran if args.run else planned)],
           "device_map": visible.device_map, "missing": list(visible.missing),
           "device_map_file": args.device_map if complete and args.device_map else None}
    _emit(args, doc, _render_connect(args, doc, complete))
    return EXIT_OK


def _placeholders(ids: tuple[str, ...]) -> dict[str, str]:
    return {dev: f"/dev/nvmeXn{nsid}" for nsid, dev in enumerate(ids, start=1)}


def _render_connect(args, doc: dict, complete: bool) -> str:
    lines = [("ran: " if args.run else "") + c for c in doc["commands"]]
    if not args.run and not complete:
        lines.append("# the namespaces are not attached yet: run the commands above (or this command with --run);")
        lines.append("# run it again once they show to write the device map and the real /dev names")
    if complete:
        lines.append("device map: " + json.dumps(doc["device_map"]))
        if doc["device_map_file"]:
            lines.append(f"written to {doc['device_map_file']}")
    return "\n".join(lines)


def _emit(args, doc, human: str) -> None:
    if args.json:
        json.dump(doc, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(human + "\n")


def _checked(fn):
    """Config errors become the CLI's usage errors (exit 2); a failed step (a command, the
    daemon unreachable) is printed and exits 1."""
    def run(args) -> int:
        try:
            return fn(args)
        except PlanError as exc:
            raise _usage_error(str(exc)) from None
        except RuntimeError as exc:
            print(f"kvtier: {exc}", file=sys.stderr)
            return EXIT_FAILED
    return run


# -- parser ----------------------------------------------------------------------------
def _add_target(sp, *, export: bool) -> None:
    sp.add_argument("--addr", required=True, metavar="IP",
                    help="the storage node's address on the fabric" + (" (the port listens there)" if export else ""))
    sp.add_argument("--transport", choices=TRANSPORTS, default="tcp", help="fabric transport (default tcp)")
    sp.add_argument("--trsvcid", type=int, default=DEFAULT_TRSVCID, metavar="PORT",
                    help=f"service (TCP) port (default {DEFAULT_TRSVCID})")
    sp.add_argument("--nqn", help="subsystem NQN (default: nqn.2014-08.org.nvmexpress:uuid:<first device id>)")
    sp.add_argument("--devices-json", metavar="FILE", help="the output of 'kvtier --json devices' (default: ask "
                                                          "the admin API)")


def add_nvmeof_parser(sub) -> None:
    """Adds ``nvmeof`` and its commands to the ``kvtier`` parser's subcommands."""
    sp = sub.add_parser("nvmeof", help="export the devices over NVMe-oF (storage node) or attach them (client)")
    nsub = sp.add_subparsers(dest="nvmeof_command", required=True, metavar="NVMEOF_COMMAND")

    ep = nsub.add_parser("export", help="write the nvmet configfs entries that export the daemon's devices")
    _add_target(ep, export=True)
    ep.add_argument("--host", action="append", metavar="HOSTNQN", required=True,
                    help="a client's host NQN (its /etc/nvme/hostnqn), repeatable; no other host may connect")
    ep.add_argument("--port-id", type=int, default=DEFAULT_PORT_ID, help=f"nvmet port id (default {DEFAULT_PORT_ID})")
    ep.add_argument("--configfs", default=DEFAULT_CONFIGFS, help=f"configfs root (default {DEFAULT_CONFIGFS})")
    ep.add_argument("--dry-run", action="store_true", help="print the operations as shell commands, change nothing")
    ep.set_defaults(fn=_checked(cmd_export))

    up = nsub.add_parser("unexport", help="remove the export (port link, hosts, namespaces, subsystem)")
    up.add_argument("--nqn", help="subsystem NQN (default: derived from the daemon's devices)")
    up.add_argument("--devices-json", metavar="FILE", help="the output of 'kvtier --json devices'")
    up.add_argument("--configfs", default=DEFAULT_CONFIGFS, help=f"configfs root (default {DEFAULT_CONFIGFS})")
    up.add_argument("--dry-run", action="store_true", help="print the operations as shell commands, change nothing")
    up.set_defaults(fn=_checked(cmd_unexport))

    cp = nsub.add_parser("connect", help="print (or --run) the nvme connect commands and write the device map")
    _add_target(cp, export=False)
    cp.add_argument("--data", metavar="HOST:PORT", help="take the device ids from the daemon's HELLO instead")
    cp.add_argument("--hostnqn", help="this host's NQN (default: nvme-cli's, /etc/nvme/hostnqn)")
    cp.add_argument("--device-map", metavar="FILE", help="write {device id: /dev/nvmeXnY} here (JSON) once "
                                                        "every namespace shows")
    cp.add_argument("--run", action="store_true", help="run the commands (default: print them)")
    cp.add_argument("--write-protect", action="store_true",
                    help="also set the NVMe Write Protect feature on each namespace (see docs/operations.md)")
    cp.add_argument("--wait-s", type=float, default=DEFAULT_WAIT_S,
                    help=f"with --run: how long to wait for the namespaces (default {DEFAULT_WAIT_S:g})")
    cp.add_argument("--sysfs", default="/sys", help=argparse.SUPPRESS)
    cp.add_argument("--dev", default="/dev", help=argparse.SUPPRESS)
    cp.add_argument("--nvme-cli", default="nvme", metavar="PATH", help="the nvme program (default nvme)")
    cp.add_argument("--blockdev", default="blockdev", metavar="PATH", help="the blockdev program (default blockdev)")
    cp.set_defaults(fn=_checked(cmd_connect))
