"""``make cluster``: etcd and N kvtierd on loopback, until Ctrl-C (or SIGTERM).

    python tests/local_cluster.py --dir ./data/cluster --nodes 3

Prints the cluster URL and each node's addresses; ``kvtier cluster status --cluster URL``
and ``kvperf --target=URL`` then work against it. The stores stay in --dir (node ids are
node0..); etcd starts empty each run: membership lives only as long as the leases.
"""
from __future__ import annotations

import argparse
import shutil
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from daemon_proc import start_kvtierd  # noqa: E402
from etcd_server import EtcdServer, etcd_missing_reason  # noqa: E402

NODES_MAX = 16  # one machine's worth of test daemons


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="./data/cluster", help="where etcd's data and the stores live")
    ap.add_argument("--nodes", type=int, default=3, help=f"daemons to start (1..{NODES_MAX})")
    ap.add_argument("--prefix", default="kvtier", help="the cluster's etcd prefix")
    args = ap.parse_args(argv)
    if not 1 <= args.nodes <= NODES_MAX:
        ap.error(f"--nodes {args.nodes} is outside 1..{NODES_MAX}")
    reason = etcd_missing_reason()
    if reason:
        print(f"local_cluster: {reason}", file=sys.stderr)
        return 2
    root = Path(args.dir).resolve()
    shutil.rmtree(root / "etcd", ignore_errors=True)
    etcd = EtcdServer(root / "etcd")
    url = etcd.url(args.prefix)
    daemons = []
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        for i in range(args.nodes):
            d = start_kvtierd(root / f"node{i}", "--cluster", url, "--node-id", f"node{i}", admin="127.0.0.1:0")
            daemons.append(d)
            print(f"node{i}: data={d.data_addr} admin={d.admin_addr} log={d.log_path}", flush=True)
        print(f"cluster {url} ready; Ctrl-C stops it\n  kvtier cluster status --cluster {url}", flush=True)
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        for d in daemons:
            d.stop()
        etcd.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
