"""The last rank submits two ops long after the others (a small one and one of 16 MiB).

Run with a stall deadline of a few seconds (``STALL_LATE_SLEEP`` longer than it): the ranks on
time wait, get stall warnings, and raise ``StallError`` at the deadline; the late rank's ops raise
the same error when it submits them (they must not return a result); then every rank runs two more
ops, which must give the right sums.  Prints ``<name> StallError <message>`` per op and ``AFTER OK``.
"""

import os
import time

import torch

import ringcomm_torch as hvd
from ringcomm.errors import StallError

hvd.init()
rank, size = hvd.rank(), hvd.size()
BIG = 4 * 1024 * 1024  # float32 elements: 16 MiB, past the small-op lane and rank 0's small path
if rank == size - 1:
    time.sleep(float(os.environ["STALL_LATE_SLEEP"]))
handles = {"small": hvd.allreduce_async(torch.full((4,), rank + 1.0), name="stalled.small", op=hvd.Sum),
           "big": hvd.allreduce_async(torch.full((BIG,), rank + 1.0), name="stalled.big", op=hvd.Sum)}
for what, handle in handles.items():
    try:
        got = hvd.synchronize(handle)
    except StallError as exc:
        print(f"{what} StallError {exc}", flush=True)
    else:
        raise SystemExit(f"rank {rank}: the stalled {what} allreduce returned {got[:4].tolist()}")
total = size * (size + 1) / 2
assert hvd.allreduce(torch.full((4,), rank + 1.0), name="after.small", op=hvd.Sum).tolist() == [total] * 4
big = hvd.allreduce(torch.full((BIG,), rank + 1.0), name="after.big", op=hvd.Sum)
assert bool((big == total).all()), big[:4]
print("AFTER OK", flush=True)
hvd.shutdown()
