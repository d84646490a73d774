"""Adasum: the adaptive summation of gradients, as pure NumPy (no I/O).

Two ranks' gradients ``a`` and ``b`` are combined as::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a coefficient stays 1 where its vector's squared norm is below ``NORM_EPSILON``, about 1.5e-154).  Orthogonal
gradients are summed, identical ones averaged.  A job of ``2^k`` ranks reduces in
the order of the vector-halving distance-doubling (VHDD) algorithm: at level 1 rank
pairs ``(0, 1), (2, 3), ...`` combine, at level 2 the pairs of pairs ``(01, 23), ...``,
and so on, the lower ranks always on the left.  That is a balanced binary tree over
the ranks in order::

    4 ranks:  adasum(adasum(x0, x1), adasum(x2, x3))

Several tensors fused into one buffer are combined each with its own dot product
and norms (``counts`` gives their lengths).  The dot product and the norms are
taken in float64; each combination is rounded to the tensors' dtype, as the result
of each VHDD level is stored in the buffer's dtype.  Only float16, float32 and
float64 can be reduced, and only over a power-of-two number of ranks (as in
Horovod on CPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["ADASUM_DTYPES", "NORM_EPSILON", "coefficients", "combine", "is_power_of_two", "tree_reduce"]

#: dtypes Adasum reduces (by NumPy name).
ADASUM_DTYPES: tuple[str, ...] = ("float16", "float32", "float64")

#: below this squared norm a vector's coefficient stays 1: the square root of the smallest normal float64
#: (about 1.5e-154), Horovod's bound, so that vectors of tiny but normal values are still averaged.
NORM_EPSILON = float(np.sqrt(np.finfo(np.float64).tiny))


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _segments(counts: Sequence[int], total: int) -> list[tuple[int, int]]:
    if any(c < 0 for c in counts) or sum(counts) != total:
        raise ValueError(f"counts {list(counts)} do not add up to the buffer's {total} elements")
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return out


def coefficients(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """The two coefficients of :func:`combine` for one tensor's ``a`` and ``b`` (float64 arithmetic)."""
    a64 = a.astype(np.float64, copy=False)
    b64 = b.astype(np.float64, copy=False)
    dot = float(np.dot(a64, b64))
    anormsq = float(np.dot(a64, a64))
    bnormsq = float(np.dot(b64, b64))
    acoeff = 1.0 - dot / anormsq * 0.5 if anormsq >= NORM_EPSILON else 1.0
    bcoeff = 1.0 - dot / bnormsq * 0.5 if bnormsq >= NORM_EPSILON else 1.0
    return acoeff, bcoeff


def combine(a: np.ndarray, b: np.ndarray, counts: Sequence[int] | None = None) -> np.ndarray:
    """Adasum of two flat buffers of one dtype; each of the ``counts`` segments (default: one) on its own.

    Returns a new array of ``a``'s dtype; ``a`` and ``b`` are left unchanged.
    """
    if a.shape != b.shape or a.ndim != 1 or a.dtype != b.dtype:
        raise ValueError(f"combine: expected two flat buffers of one shape and dtype, got "
                         f"{a.shape} {a.dtype} and {b.shape} {b.dtype}")
    out = np.empty_like(a)
    for lo, hi in _segments([a.size] if counts is None else counts, a.size):
        acoeff, bcoeff = coefficients(a[lo:hi], b[lo:hi])
        mixed = acoeff * a[lo:hi].astype(np.float64) + bcoeff * b[lo:hi].astype(np.float64)
        out[lo:hi] = mixed.astype(a.dtype)
    return out


def tree_reduce(buffers: Sequence[np.ndarray], counts: Sequence[int] | None = None) -> np.ndarray:
    """Adasum of every rank's flat buffer (``buffers[r]`` is rank r's), in VHDD order.

    ``len(buffers)`` must be a power of two; one buffer is returned as a copy.
    """
    n = len(buffers)
    if not is_power_of_two(n):
        raise ValueError(f"tree_reduce: Adasum needs a power-of-two number of buffers, got {n}")
    level = [np.array(b, copy=True) for b in buffers]
    while len(level) > 1:
        level = [combine(level[i], level[i + 1], counts) for i in range(0, len(level), 2)]
    return level[0]
