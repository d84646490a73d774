"""Allreduces between the rank-0 path's bound and recursive doubling's, through the engine.

Usage: RINGCOMM_SHM_LANE_BYTES=0 RINGCOMM_LOG_LEVEL=DEBUG ringcomm-run -np N python doubling_worker.py

Every rank builds every rank's input from a seed, so it knows the expected
reduction; results must also be bitwise equal on every rank.  Covers a
process set of two ranks and scale factors.  Prints ``DOUBLING OK <rank>``.
"""

from __future__ import annotations

import numpy as np

import ringcomm as rc
from allreduce_cases import OPS, check, inputs, run_cases

rc.init(process_sets="dynamic")
R, N = rc.rank(), rc.size()


# 24 KiB .. 360 KiB: doubling, and the ring past its bound
run_cases([(6000, "float32"), (20_000, "float32"), (30_000, "float64"), (60_000, "float32"), (9000, "int64"),
           (90_000, "float32")], OPS, low=-3, high=4)

# scale factors, and the result written into a given buffer
xs = inputs(500, 40_000, "float64", N)
out = np.empty(40_000)
got = rc.allreduce(xs[R], op=rc.Sum, name="scaled", prescale_factor=0.5, postscale_factor=3.0, out=out)
assert got is out
check(out, 1.5 * sum(x for x in xs), "scaled")

# a process set of two ranks
pair = rc.add_process_set([0, N - 1])
if R in (0, N - 1):
    xs = inputs(600, 30_000, "float32", 2)
    check(rc.allreduce(xs[0 if R == 0 else 1], op=rc.Sum, name="in.pair", process_set=pair),
          xs[0].astype(np.float64) + xs[1], "process set", process_set=pair)
rc.barrier()
print(f"DOUBLING OK {R}", flush=True)
rc.shutdown()
