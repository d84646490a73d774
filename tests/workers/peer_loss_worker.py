"""Every rank loops on allreduce; the test kills one rank with SIGKILL.  Survivors print the error."""

import sys
import time

import numpy as np

import ringcomm as rc

rc.init()
print("ready", flush=True)
start = time.monotonic()
try:
    while time.monotonic() - start < 60:
        rc.allreduce(np.ones(1000), name="loop")
        time.sleep(0.01)
except rc.HorovodInternalError as exc:
    print(f"{type(exc).__name__} after {time.monotonic() - start:.1f}s: {exc}", flush=True)
    sys.exit(3)
sys.exit(0)
