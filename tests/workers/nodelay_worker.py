"""Print every connected TCP socket of this rank and whether Nagle's algorithm is off on it."""

from __future__ import annotations

import os
import socket

import numpy as np

import ringcomm as rc


def tcp_sockets() -> list[tuple[str, str, int]]:
    found = []
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:  # not a socket (or closed meanwhile)
            continue
        try:
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                try:
                    peer = s.getpeername()
                except OSError:  # a listening socket
                    continue
                found.append((str(s.getsockname()), str(peer), s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)))
        finally:
            s.close()  # the duplicate only
    return found


rc.init()
rc.allreduce(np.ones(1 << 20, np.float32), name="large")
rc.allreduce(np.ones(4, np.float32), name="small")
rc.barrier()
for local, peer, nodelay in tcp_sockets():
    print(f"TCP {local} -> {peer} nodelay={nodelay}", flush=True)
rc.barrier()
rc.shutdown()
