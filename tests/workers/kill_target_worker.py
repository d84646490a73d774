"""A job whose ranks hold shared-memory rings and ipc sockets when one is killed.

Usage (torchrun-style environment): python kill_target_worker.py
Each rank runs large allreduces (ring + shared memory in every direction) and
small ones (through rank 0's control socket), prints ``ready`` once every ring
is in use, and loops until a peer is lost: then it prints the error and exits 3.
"""

import sys
import time

import numpy as np

import ringcomm as rc

rc.init()
big = np.ones(600_000, np.float32)  # 2.4 MB: ~800 KB chunks at np 3, through the shared-memory slots
for _ in range(3):
    assert rc.allreduce(big, op=rc.Sum, name="big")[0] == rc.size()
print("ready", flush=True)
start = time.monotonic()
try:
    while time.monotonic() - start < 60:
        rc.allreduce(big, op=rc.Sum, name="big")
        rc.allreduce(np.ones(10), name="small")
except rc.HorovodInternalError as exc:
    print(f"{type(exc).__name__}: {exc}", flush=True)
    sys.exit(3)
sys.exit(0)
