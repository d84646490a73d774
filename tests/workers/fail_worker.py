"""Rank 1 raises after a few allreduces while the others wait inside the next one."""

import os
import sys

import numpy as np

import ringcomm as rc

rc.init()
print(f"job {os.environ.get('RINGCOMM_JOB_ID')}", flush=True)
for _ in range(3):
    rc.allreduce(np.ones(8), name="warm")
if rc.rank() == 1:
    raise RuntimeError("rank 1 failed on purpose")
print(f"rank {rc.rank()} waiting", flush=True)
rc.allreduce(np.ones(8), name="never-completes")
sys.exit(0)
