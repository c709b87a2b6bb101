"""``kvtier``: the operator's command line for kvtierd.

::

    kvtier [--admin HOST:PORT] [--token T | --token-file F] [--config F] [--json] COMMAND

    status                         alive? ready? uptime, blocks, regions, hit ratios
    stats                          every figure of /v1/stats
    info KEY                       where a block lives (size, codec, region, pinned, last access)
    get KEY [-o FILE] [--block]    a block's payload (or the whole stored block)
    put KEY FILE [--namespace-id HEX] [--codec NAME] [--durable] [--block]
    lookup|pin|unpin (KEY... | --namespace NS.json --tokens LIST|@FILE)
    evict (KEY... | --namespace-id HEX | --namespace NS.json | --all)
    config                         the daemon's effective config (secrets redacted)
    preplace (KEY... | --namespace NS.json --tokens LIST) [--edge E]... [--ttl-s N] | --push | --status
                                   a region: soft-pin a prefix on its edges (tools/preplace_cli.py)
    cluster status [--cluster etcd://HOST:PORT/PREFIX]   members, leases, per-node figures
    cluster repair [--cluster URL] [--rate 64m] [--once] re-replicate to owners that lack blocks
    nvmeof export|unexport|connect ...   NVMe-oF: nvmet configfs export, nvme connect + device map
    fsck  [--device P]... [--repair]   offline: scan a STOPPED store's regions
    format [--device P]... [--force]   offline: write a new, empty store

Online commands talk to the admin API. Its address and token come from the
flags, else ``$KVTIER_ADMIN`` / ``$KVTIER_TOKEN`` / ``$KVTIER_TOKEN_FILE``, else
the config file (``--config``, ``$KVTIER_CONFIG``, or /etc/kvtier/kvtierd.toml
when readable), else ``127.0.0.1:7411`` without a token. Offline commands
(fsck, format) take the store's geometry from the same config file and flags.

Exit status: 0 success; 1 a failed request or a key not found; 2 bad usage;
for fsck 0 clean, 1 corruption found and repaired, 4 corruption left in place.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from kvtier.common.blockformat import BlockFormatError, encode_block, payload_of, verify_block
from kvtier.daemon.engine.errors import EngineError
from kvtier.daemon.config import ConfigError, DaemonConfig, load_toml, parse_size
from kvtier.common import tokens as auth_tokens
from kvtier.common.codec_ids import OPAQUE_CODEC_ID, codec_id
from kvtier.tools.admin_client import DEFAULT_ADMIN_ADDRESS, AdminClient, AdminError
from kvtier.tools.admin_render import render_block_info, render_stats, render_status
from kvtier.tools.nvmeof.cli import add_nvmeof_parser

DEFAULT_CONFIG_PATH = "/etc/kvtier/kvtierd.toml"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad flags or arguments; the message says which."""


# -- where the daemon is -------------------------------------------------------------
def _config_path(args) -> str | None:
    path = args.config or os.environ.get("KVTIER_CONFIG")
    if path:
        return path
    return DEFAULT_CONFIG_PATH if os.access(DEFAULT_CONFIG_PATH, os.R_OK) else None


def _config_settings(args) -> dict:
    path = _config_path(args)
    return load_toml(path) if path else {}


def read_token_file(path: str) -> str:
    """The token in ``path``, read as the daemon reads it."""
    try:
        return auth_tokens.read_token_file(path)
    except auth_tokens.TokenFileError as exc:
        raise UsageError(str(exc)) from None


