"""The daemon's node id: given (``--node-id``), or made once and kept in the data dir.

Clients route by node id (rendezvous over ids, not addresses), so a daemon that restarts
on another port or host keeps its share of the keys. The file holds one line; it is
written once, atomically (temporary file, fsync, rename), and read on every start.
"""
from __future__ import annotations

import os
import re
import secrets
import socket

from kvtier.common.cluster_url import NODE_ID_BYTES_MAX, ClusterUrlError, check_node_id

NODE_ID_FILE = "node-id"  # in the data dir, next to the embedded default's device files
SUFFIX_HEX_DIGITS = 8  # 32 random bits: two nodes on one host name never collide in practice
HOST_PART_MAX = NODE_ID_BYTES_MAX - SUFFIX_HEX_DIGITS - 1


class NodeIdError(ValueError):
    """The node id file cannot be read or holds no valid id; the message names the file."""


def new_node_id(hostname: str | None = None) -> str:
    """``HOST-1a2b3c4d``: the host name (sanitised) and a random suffix."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", hostname or socket.gethostname()).lstrip("._-")[:HOST_PART_MAX]
    return check_node_id(f"{host or 'node'}-{secrets.token_hex(SUFFIX_HEX_DIGITS // 2)}")


def load_or_create_node_id(data_dir: str, given: str | None = None) -> str:
    """``given`` when set (not written), else the id kept in ``data_dir``, made on first start."""
    if given is not None:
        return check_node_id(given)
    path = os.path.join(data_dir, NODE_ID_FILE)
    try:
        with open(path, encoding="ascii") as fh:
            text = fh.read().strip()
    except FileNotFoundError:
        return _create(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise NodeIdError(f"node id file {path}: {exc}") from None
    try:
        return check_node_id(text)
    except ClusterUrlError as exc:
        raise NodeIdError(f"node id file {path}: {exc}") from None


def _create(path: str) -> str:
    node_id = new_node_id()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="ascii") as fh:
        fh.write(node_id + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return node_id
