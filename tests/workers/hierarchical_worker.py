"""Allreduces in a job that spans hosts, hierarchical path on; every rank checks results and sameness.

Usage: ringcomm-run -H a:2,b:2 ... python hierarchical_worker.py
(with RINGCOMM_HIERARCHICAL_ALLREDUCE=1 to take the path for every size)

Every rank builds every rank's input from a seed, so it knows the expected
reduction; results must also be bitwise equal on every rank.  Prints
``HIER OK <rank> <count of hierarchical allreduces>``.
"""

from __future__ import annotations

import numpy as np

import ringcomm as rc
from allreduce_cases import OPS, check, inputs, run_cases

rc.init(process_sets="dynamic")
R, N = rc.rank(), rc.size()


run_cases([(n, dtype) for n in (1, 7, 1000, 100_000, 300_000) for dtype in ("float32", "float64", "int64")],
          OPS[:4])

# fused: several tensors negotiated together
xs = [inputs(1000 + i, 5000 + i, "float32", N) for i in range(3)]
handles = [rc.allreduce_async(x[R], op=rc.Sum, name=f"fused.{i}") for i, x in enumerate(xs)]
for i, h in enumerate(handles):
    check(rc.synchronize(h), sum(x.astype(np.float64) for x in xs[i]), f"fused {i}")

# a process set with two ranks on each host (the path applies within it), and one with one rank per host
both = rc.add_process_set([0, 1, 2, 3]) if N == 4 else None
spread = rc.add_process_set([0, 2]) if N == 4 else None
if both is not None:
    x = inputs(77, 4096, "float64", N)
    check(rc.allreduce(x[R], op=rc.Sum, name="in.set", process_set=both), sum(v.astype(np.float64) for v in x),
          "process set of all")
if spread is not None and R in (0, 2):
    x = inputs(78, 4096, "float64", N)
    got = rc.allreduce(x[R], op=rc.Sum, name="in.spread", process_set=spread)
    np.testing.assert_allclose(got, x[0] + x[2])

import ringcomm.runtime as runtime  # noqa: E402  (the test reads the data plane's counters)

count = runtime.current("stats").engine._link.stats.get("hierarchical_allreduce", 0)
rc.barrier()
print(f"HIER OK {R} {count}", flush=True)
rc.shutdown()
