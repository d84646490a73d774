"""The checks of a collective's arguments on the calling rank, before anything is submitted.

Each returns the checked value or raises an :class:`~ringcomm.errors.InvalidInputError` or
:class:`~ringcomm.errors.InvalidTypeError` that names the call (``what``), the value and the fix.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .core import ops
from .errors import InvalidInputError, InvalidTypeError

_FAST_DTYPES = frozenset(np.dtype(n) for n in ops.SUPPORTED_DTYPES)


def as_array(x: Any, what: str) -> np.ndarray:
    """A C-contiguous ndarray view of ``x`` (no copy), or a clear error."""
    if type(x) is np.ndarray and x.flags.c_contiguous and x.dtype in _FAST_DTYPES:
        return x  # the hot path: nothing to convert or check
    if isinstance(x, np.ndarray):
        arr = x
    elif isinstance(x, (bytes, bytearray)):
        arr = np.frombuffer(x, dtype=np.uint8)
    elif isinstance(x, memoryview) or hasattr(x, "__array_interface__") or hasattr(x, "__array__"):
        try:
            arr = np.asarray(x)
        except Exception as exc:
            raise InvalidTypeError(f"{what}: cannot view {type(x).__name__} as an array: {exc}") from None
    else:
        raise InvalidTypeError(
            f"{what}: expected a NumPy array or a buffer with a dtype, got {type(x).__name__}; "
            "wrap Python values with np.asarray(...)"
        )
    if arr.dtype == object:
        raise InvalidTypeError(f"{what}: object arrays cannot be sent; use broadcast_object/allgather_object")
    ops.check_dtype(arr.dtype, what)
    if not arr.flags.c_contiguous:
        raise InvalidInputError(
            f"{what}: the array is not C-contiguous (shape {arr.shape}, strides {arr.strides}); "
            "pass np.ascontiguousarray(x)"
        )
    return arr


def check_root(root_rank: Any, what: str, size_: int) -> int:
    """``root_rank`` as an int in ``0..size_-1``."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)):
        raise InvalidTypeError(f"{what}: root_rank must be an int, got {type(root_rank).__name__}")
    if not 0 <= int(root_rank) < size_:
        raise InvalidInputError(
            f"{what}: root_rank={root_rank} is out of range for a job of size {size_}; use 0..{size_ - 1}"
        )
    return int(root_rank)


def check_out(out: np.ndarray | None, arr: np.ndarray, what: str) -> np.ndarray | None:
    """``out`` (or None): a writeable C-contiguous array of ``arr``'s shape and dtype."""
    if out is None:
        return None
    if not isinstance(out, np.ndarray) or out.shape != arr.shape or out.dtype != arr.dtype or not out.flags.c_contiguous:
        raise InvalidInputError(f"{what}: out= must be a C-contiguous array of shape {arr.shape} and dtype {arr.dtype}")
    if not out.flags.writeable:
        raise InvalidInputError(f"{what}: out= is read-only")
    return out


def check_gather_out(out: np.ndarray | None, arr: np.ndarray, what: str,
                     rows: str = "the rows of every rank together") -> np.ndarray | None:
    """``out`` (or None) for a gather of ``arr`` (or an alltoall: ``rows`` says what its first
    dimension holds): a writeable C-contiguous array of ``arr``'s dtype and row shape (its first
    dimension is checked once every rank's is known)."""
    if out is None:
        return None
    if (not isinstance(out, np.ndarray) or out.ndim != arr.ndim or out.shape[1:] != arr.shape[1:]
            or out.dtype != arr.dtype or not out.flags.c_contiguous):
        raise InvalidInputError(f"{what}: out= must be a C-contiguous array of shape (N, *{arr.shape[1:]}) and "
                                f"dtype {arr.dtype}, N {rows}")
    if not out.flags.writeable:
        raise InvalidInputError(f"{what}: out= is read-only")
    return out


def scale(value: Any, label: str, what: str) -> float:
    """A pre- or postscale factor as a float (``label`` names it in the error)."""
    if type(value) is float:
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InvalidTypeError(f"{what}: {label} must be a number, got {value!r}") from None


def check_set_root(root_rank: Any, what: str, ranks: tuple[int, ...], pset: int) -> int:
    """``root_rank`` is a global rank; it must be a member of the set."""
    if not pset:
        return check_root(root_rank, what, len(ranks))
    root = check_root(root_rank, what, max(ranks) + 1)
    if root not in ranks:
        raise InvalidInputError(
            f"{what}: root_rank={root} is not in process set {pset} (ranks {list(ranks)}); "
            "root_rank is a global rank and must be one of them"
        )
    return root
