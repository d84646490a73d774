"""Which local address other hosts reach this process at: an interface's, or the one that routes there.

No packets are sent: :func:`route_source` asks the kernel's routing table by
``connect()``-ing a UDP socket (which only picks a route and a source
address) and reading the address it was given.

Example::

    >>> route_source("127.0.0.1")
    '127.0.0.1'
    >>> interface_address("lo")
    '127.0.0.1'
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

from ..errors import InvalidInputError

__all__ = [
    "resolve", "route_source", "interface_address", "is_local_address", "is_local_host", "is_loopback",
    "default_source",
]

_SIOCGIFADDR = 0x8915  # Linux: the IPv4 address of an interface
#: A documentation-only address (TEST-NET-2): routing toward it finds the default route, nothing is sent.
_DEFAULT_ROUTE_PROBE = "198.51.100.1"


def resolve(host: str) -> str:
    """The IPv4 address of ``host`` (a name or an address); raises with the host in the message."""
    try:
        return str(socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0])
    except (socket.gaierror, IndexError, UnicodeError) as exc:
        raise InvalidInputError(
            f"cannot resolve host {host!r} to an IPv4 address: {exc}. ringcomm's sockets are IPv4: give the "
            "rendezvous host (MASTER_ADDR, RINGCOMM_MASTER_ADDR, -H) as an IPv4 address or a name with an A record, "
            "or pick an interface with an IPv4 address (--network-interface / RINGCOMM_NETWORK_INTERFACE)") from None


def route_source(host: str) -> str:
    """The local IPv4 address the kernel would use to send to ``host``.

    Example:
        >>> route_source("10.1.0.2")    # on a host with 10.1.0.1/24 on eth1
        '10.1.0.1'
    """
    address = resolve(host)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((address, 9))  # UDP connect: a route lookup, no packet
        except OSError as exc:
            raise InvalidInputError(
                f"no route from this host to {host} ({address}): {exc}; "
                "pick the interface with --network-interface / RINGCOMM_NETWORK_INTERFACE"
            ) from None
        return str(sock.getsockname()[0])


def default_source() -> str | None:
    """The address of the interface that holds the default route, or ``None`` without one."""
    try:
        return route_source(_DEFAULT_ROUTE_PROBE)
    except InvalidInputError:
        return None


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (e.g. ``eth0``); raises naming the interfaces there are."""
    known = sorted(n for _, n in socket.if_nameindex())
    if name not in known:
        raise InvalidInputError(
            f"network interface {name!r} does not exist on {socket.gethostname()}; "
            f"interfaces there: {', '.join(known) or 'none'}"
        )
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            raw = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError as exc:
            raise InvalidInputError(
                f"network interface {name!r} on {socket.gethostname()} has no IPv4 address ({exc})"
            ) from None
    return socket.inet_ntoa(raw[20:24])


def is_loopback(address: str) -> bool:
    """True for 127.0.0.0/8 and ::1."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def is_local_address(address: str) -> bool:
    """True when ``address`` (an IPv4 address) belongs to this host: a UDP socket can bind to it."""
    if is_loopback(address):
        return True
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.bind((address, 0))
        except OSError:
            return False
    return True


def is_local_host(host: str) -> bool:
    """True when ``host`` is this machine: ``localhost``, its hostname, or a name/address of one of its interfaces."""
    if host.lower() in ("localhost", socket.gethostname().lower()):
        return True
    return is_local_address(resolve(host))
