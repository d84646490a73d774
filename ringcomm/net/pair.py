"""The ZeroMQ PAIR socket between two ranks, as the data plane configures it.

No message ever waits on a high-water mark (the algorithms bound what is in flight), a blocked
receive wakes every slice to look for lost peers, a frame larger than a segment is refused before
it is allocated, and ZMTP heartbeats, answered by the peer's ZeroMQ I/O thread with no GIL
involved, close the connection to a process that is stopped or wedged as a whole after the peer
timeout, which the connection monitor then reports (:mod:`ringcomm.net.peers`).
"""

from __future__ import annotations

import zmq

from .auth import Credentials


def pair_socket(ctx: zmq.Context, creds: Credentials, server: bool, peer_timeout: float, slice_s: float,
                max_payload: int = 0, buffer_bytes: int = 0) -> zmq.Socket:
    """A PAIR socket that authenticates peers (``server``: before ``bind``) or proves the job secret
    (before ``connect``); ``max_payload`` 0: no bound; ``buffer_bytes`` 0: the kernel's default."""
    sock = ctx.socket(zmq.PAIR)
    if server:
        creds.apply_server(sock)
    else:
        creds.apply_client(sock)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.RCVTIMEO, max(1, int(min(peer_timeout, slice_s) * 1000)))
    if max_payload > 0:
        sock.setsockopt(zmq.MAXMSGSIZE, max_payload + 64)
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(min(1.0, peer_timeout / 3) * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(peer_timeout * 1000)))
    sock.setsockopt(zmq.HEARTBEAT_TTL, max(100, int(peer_timeout * 1000)))
    if buffer_bytes > 0:
        sock.setsockopt(zmq.SNDBUF, buffer_bytes)
        sock.setsockopt(zmq.RCVBUF, buffer_bytes)
    return sock
