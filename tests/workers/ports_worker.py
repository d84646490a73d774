"""Collectives large and small, then the TCP ports this rank listens on.

Usage: python ports_worker.py
Checks an allreduce of 4 MiB (large enough for the payload streams between hosts) and a small one
against NumPy, then prints "PORTS <json>": the rank and the port of every TCP socket of this
process in the listening state, read from /proc (the sockets' inodes among the process's open
files, matched against /proc/self/net/tcp and tcp6 of the process's network namespace).
"""

from __future__ import annotations

import json
import os

import numpy as np

import ringcomm as rc

_LISTEN = "0A"  # the kernel's TCP_LISTEN, as /proc/net/tcp writes it


def listening_ports() -> list[int]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == _LISTEN and fields[9] in inodes:
                ports.append(int(fields[1].rpartition(":")[2], 16))
    return sorted(ports)


rc.init()
rank, size = rc.rank(), rc.size()
big = np.full(1 << 20, rank + 1, dtype=np.float32)
assert np.all(rc.allreduce(big, op=rc.Sum, name="big") == size * (size + 1) / 2)
assert rc.allreduce(np.array([rank], dtype=np.int64), op=rc.Sum, name="small")[0] == size * (size - 1) // 2
ports = listening_ports()
rc.shutdown()
print("PORTS " + json.dumps({"rank": rank, "ports": ports}), flush=True)
