"""Binding a listening socket, plain or ZeroMQ, to any free port or to one of ``RINGCOMM_PORT_RANGE``.

Which ports are allowed, and in which order they are tried, is :mod:`ringcomm.job.ports`' (pure);
here each is tried in turn until one binds.  A port another process holds is skipped; when
every one is taken, :class:`~ringcomm.errors.RendezvousError` says which socket found none, the
range and what to do.

    >>> port = bind_plain(listener, "10.0.0.5", PortRange(40000, 40099), "rank 3's payload streams")
    >>> endpoint = bind_zmq(sock, "10.0.0.5", None, "rank 0's control socket")   # any free port
"""

from __future__ import annotations

import errno
import secrets
import socket
from collections.abc import Callable

import zmq

from ..errors import RendezvousError
from ..job.ports import VAR, PortRange

__all__ = ["bind_plain", "bind_zmq"]

#: What a bind to a port another socket holds (or a port this user may not take) fails with.
_TAKEN = {errno.EADDRINUSE, errno.EACCES}


def _none_free(ports: PortRange, host: str, what: str) -> RendezvousError:
    return RendezvousError(
        f"{what}: no free TCP port on {host} in {VAR}={ports} ({ports.size} port{'s' if ports.size > 1 else ''}, "
        "every one taken). Each rank listens on one port per higher-ranked peer and one for payload streams "
        "(rank 0 one more, the launcher's rendezvous one): widen the range on every host, or unset it to take "
        "any free port.")


def _first_free(ports: PortRange, host: str, what: str, bind: Callable[[int], object]) -> int:
    """Call ``bind(port)`` for the range's ports from a random one on, until one is not taken; that port."""
    for port in ports.candidates(secrets.randbelow(ports.size)):
        try:
            bind(port)
        except (OSError, zmq.ZMQError) as exc:
            if exc.errno in _TAKEN:
                continue
            raise
        return port
    raise _none_free(ports, host, what)


def bind_plain(sock: socket.socket, host: str, ports: PortRange | None, what: str) -> int:
    """Bind ``sock`` (TCP, not yet bound) on ``host``; returns the port it took.  ``what`` names the
    socket in the error raised when ``ports`` has none free."""
    if ports is None:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
    # a port a recent connection left in TIME_WAIT is free to listen on again
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return _first_free(ports, host, what, lambda port: sock.bind((host, port)))


def bind_zmq(sock: zmq.Socket, host: str, ports: PortRange | None, what: str) -> str:
    """Bind ZeroMQ ``sock`` on ``tcp://host``; returns the endpoint it took (``tcp://host:port``)."""
    bracketed = f"[{host}]" if ":" in host else host
    if ports is None:
        sock.bind(f"tcp://{bracketed}:*")
    else:
        _first_free(ports, host, what, lambda port: sock.bind(f"tcp://{bracketed}:{port}"))
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
