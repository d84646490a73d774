"""Adasum's arithmetic (ringcomm.core.adasum), against a plain NumPy reference written element by element."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ringcomm.core import adasum

pytestmark = pytest.mark.pure

#: Horovod's bound on a squared norm below which a coefficient stays 1: sqrt(DBL_MIN).
SQRT_DBL_MIN = 2.0 ** -511


def reference_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b, sums in float64, the result in a's dtype."""
    dot = sum(float(x) * float(y) for x, y in zip(a, b))
    na = sum(float(x) * float(x) for x in a)
    nb = sum(float(y) * float(y) for y in b)
    ca = 1.0 - dot / (2.0 * na) if na >= SQRT_DBL_MIN else 1.0
    cb = 1.0 - dot / (2.0 * nb) if nb >= SQRT_DBL_MIN else 1.0
    return np.array([ca * float(x) + cb * float(y) for x, y in zip(a, b)], dtype=np.float64).astype(a.dtype)


def reference(buffers: list[np.ndarray], counts: list[int]) -> np.ndarray:
    """Distance doubling: at level d, rank r (r % 2d == 0) combines with rank r + d, tensor by tensor."""
    held = {r: b.copy() for r, b in enumerate(buffers)}
    d = 1
    while d < len(buffers):
        for r in range(0, len(buffers), 2 * d):
            a, b = held[r], held[r + d]
            out, start = np.empty_like(a), 0
            for c in counts:
                out[start:start + c] = reference_pair(a[start:start + c], b[start:start + c])
                start += c
            held[r] = out
        d *= 2
    return held[0]


floats = st.floats(-1e3, 1e3, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.lists(st.integers(0, 6), min_size=1, max_size=4),
       st.sampled_from(["float32", "float64", "float16"]), st.data())
def test_tree_matches_the_pairwise_reference(n, counts, dtype, data):
    total = sum(counts)
    buffers = [np.array(data.draw(st.lists(floats, min_size=total, max_size=total)), dtype=dtype) for _ in range(n)]
    got = adasum.tree_reduce(buffers, counts)
    want = reference(buffers, counts)
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                               rtol=1e-3 if dtype == "float16" else 1e-5, atol=1e-3 if dtype == "float16" else 1e-6)


@given(st.lists(floats, min_size=1, max_size=8))
def test_identical_vectors_average_and_orthogonal_ones_add(xs):
    a = np.array(xs, dtype=np.float64)
    assume(float(a @ a) >= 1e-6)  # far from the bound below which the coefficients stay 1 (zero-vector test)
    np.testing.assert_allclose(adasum.combine(a, a.copy()), a, rtol=1e-12, atol=1e-9)
    e1, e2 = np.array([3.0, 0.0]), np.array([0.0, -2.0])
    np.testing.assert_array_equal(adasum.combine(e1, e2), e1 + e2)


def test_tensors_of_a_fused_buffer_are_combined_each_on_its_own():
    a = np.array([1.0, 0.0, 2.0, 2.0])
    b = np.array([0.0, 1.0, 2.0, 2.0])
    # first tensor orthogonal: summed; second identical: averaged (a joint dot product would mix them)
    np.testing.assert_allclose(adasum.combine(a, b, [2, 2]), [1.0, 1.0, 2.0, 2.0])
    assert not np.allclose(adasum.combine(a, b), [1.0, 1.0, 2.0, 2.0])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_parallel_vectors_of_tiny_normal_values_are_averaged(dtype):
    """Squared norms far below 1e-8 but above sqrt(DBL_MIN) still get their coefficients (Horovod's bound)."""
    assert adasum.NORM_EPSILON == SQRT_DBL_MIN
    tiny = float(np.finfo(dtype).tiny)
    ramp = np.linspace(1.0, 2.0, 64)
    a, b = (ramp * tiny * 3).astype(dtype), (ramp * tiny * 5).astype(dtype)
    assert float(a.astype(np.float64) @ a.astype(np.float64)) < 1e-8 or dtype == "float16"
    got = adasum.tree_reduce([a, b]).astype(np.float64)
    np.testing.assert_allclose(got, (a.astype(np.float64) + b.astype(np.float64)) / 2, rtol=2e-3)


def test_a_zero_vector_keeps_coefficient_one_and_inputs_are_untouched():
    a, b = np.zeros(3, np.float32), np.array([1.0, 2.0, 3.0], np.float32)
    out = adasum.tree_reduce([a, b])
    np.testing.assert_array_equal(out, b)
    assert not a.any() and b.tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("n", [0, 3, 5, 6, 7])
def test_a_size_that_is_not_a_power_of_two_is_refused(n):
    assert not adasum.is_power_of_two(n)
    with pytest.raises(ValueError, match="power-of-two"):
        adasum.tree_reduce([np.ones(2)] * n)


def test_counts_must_cover_the_buffer():
    with pytest.raises(ValueError, match="add up"):
        adasum.combine(np.ones(3), np.ones(3), [1, 1])
