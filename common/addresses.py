"""``HOST:PORT`` text, parsed and written one way everywhere (IPv6 hosts in brackets)."""
from __future__ import annotations

DATA_PORT_DEFAULT = 7410  # kvtierd's data protocol
ADMIN_PORT_DEFAULT = 7411  # kvtierd's admin HTTP API
PORT_MAX = 65535


class AddressError(ValueError):
    """Text that is not a usable ``HOST:PORT``; the message names the setting and the text."""


def parse_address(text: str, *, what: str = "address", default_port: int | None = None) -> tuple[str, int]:
    """``"127.0.0.1:7410"``, ``"[::1]:0"``, or a bare host (``"node-a"``, ``"::1"``) where a
    ``default_port`` is given -> (host, port)."""
    text = text.strip()
    if text.startswith("["):
        close = text.find("]")
        host, rest = text[1:close], text[close + 1:] if close > 0 else ""
        if close < 0 or (rest and not rest.startswith(":")):
            raise AddressError(f"{what}: {text!r} is not HOST:PORT")
        port = rest[1:] if rest else None
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, None  # a name, an IPv4 address or a bare IPv6 address: no port
    if not host:
        raise AddressError(f"{what}: {text!r} has no host")
    if port is None:
        if default_port is None:
            raise AddressError(f"{what}: {text!r} is not HOST:PORT")
        return host, default_port
    if not port.isdigit():
        raise AddressError(f"{what}: port {port!r} in {text!r} is not a number")
    if int(port) > PORT_MAX:
        raise AddressError(f"{what}: port {port} is out of range 0..{PORT_MAX}")
    return host, int(port)


def parse_daemon_address(text: str, *, what: str = "address") -> tuple[str, int]:
    """:func:`parse_address` of an address a client dials: port 0 (the kernel picks one when
    binding) names no daemon and is refused."""
    host, port = parse_address(text, what=what)
    if port == 0:
        raise AddressError(f"{what}: {text.strip()!r} has port 0, which is not a daemon's port")
    return host, port


def format_address(host: str, port: int) -> str:
    """The text :func:`parse_address` reads back."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
