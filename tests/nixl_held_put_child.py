"""A client whose NIXL_PUT the daemon gives up on, which then frees the memory the PUT pointed at
(tests/test_nixl_held_put.py).

    python nixl_held_put_child.py HOST:PORT NS_HEX KEY_HEX PAYLOAD_BYTES WARM_KEY_HEX WARM_LENGTH WARM_SEQ

Over UCX TCP: builds one block in an anonymous mmap of its own, PUTs it through NIXL without
progressing its agent (the daemon's READ times out: TIMEOUT), drops every view of it and
closes the mmap (``freed``, or ``held`` where something still references it), then progresses
its agent for a while, as any later NIXL request does, so that the daemon's pending READ is served.
Exits 0 unless that READ reads unmapped memory (SIGSEGV).
"""
import mmap
import os
import sys
import threading
import time

from kvtier.client.nixl_transport import NixlFetchFailed, NixlTransport
from kvtier.common.blockformat import encode_block

DRAIN_S = 3.0


def main() -> None:
    addr, ns_hex, key_hex, payload, warm_hex, warm_length, warm_seq = sys.argv[1:]
    ns, key = bytes.fromhex(ns_hex), bytes.fromhex(key_hex)
    warm = ([bytes.fromhex(warm_hex)], [int(warm_length)], [int(warm_seq)])
    transport = NixlTransport(addr, timeout_s=60.0)
    del transport.get_many(*warm, ns)[0]  # the agents' endpoint is wired up
    block = encode_block(key, ns, 0, os.urandom(int(payload)))
    memory = mmap.mmap(-1, len(block))
    memory[:] = block
    view = memoryview(memory)
    progress, transport.agent.progress = transport.agent.progress, lambda: None
    try:
        transport.put_many([(key, view)], ns_id=ns)
        print("stored", flush=True)
    except NixlFetchFailed as exc:
        print(f"failed {exc}", flush=True)
    finally:
        transport.agent.progress = progress
    view.release()
    try:
        memory.close()
        print("freed", flush=True)
    except BufferError:
        print("held", flush=True)
    end = time.monotonic() + DRAIN_S
    while time.monotonic() < end:
        transport.agent.progress()
        try:
            del transport.get_many(*warm, ns)[0]
        except NixlFetchFailed:
            pass  # refused while our transfer is parked there: our progress ends it
        threading.Event().wait(0.01)
    print(f"drained puts_held={transport.statistics().puts_held}", flush=True)
    transport.close()
    os._exit(0)  # UCX's teardown at exit is not what is tested here


if __name__ == "__main__":
    main()