def resolve_admin(args) -> AdminClient:
    """Flags, then environment, then the config file, then the default."""
    settings = None
    address = args.admin or os.environ.get("KVTIER_ADMIN")
    if address is None:
        settings = _config_settings(args)
        address = settings.get("admin", DEFAULT_ADMIN_ADDRESS)
        if address == "none":
            raise UsageError(f"the config file {_config_path(args)} disables the admin API (admin = \"none\")")
    token = args.token or os.environ.get("KVTIER_TOKEN")
    if token is None:
        token_file = args.token_file or os.environ.get("KVTIER_TOKEN_FILE")
        if token_file is None:
            settings = settings if settings is not None else _config_settings(args)
            token_file = settings.get("token_file")
        token = read_token_file(token_file) if token_file else None
    try:
        return AdminClient(address, token)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def resolve_store(args) -> DaemonConfig:
    """The store's devices and geometry: flags over the config file."""
    settings = _config_settings(args)
    if args.device:
        settings["devices"] = tuple(args.device)
    if args.data_dir:
        settings["data_dir"] = args.data_dir
    for flag, field in (("device_size", "device_size_bytes"), ("stripe_size", "stripe_size_bytes"),
                        ("region_size", "region_size_bytes")):
        value = getattr(args, flag)
        if value is not None:
            settings[field] = parse_size(value, "--" + flag.replace("_", "-"))
    return DaemonConfig(**settings)


# -- selections ----------------------------------------------------------------------
def parse_key(text: str) -> bytes:
    text = text.strip().lower().removeprefix("0x")
    if len(text) != 32:
        raise UsageError(f"a key is 32 hex digits, got {text!r} ({len(text)} characters)")
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise UsageError(f"key {text!r} is not hexadecimal") from None


