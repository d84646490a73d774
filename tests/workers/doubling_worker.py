"""Allreduces between the rank-0 path's bound and recursive doubling's, through the engine.

Usage: RINGCOMM_SHM_LANE_BYTES=0 RINGCOMM_LOG_LEVEL=DEBUG ringcomm-run -np N python doubling_worker.py

Every rank builds every rank's input from a seed, so it knows the expected
reduction; results must also be bitwise equal on every rank.  Covers a
process set of two ranks and scale factors.  Prints ``DOUBLING OK <rank>``.
"""

from __future__ import annotations

import hashlib

import numpy as np

import ringcomm as rc

rc.init(process_sets="dynamic")
R, N = rc.rank(), rc.size()


def inputs(seed: int, n: int, dtype: str, ranks: int = N) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if dtype.startswith("int"):
        return [rng.integers(-3, 4, n).astype(dtype) for _ in range(ranks)]
    return [rng.standard_normal(n).astype(dtype) for _ in range(ranks)]


def check(got: np.ndarray, want: np.ndarray, label: str, process_set: object = None) -> None:
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-5, atol=1e-5, err_msg=label)
    kw = {} if process_set is None else {"process_set": process_set}
    digests = rc.allgather_object(hashlib.sha256(got.tobytes()).hexdigest(), name=f"digest.{label}", **kw)
    assert len(set(digests)) == 1, f"{label}: ranks disagree bitwise: {digests}"


case = 0
for n, dtype in ((6000, "float32"), (20_000, "float32"), (30_000, "float64"), (60_000, "float32"),
                 (9000, "int64"), (90_000, "float32")):  # 24 KiB .. 360 KiB: doubling, and the ring past its bound
    for op, ufunc in ((rc.Sum, np.add), (rc.Average, np.add), (rc.Min, np.minimum), (rc.Max, np.maximum),
                      (rc.Product, np.multiply)):
        if op == rc.Average and dtype == "int64" or op == rc.Product and dtype != "int64":
            continue
        case += 1
        xs = inputs(case, n, dtype)
        want = xs[0].astype(np.float64)
        for x in xs[1:]:
            want = ufunc(want, x.astype(np.float64))
        if op == rc.Average:
            want = want / N
        check(rc.allreduce(xs[R], op=op, name=f"case.{case}"), want, f"case {case} n={n} {dtype} {op}")

# scale factors, and the result written into a given buffer
xs = inputs(500, 40_000, "float64")
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
