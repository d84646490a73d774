"""Allreduces in a job that spans hosts, hierarchical path on; every rank checks results and sameness.

Usage: ringcomm-run -H a:2,b:2 ... python hierarchical_worker.py
(with RINGCOMM_HIERARCHICAL_ALLREDUCE=1 to take the path for every size)

Every rank builds every rank's input from a seed, so it knows the expected
reduction; results must also be bitwise equal on every rank.  Prints
``HIER OK <rank> <count of hierarchical allreduces>``.
"""

from __future__ import annotations

import hashlib

import numpy as np

import ringcomm as rc

rc.init(process_sets="dynamic")
R, N = rc.rank(), rc.size()


def inputs(seed: int, n: int, dtype: str) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if dtype.startswith("int"):
        return [rng.integers(-5, 6, n).astype(dtype) for _ in range(N)]
    return [rng.standard_normal(n).astype(dtype) for _ in range(N)]


def check(got: np.ndarray, want: np.ndarray, label: str) -> None:
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-5, atol=1e-5, err_msg=label)
    digests = rc.allgather_object(hashlib.sha256(got.tobytes()).hexdigest(), name=f"digest.{label}")
    assert len(set(digests)) == 1, f"{label}: ranks disagree bitwise: {digests}"


case = 0
for n in (1, 7, 1000, 100_000, 300_000):
    for dtype in ("float32", "float64", "int64"):
        for op, ufunc in ((rc.Sum, np.add), (rc.Average, np.add), (rc.Min, np.minimum), (rc.Max, np.maximum)):
            if op == rc.Average and dtype == "int64":
                continue
            case += 1
            xs = inputs(case, n, dtype)
            want = xs[0].astype(np.float64)
            for x in xs[1:]:
                want = ufunc(want, x.astype(np.float64))
            if op == rc.Average:
                want = want / N
            check(rc.allreduce(xs[R], op=op, name=f"case.{case}"), want, f"case {case} n={n} {dtype} {op}")

# fused: several tensors negotiated together
xs = [inputs(1000 + i, 5000 + i, "float32") for i in range(3)]
handles = [rc.allreduce_async(x[R], op=rc.Sum, name=f"fused.{i}") for i, x in enumerate(xs)]
for i, h in enumerate(handles):
    check(rc.synchronize(h), sum(x.astype(np.float64) for x in xs[i]), f"fused {i}")

# a process set with two ranks on each host (the path applies within it), and one with one rank per host
both = rc.add_process_set([0, 1, 2, 3]) if N == 4 else None
spread = rc.add_process_set([0, 2]) if N == 4 else None
if both is not None:
    x = inputs(77, 4096, "float64")
    check(rc.allreduce(x[R], op=rc.Sum, name="in.set", process_set=both), sum(v.astype(np.float64) for v in x),
          "process set of all")
if spread is not None and R in (0, 2):
    x = inputs(78, 4096, "float64")
    got = rc.allreduce(x[R], op=rc.Sum, name="in.spread", process_set=spread)
    np.testing.assert_allclose(got, x[0] + x[2])

import ringcomm.runtime as runtime  # noqa: E402  (the test reads the data plane's counters)

count = runtime.current("stats").engine._link.stats.get("hierarchical_allreduce", 0)
rc.barrier()
print(f"HIER OK {R} {count}", flush=True)
rc.shutdown()
