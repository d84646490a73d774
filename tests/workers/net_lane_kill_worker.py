"""Two ranks naming two hosts, the lane across hosts on: rank 1 is killed amid small allreduces.

Rank 0 prints the error its next op raised and how long after the kill it came.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np

rank = int(os.environ["RINGCOMM_RANK"])
os.environ["RINGCOMM_HOSTNAME"] = f"killhost{rank}"
os.environ.setdefault("RINGCOMM_NET_LANE_BYTES", "-1")

import ringcomm as rc  # noqa: E402

rc.init()
buf = np.ones(256, dtype=np.float32)
for _ in range(300):
    rc.allreduce(buf, op=rc.Max, name="x", out=buf)
assert type(rc.runtime._runtime.dispatcher.lane_owner.region).__name__ == "NetLane"
rc.barrier()
if rank == 1:
    time.sleep(0.2)  # rank 0 is waiting in the lane for this rank's next post by now
    os.kill(os.getpid(), signal.SIGKILL)
started = time.monotonic()
try:
    rc.allreduce(buf, op=rc.Max, name="y", out=buf)
    print("NO ERROR", flush=True)
except Exception as exc:  # noqa: BLE001 - printed for the test
    print(f"RAISED {type(exc).__name__} after {time.monotonic() - started:.1f} s: {exc}", flush=True)
