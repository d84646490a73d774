"""Allreduce cases through the shared-memory path; checks results bitwise.

Usage: python shm_allreduce_worker.py CASES.json [--expect-ring]

Each case is ``{"dtype", "op", "n", "seed"}`` plus optional ``prescale``,
``postscale`` and ``fused`` (that many tensors in one grouped allreduce).
Every rank checks that its result equals, bit for bit, the inputs (prescaled)
folded in rank order and postscaled (what the shared-memory allreduce
computes), that every rank holds the same bytes (an allgather of the
results), that the shared-memory path really ran, and that the region's
file is gone from /dev/shm.  With ``--expect-ring`` the path must be off and
results are compared with a tolerance instead.  Prints "SHM ALL OK".
"""

from __future__ import annotations

import glob
import json
import os
import sys

import numpy as np

import ringcomm as rc
from ringcomm import runtime
from ringcomm.core.ops import ReduceOp, reduce_into, scale_inplace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collectives_worker import OPS, close, data  # noqa: E402


def expected(ins: list[np.ndarray], op: str, pre: float, post: float) -> np.ndarray:
    rop = ReduceOp(OPS[op])
    scaled = []
    for x in ins:
        x = x.copy()
        scale_inplace(x, pre)
        scaled.append(x)
    acc = scaled[0].copy()
    for x in scaled[1:]:
        reduce_into(rop, acc, x)
    scale_inplace(acc, post / len(ins) if rop is ReduceOp.AVERAGE else post)
    return acc


def main() -> None:
    cases = json.load(open(sys.argv[1]))
    expect_ring = "--expect-ring" in sys.argv[2:]
    rc.init()
    r, n = rc.rank(), rc.size()
    engine = runtime.active().engine  # type: ignore[union-attr]
    if expect_ring:
        assert engine._shm_ar is None, "shared-memory allreduce is on although it was disabled"
    else:
        assert engine._shm_ar is not None, "shared-memory allreduce is off"
    for i, case in enumerate(cases):
        dtype, op, size, seed = case["dtype"], case["op"], case["n"], case["seed"]
        pre, post = case.get("prescale", 1.0), case.get("postscale", 1.0)
        fused = case.get("fused", 1)
        ins = [[data(seed + t, k, (size,), dtype) for k in range(n)] for t in range(fused)]
        if fused == 1:
            outs = [rc.allreduce(ins[0][r], op=OPS[op], name=f"s{i}", prescale_factor=pre, postscale_factor=post)]
        else:
            outs = rc.grouped_allreduce([x[r] for x in ins], op=OPS[op], name=f"s{i}",
                                        prescale_factor=pre, postscale_factor=post)
        for t, got in enumerate(outs):
            exp = expected(ins[t], op, pre, post)
            what = f"case {i} {case} tensor {t}"
            if expect_ring:
                close(got, exp, dtype, what)
            else:
                assert got.dtype == exp.dtype and got.shape == exp.shape, what
                assert got.tobytes() == exp.tobytes(), f"{what}: not bitwise the rank-order result"
            everyone = rc.allgather(np.ascontiguousarray(got).view(np.uint8).reshape(1, -1), name=f"s{i}.{t}.check")
            assert all(row.tobytes() == everyone[0].tobytes() for row in everyone), f"{what}: ranks differ"
    if not expect_ring:
        assert engine._shm_ar.region is not None and engine._shm_ar._rounds > 0, "the shared region was never used"
    rc.barrier()
    left = glob.glob(f"/dev/shm/ringcomm-{os.environ['RINGCOMM_JOB_ID']}-*-allreduce")
    assert not left, f"left in /dev/shm: {left}"
    print("SHM ALL OK", flush=True)
    rc.shutdown()


if __name__ == "__main__":
    main()
