"""Rank 0 submits an allreduce the others never submit; expects the stall error, then carries on."""

import time

import numpy as np

import ringcomm as rc

rc.init()
if rc.rank() == 0:
    try:
        rc.allreduce(np.ones(3), name="lonely")
    except rc.HorovodInternalError as exc:
        print(f"stall error: {exc}", flush=True)
    else:
        raise SystemExit("the stalled op completed")
else:
    time.sleep(6)  # long enough for rank 0's stall to be turned into an error
rc.barrier()
assert rc.allreduce(np.ones(2), op=rc.Sum, name="after").tolist() == [rc.size()] * 2
print("after ok", flush=True)
rc.shutdown()
