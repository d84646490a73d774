"""What the allreduce workers share: seeded inputs every rank can rebuild, a check of a result
against its float64 reference and of bitwise sameness across ranks, and a table of cases.

Imported by the worker scripts of this directory (a script's own directory is on ``sys.path``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

import ringcomm as rc

#: (op, the NumPy ufunc its float64 reference folds with)
OPS = ((rc.Sum, np.add), (rc.Average, np.add), (rc.Min, np.minimum), (rc.Max, np.maximum),
       (rc.Product, np.multiply))


def inputs(seed: int, n: int, dtype: str, ranks: int, low: int = -5, high: int = 6) -> list[np.ndarray]:
    """Every rank's input of one case (integers in [low, high), else standard normal)."""
    rng = np.random.default_rng(seed)
    if dtype.startswith("int"):
        return [rng.integers(low, high, n).astype(dtype) for _ in range(ranks)]
    return [rng.standard_normal(n).astype(dtype) for _ in range(ranks)]


def check(got: np.ndarray, want: np.ndarray, label: str, process_set: object = None) -> None:
    """``got`` matches ``want`` and every rank of the set holds the same bits."""
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-5, atol=1e-5, err_msg=label)
    kw = {} if process_set is None else {"process_set": process_set}
    digests = rc.allgather_object(hashlib.sha256(got.tobytes()).hexdigest(), name=f"digest.{label}", **kw)
    assert len(set(digests)) == 1, f"{label}: ranks disagree bitwise: {digests}"


def run_cases(cases: Iterable[tuple[int, str]], ops: Iterable[tuple[object, object]], low: int = -5,
              high: int = 6) -> int:
    """Allreduce every (elements, dtype) case with every op (no Average of integers) and check each
    result; returns how many ran."""
    size, rank, count = rc.size(), rc.rank(), 0
    for n, dtype in cases:
        for op, ufunc in ops:
            if op == rc.Average and dtype.startswith("int"):
                continue
            count += 1
            xs = inputs(count, n, dtype, size, low, high)
            want = xs[0].astype(np.float64)
            for x in xs[1:]:
                want = ufunc(want, x.astype(np.float64))
            if op == rc.Average:
                want = want / size
            check(rc.allreduce(xs[rank], op=op, name=f"case.{count}"), want, f"case {count} n={n} {dtype} {op}")
    return count
