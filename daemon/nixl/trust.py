"""Which clients the daemon serves NIXL to (``nixl_trusted``).

UCX's shared-memory and TCP transports do not check remote keys at the target, so a peer that can
reach the daemon's UCX worker and forge a memory section could read or write any of its memory,
whatever the daemon hands out. NIXL is therefore served only to clients an operator declared
trusted with the daemon's memory; every other client is served over TCP (its HELLO lists no
``nixl`` feature and a NIXL request is refused). ``loopback`` (the default) trusts the processes
of this host, ``none`` no one; otherwise a comma-separated list of addresses and networks
(``10.0.0.0/24,fd00::/64``), with ``loopback`` allowed among them. Pure: no I/O.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

NIXL_TRUSTED_DEFAULT = "loopback"
LOOPBACK_NETWORKS = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))


class NixlTrustError(ValueError):
    """A ``nixl_trusted`` value that does not parse; the message names the part."""


@dataclass(frozen=True)
class NixlTrust:
    """The networks whose clients are served NIXL (none: NIXL is served to no one)."""

    networks: tuple = ()

    @classmethod
    def parse(cls, text: str) -> "NixlTrust":
        parts = [part.strip() for part in text.split(",") if part.strip()]
        if not parts:
            raise NixlTrustError("nixl_trusted: is empty (say 'none' to serve NIXL to no client)")
        if parts == ["none"]:
            return cls(())
        networks = []
        for part in parts:
            if part == "loopback":
                networks += LOOPBACK_NETWORKS
                continue
            if part == "none":
                raise NixlTrustError("nixl_trusted: 'none' cannot be listed with other clients")
            try:
                networks.append(ipaddress.ip_network(part, strict=False))
            except ValueError:
                raise NixlTrustError(f"nixl_trusted: {part!r} is not an address, a network (10.0.0.0/24), "
                                     f"'loopback' or 'none'") from None
        return cls(tuple(dict.fromkeys(networks)))

    def trusts(self, host: str) -> bool:
        """Whether a client connected from ``host`` (an IP address) is served NIXL."""
        try:
            address = ipaddress.ip_address(host.split("%")[0])
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return any(address in network for network in self.networks)

    @property
    def network_clients(self) -> bool:
        """Whether any client beyond this host is trusted."""
        return any(network not in LOOPBACK_NETWORKS for network in self.networks)

    def describe(self) -> str:
        if not self.networks:
            return "no client"
        loopback = [str(n) for n in self.networks if n in LOOPBACK_NETWORKS]
        names = (["loopback"] if len(loopback) == len(LOOPBACK_NETWORKS) else loopback) + \
            [str(n) for n in self.networks if n not in LOOPBACK_NETWORKS]
        return ", ".join(names)


DEFAULT_TRUST = NixlTrust.parse(NIXL_TRUSTED_DEFAULT)


def peer_host(peer: str) -> str:
    """The address of a ``HOST:PORT`` peer (IPv6 hosts unbracketed, as accept() gives them)."""
    return peer.rpartition(":")[0].strip("[]")
