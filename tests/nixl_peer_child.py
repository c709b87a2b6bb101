"""A NIXL client that misbehaves mid-transfer, for tests/test_nixl_hostile.py and test_nixl_put.py.

    python nixl_peer_child.py HOST:PORT [put-]kill|[put-]stop NS_HEX KEY_HEX:LENGTH ...

Registers a buffer, sends NIXL_METADATA and one NIXL_GET for the keys (or, with ``put-``,
encodes a block of LENGTH random payload bytes per key in the buffer and sends one NIXL_PUT
of them), prints ``sent``, then SIGKILLs (``kill``: dies mid-transfer) or SIGSTOPs (``stop``:
a transfer that never completes) itself before it reads the reply.
"""
import os
import signal
import sys

from kvtier.client.nixl_transport import ClientAgent, ControlChannel, buffer_address
from kvtier.common.blockformat import HEADER_SIZE, encode_block
from kvtier.wire import events as m
from kvtier.wire.sockets import sendmsg_all


def main() -> None:
    addr, action, ns_hex, *items = sys.argv[1:]
    host, _, port = addr.rpartition(":")
    keys = [bytes.fromhex(item.split(":")[0]) for item in items]
    lengths = [int(item.split(":")[1]) for item in items]
    agent = ClientAgent.shared(loopback_only=True)
    buf = agent.take_buffer(sum(lengths) + 4096 * len(lengths))
    ch = ControlChannel(host, int(port), 10.0, None, "hostile-child")
    ch.exchange(m.NixlMetadata(0, agent.metadata(), agent.regions()))
    starts, at = [], buffer_address(buf)
    for length in lengths:
        starts.append(at)
        at += -(-length // 4096) * 4096
    if action.startswith("put-"):
        blocks = [encode_block(key, bytes.fromhex(ns_hex), 0, os.urandom(n - HEADER_SIZE)) for key, n in
                  zip(keys, lengths)]
        for start, block in zip(starts, blocks):
            offset = start - buffer_address(buf)
            buf[offset:offset + len(block)] = block
        message = m.NixlPut(0, tuple(keys), agent.name, tuple(((start, n),) for start, n in zip(starts, lengths)))
        action = action[len("put-"):]
    else:
        message = m.NixlGet(0, tuple(keys), agent.name, tuple(zip(starts, lengths)), bytes.fromhex(ns_hex), True)
    sendmsg_all(ch.sock, ch.conn.send_parts(message, request_id=99))
    print("sent", len(buf), flush=True)
    os.kill(os.getpid(), signal.SIGKILL if action == "kill" else signal.SIGSTOP)
    os._exit(0)  # after SIGCONT


if __name__ == "__main__":
    main()
