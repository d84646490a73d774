"""The multi-host correctness cases, then where this rank ran and how it talked to its peers.

Usage: python placement_worker.py
Prints "CASE <i> OK" per case (each checked against NumPy on every rank, see
collectives_worker.py), then one line "PLACE <json>" with the rank's topology,
the address it bound, how many payloads it sent through shared memory
(same host) and inline through a socket, and how its sockets authenticate.
"""

from __future__ import annotations

import json

import zmq

import ringcomm as rc
from collectives_worker import run_case
from ringcomm import runtime

CASES = [
    {"kind": "allreduce", "op": "sum", "dtype": "float32", "shape": [7], "seed": 1},
    {"kind": "allreduce", "op": "average", "dtype": "float64", "shape": [1000], "seed": 2},
    {"kind": "allreduce", "op": "max", "dtype": "int32", "shape": [300_000], "seed": 3},  # 1.2 MB
    {"kind": "allreduce", "op": "sum", "dtype": "float32", "shape": [600_001], "seed": 4},  # 2.4 MB
    {"kind": "allgather", "dtype": "float32", "dims": [1, 3, 0, 2], "shape": [1000], "seed": 5},
    {"kind": "broadcast", "root": 3, "dtype": "float64", "shape": [300_000], "seed": 6},
    {"kind": "alltoall", "dtype": "int64", "shape": [5], "seed": 7},
    {"kind": "reducescatter", "op": "sum", "dtype": "float32", "rows": 9, "shape": [3], "seed": 8},
]

rc.init()
for i, case in enumerate(CASES):
    run_case(i, case)
    print(f"CASE {i} OK", flush=True)
rt = runtime.active()
topo = rt.topo
print("PLACE " + json.dumps({
    "rank": topo.rank, "size": topo.size, "local_rank": topo.local_rank, "local_size": topo.local_size,
    "cross_rank": topo.cross_rank, "cross_size": topo.cross_size, "source": topo.source, "addr": topo.addr,
    "host": topo.hostname, "stats": dict(rt.engine._link.stats),
    "encrypted": rt.settings.encrypt,  # and the security mechanism of its data sockets (zmq.PLAIN / CURVE)
    "mechanisms": sorted({s.getsockopt(zmq.MECHANISM) for s in rt.engine._link._socks.values()}),
}), flush=True)
rc.barrier()
rc.shutdown()
