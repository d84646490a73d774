"""Ranks loop on one collective until a peer is lost (no launcher to stop them).

Usage (torchrun-style environment): DEAD_PEER_OP=allgather|allreduce|broadcast python dead_peer_loop_worker.py
Prints ``ready`` after a few rounds, then loops; when the runtime reports a
lost peer it prints the error and exits 3 (0 if nothing happened in 60 s).
"""

import os
import sys
import time

import numpy as np

import ringcomm as rc

rc.init()
op = os.environ["DEAD_PEER_OP"]
x = np.full(int(os.environ.get("DEAD_PEER_ELEMS", "250000")), rc.rank() + 1.0, np.float32)


def step() -> None:
    if op == "allgather":
        rc.allgather(x, name="loop")
    elif op == "allreduce":
        rc.allreduce(x, op=rc.Sum, name="loop")
    else:
        rc.broadcast(x, root_rank=0, name="loop")


for _ in range(3):
    step()
print("ready", flush=True)
start = time.monotonic()
try:
    while time.monotonic() - start < 60:
        step()
except rc.HorovodInternalError as exc:
    print(f"{type(exc).__name__}: {exc}", flush=True)
    sys.exit(3)
sys.exit(0)