def _read_json_file(path: str, what: str):
    try:
        with open(path, "rb") as fh:
            return json.load(fh)
    except OSError as exc:
        raise UsageError(f"{what} {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise UsageError(f"{what} {path}: not JSON: {exc}") from None


def parse_tokens(text: str) -> list[int]:
    """``1,2,3`` / ``1 2 3`` / ``@file`` (the same forms, or a JSON list)."""
    if text.startswith("@"):
        try:
            with open(text[1:], encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise UsageError(f"tokens file {text[1:]}: {exc.strerror}") from None
    text = text.strip()
    if text.startswith("["):
        try:
            values = json.loads(text)
        except ValueError as exc:
            raise UsageError(f"tokens: not a JSON list: {exc}") from None
    else:
        values = text.replace(",", " ").split()
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError):
        raise UsageError("tokens must be integers") from None


def key_selection(args) -> dict:
    """The JSON body naming blocks: keys, or a namespace with tokens."""
    if args.keys and (args.namespace or args.tokens):
        raise UsageError("give keys, or --namespace with --tokens, not both")
    if args.keys:
        return {"keys": [parse_key(k).hex() for k in args.keys]}
    if not (args.namespace and args.tokens):
        raise UsageError("give keys, or --namespace NS.json with --tokens LIST|@FILE")
    return {"namespace": _read_json_file(args.namespace, "namespace file"), "tokens": parse_tokens(args.tokens)}


def evict_request(args) -> dict:
    given = sum([bool(args.keys), args.namespace_id is not None, args.namespace is not None, args.all])
    if given != 1:
        raise UsageError("give exactly one of: keys, --namespace-id HEX, --namespace NS.json, --all")
    if args.keys:
        return {"keys": [parse_key(k).hex() for k in args.keys]}
    if args.namespace_id is not None:
        return {"namespace_id": parse_key(args.namespace_id).hex()}
    if args.namespace is not None:
        return {"namespace": _read_json_file(args.namespace, "namespace file")}
    return {"all": True}


# -- commands ------------------------------------------------------------------------
def _emit(args, doc, human) -> None:
    if args.json:
        json.dump(doc, sys.stdout, indent=2)  # in the daemon's order: 'devices --map' lists them in stripe order
        sys.stdout.write("\n")
    else:
        sys.stdout.write(human if human.endswith("\n") else human + "\n")


def cmd_status(args) -> int:
    admin = resolve_admin(args)
    doc = {"address": admin.address, "health": admin.healthz(), "ready": admin.readyz().get("ready", False),
           "stats": admin.stats()}
    _emit(args, doc, render_status(doc))
    return EXIT_OK


def cmd_stats(args) -> int:
    doc = resolve_admin(args).stats()
    _emit(args, doc, render_stats(doc))
    return EXIT_OK


def cmd_config(args) -> int:
    doc = resolve_admin(args).config()
    _emit(args, doc, "\n".join(f"{k} = {json.dumps(v)}" for k, v in sorted(doc.items())))
    return EXIT_OK


def cmd_devices(args) -> int:
    doc = resolve_admin(args).devices()
    if args.map:  # {device id: path}, ready for KVCache(device_map=...)
        doc = {d["device_id"]: d["path"] for d in doc["devices"]}
        _emit(args, doc, "\n".join(f"{dev} {path}" for dev, path in doc.items()))
        return EXIT_OK
    lines = [f"{d['index']}  {d['device_id']}  {d['path']}" for d in doc["devices"]]
    lines.append(f"stripe {doc['stripe_size_bytes']} B, data offset {doc['data_offset_bytes']} B, "
                 f"{doc['device_data_bytes']} B of data per device")
    _emit(args, doc, "\n".join(lines))
    return EXIT_OK


def cmd_info(args) -> int:
    key = parse_key(args.key)
    doc = resolve_admin(args).block_info(key)
    if doc is None:
        _emit(args, {"key": key.hex(), "present": False}, f"{key.hex()}: not stored")
        return EXIT_FAILED
    _emit(args, doc, render_block_info(doc))
    return EXIT_OK


def cmd_get(args) -> int:
    key = parse_key(args.key)
    block = resolve_admin(args).get_block(key)
    if block is None:
        print(f"kvtier: block {key.hex()} is not stored", file=sys.stderr)
        return EXIT_FAILED
    try:
        header = verify_block(block, expected_key=key)
    except BlockFormatError as exc:
        print(f"kvtier: block {key.hex()} failed verification: {exc}", file=sys.stderr)
        return EXIT_FAILED
    data = bytes(block) if args.block else bytes(payload_of(block))
    if args.output and args.output != "-":
        try:
            with open(args.output, "wb") as fh:
                fh.write(data)
        except OSError as exc:
            raise UsageError(f"-o {args.output}: {exc.strerror}") from None
        print(f"{key.hex()}: {len(data)} bytes -> {args.output} (seq {header.seq})", file=sys.stderr)
    else:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    return EXIT_OK


def cmd_put(args) -> int:
    key = parse_key(args.key)
    try:
        with open(args.file, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise UsageError(f"{args.file}: {exc.strerror}") from None
    if args.block:
        try:
            verify_block(data, expected_key=key)
        except BlockFormatError as exc:
            raise UsageError(f"{args.file} is not a valid block for key {key.hex()}: {exc}") from None
        block = data
    else:
        ns_id = parse_key(args.namespace_id) if args.namespace_id else bytes(16)
        try:
            cid = codec_id(args.codec) if args.codec else OPAQUE_CODEC_ID
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        block = encode_block(key, ns_id, cid, data)
    doc = resolve_admin(args).put_block(key, block, durable=args.durable)
    _emit(args, doc, f"{key.hex()}: stored {doc['size_bytes']} bytes (seq {doc['seq']}"
                     f"{', durable' if doc.get('durable') else ''})")
    return EXIT_OK


def cmd_lookup(args) -> int:
    doc = resolve_admin(args).lookup(key_selection(args))
    _emit(args, doc, f"{doc['hit_blocks']} of {doc['requested']} leading blocks stored")
    return EXIT_OK


def _cmd_pin(args, pin: bool) -> int:
    admin = resolve_admin(args)
    selection = key_selection(args)
    doc = admin.pin(selection) if pin else admin.unpin(selection)
    verb = "pinned" if pin else "unpinned"
    lines = [f"{doc[verb]} of {doc['requested']} blocks {verb}"]
    lines += [f"  not stored: {k}" for k in doc["missing"]]
    _emit(args, doc, "\n".join(lines))
    return EXIT_OK if not doc["missing"] else EXIT_FAILED


def cmd_pin(args) -> int:
    return _cmd_pin(args, True)


def cmd_unpin(args) -> int:
    return _cmd_pin(args, False)


def cmd_evict(args) -> int:
    doc = resolve_admin(args).evict(evict_request(args))
    _emit(args, doc, f"evicted {doc['evicted_blocks']} blocks ({doc['scope']})")
    return EXIT_OK


def _cluster_url_and_token(args, command: str) -> tuple[str, str | None]:
    url = args.cluster or os.environ.get("KVTIER_CLUSTER") or _config_settings(args).get("cluster")
    if not url:
        raise UsageError(f"cluster {command} needs --cluster etcd://HOST:PORT/PREFIX (or $KVTIER_CLUSTER, "
                         "or cluster in the config file)")
    token = args.token or os.environ.get("KVTIER_TOKEN")
    token_file = args.token_file or os.environ.get("KVTIER_TOKEN_FILE")
    if token is None and token_file:
        token = read_token_file(token_file)
    return url, token


def cmd_cluster_repair(args) -> int:
    from kvtier.tools.cluster_repair import run_repair_command
    url, token = _cluster_url_and_token(args, "repair")
    return run_repair_command(args, url, token, _emit)


def cmd_cluster_status(args) -> int:
    from kvtier.tools.cluster_cli import ClusterCliError, cluster_status, render_cluster_status
    url, token = _cluster_url_and_token(args, "status")
    try:
        doc = cluster_status(url, token)
    except ClusterCliError as exc:
        print(f"kvtier: {exc}", file=sys.stderr)
        return EXIT_FAILED
    _emit(args, doc, render_cluster_status(doc))
    return EXIT_OK


def cmd_fsck(args) -> int:
    from kvtier.daemon.engine import EngineError
    from kvtier.tools.admin_fsck import EXIT_NOT_RUN, run_fsck

    try:
        return run_fsck(resolve_store(args).engine_config(), repair=args.repair, as_json=args.json)
    except EngineError as exc:  # a device missing, in use by a running kvtierd, unreadable: nothing checked
        print(f"kvtier: fsck: {exc}", file=sys.stderr)
        return EXIT_NOT_RUN


def cmd_format(args) -> int:
    from kvtier.daemon.engine import Engine

    cfg = resolve_store(args).engine_config()
    Engine.format(cfg, force=args.force, force_hint="--force")
    _emit(args, {"formatted": list(cfg.device_paths)}, f"formatted {len(cfg.device_paths)} device(s): "
                                                         + ", ".join(cfg.device_paths))
    return EXIT_OK


# -- parser --------------------------------------------------------------------------
def _add_selection(sp, what: str) -> None:
    sp.add_argument("keys", nargs="*", metavar="KEY", help=f"keys (32 hex digits) to {what}")
    sp.add_argument("--namespace", metavar="NS.json",
                    help="namespace fields as JSON: model, layout{num_layers,num_kv_heads,head_dim,dtype,"
                         "block_tokens}, codec, tenant_salt, extra")
    sp.add_argument("--tokens", metavar="LIST|@FILE", help="token ids: '1,2,3' or @file (with --namespace)")


def _add_store(sp) -> None:
    sp.add_argument("--device", action="append", help="device path (repeatable; default: the config's)")
    sp.add_argument("--data-dir", help="data directory of the embedded default store")
    sp.add_argument("--device-size", help="size of device files (k/m/g)")
    sp.add_argument("--stripe-size", help="RAID0 stripe unit (k/m/g)")
    sp.add_argument("--region-size", help="region size (k/m/g)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvtier", description="Operate a kvtierd storage node.")
    ap.add_argument("--admin", metavar="HOST:PORT", help=f"admin API address (default {DEFAULT_ADMIN_ADDRESS})")
    token = ap.add_mutually_exclusive_group()  # one token, named once: never a silent choice between two
    token.add_argument("--token", help="admin token (prefer --token-file or $KVTIER_TOKEN_FILE)")
    token.add_argument("--token-file", help="file holding the admin token")
    ap.add_argument("--config", help=f"kvtierd config file (default {DEFAULT_CONFIG_PATH} when readable)")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser("status", help="alive, ready, uptime and headline figures").set_defaults(fn=cmd_status)
    sub.add_parser("stats", help="every statistic").set_defaults(fn=cmd_stats)
    sub.add_parser("config", help="the daemon's effective config").set_defaults(fn=cmd_config)
    sp = sub.add_parser("devices", help="device ids and paths in stripe order (the direct-read device map)")
    sp.add_argument("--map", action="store_true", help="only {device id: path}, as KVCache's device_map")
    sp.set_defaults(fn=cmd_devices)
    sp = sub.add_parser("info", help="where a block lives")
    sp.add_argument("key")
    sp.set_defaults(fn=cmd_info)
    sp = sub.add_parser("get", help="fetch a block's payload")
    sp.add_argument("key")
    sp.add_argument("-o", "--output", help="write to FILE (default stdout)")
    sp.add_argument("--block", action="store_true", help="the whole stored block, header included")
    sp.set_defaults(fn=cmd_get)
    sp = sub.add_parser("put", help="store FILE as a block")
    sp.add_argument("key")
    sp.add_argument("file")
    sp.add_argument("--namespace-id", help="namespace id (32 hex digits) for the header (default zeros)")
    sp.add_argument("--codec", help="codec name for the header, e.g. int8 (default opaque)")
    sp.add_argument("--durable", action="store_true", help="return once on flash and synced")
    sp.add_argument("--block", action="store_true", help="FILE already is a block (header + payload)")
    sp.set_defaults(fn=cmd_put)
    for name, fn, what in (("lookup", cmd_lookup, "look up (a chain, in order)"),
                           ("pin", cmd_pin, "pin"), ("unpin", cmd_unpin, "unpin")):
        sp = sub.add_parser(name, help=f"{what} blocks")
        _add_selection(sp, what)
        sp.set_defaults(fn=fn)
    sp = sub.add_parser("evict", help="drop blocks now")
    sp.add_argument("keys", nargs="*", metavar="KEY")
    sp.add_argument("--namespace-id", help="every block of this namespace id")
    sp.add_argument("--namespace", metavar="NS.json", help="every block of this namespace (fields as JSON)")
    sp.add_argument("--all", action="store_true", help="every block")
    sp.set_defaults(fn=cmd_evict)
    sp = sub.add_parser("cluster", help="the cluster's members in etcd")
    csub = sp.add_subparsers(dest="cluster_command", required=True, metavar="CLUSTER_COMMAND")
    cp = csub.add_parser("status", help="members, addresses, lease TTLs and per-node figures")
    cp.add_argument("--cluster", metavar="etcd://HOST:PORT/PREFIX", help="the cluster's etcd URL")
    cp.set_defaults(fn=cmd_cluster_status)
    cp = csub.add_parser("repair", help="copy blocks to owners that lack them (join, rejoin, lost replica)")
    cp.add_argument("--cluster", metavar="etcd://HOST:PORT/PREFIX", help="the cluster's etcd URL")
    cp.add_argument("--replicas", type=int, default=2, help="copies of each key (as the clients use; default 2)")
    cp.add_argument("--rate", default="64m", help="bytes a second at most, k/m/g suffixes (default 64m)")
    cp.add_argument("--once", action="store_true", help="one pass, then exit (else: watch and repeat)")
    cp.add_argument("--interval", type=float, default=60.0, help="seconds between passes without a change")
    cp.set_defaults(fn=cmd_cluster_repair)
    from kvtier.tools.preplace_cli import add_preplace_parser
    add_preplace_parser(sub, sys.modules[__name__])
    add_nvmeof_parser(sub)
    sp = sub.add_parser("fsck", help="offline check of a stopped store")
    _add_store(sp)
    sp.add_argument("--repair", action="store_true", help="drop bad entries")
    sp.set_defaults(fn=cmd_fsck)
    sp = sub.add_parser("format", help="offline: write a new, empty store")
    _add_store(sp)
    sp.add_argument("--force", action="store_true", help="overwrite an existing store")
    sp.set_defaults(fn=cmd_format)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except UsageError as exc:
        print(f"kvtier: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ConfigError as exc:
        print(f"kvtier: config: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except AdminError as exc:
        print(f"kvtier: {exc.message}", file=sys.stderr)
        return EXIT_FAILED
    except EngineError as exc:
        print(f"kvtier: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except BrokenPipeError:
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
