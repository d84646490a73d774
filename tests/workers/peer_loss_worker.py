"""Every rank loops on allreduce; the test kills one rank with SIGKILL.  Survivors print the error.

``PEER_LOSS_ELEMS`` float64 elements per allreduce (default 1000; 4M = 32 MiB goes through the
shared-memory allreduce, so the kill usually lands while survivors wait at its barriers).
"""

import os
import sys
import time

import numpy as np

import ringcomm as rc

rc.init()
buf = np.ones(int(os.environ.get("PEER_LOSS_ELEMS", "1000")))
print("ready", flush=True)
start = time.monotonic()
try:
    while time.monotonic() - start < 60:
        rc.allreduce(buf, name="loop")
        time.sleep(0.01)
except rc.HorovodInternalError as exc:
    print(f"{type(exc).__name__} after {time.monotonic() - start:.1f}s: {exc}", flush=True)
    sys.exit(3)
sys.exit(0)
