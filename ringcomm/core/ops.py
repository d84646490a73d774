"""Reduction operators and dtypes: pure NumPy, no I/O.

Each rank sees the same arithmetic: ``reduce_into(op, dst, src)`` folds a
neighbour's contribution into ``dst`` in place; ``finalize`` applies the
Average division and the pre/post scale factors.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import InvalidTypeError


class ReduceOp(enum.IntEnum):
    """How allreduce / reducescatter combine the ranks' tensors."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

#: dtypes every collective accepts, by their NumPy name (the wire uses these names).
SUPPORTED_DTYPES: tuple[str, ...] = (
    "uint8", "int8", "int16", "int32", "int64",
    "float16", "float32", "float64", "bool",
)

_INTEGER = frozenset({"uint8", "int8", "int16", "int32", "int64"})


_NAMES = {np.dtype(n): n for n in SUPPORTED_DTYPES}


def check_dtype(dtype: np.dtype, what: str) -> str:
    """Return the dtype's wire name, or raise InvalidTypeError naming the supported ones."""
    name = _NAMES.get(dtype)  # type: ignore[call-overload]
    if name is not None:
        return name
    name = np.dtype(dtype).name
    if name not in SUPPORTED_DTYPES:
        raise InvalidTypeError(
            f"{what}: dtype {name!r} is not supported; use one of {', '.join(SUPPORTED_DTYPES)} "
            "(convert with arr.astype(...))"
        )
    return name


def is_adasum(op: object) -> bool:
    """Whether ``op`` names Adasum (as a :class:`ReduceOp` or its number); anything else is False."""
    try:
        return (op if type(op) is ReduceOp else ReduceOp(op)) is ReduceOp.ADASUM  # type: ignore[arg-type]
    except ValueError:
        return False


def check_op(op: object, dtype_name: str, what: str) -> ReduceOp:
    """Validate a reduce op for a dtype; returns it as :class:`ReduceOp`."""
    try:
        rop = op if type(op) is ReduceOp else ReduceOp(op)  # type: ignore[arg-type]
    except ValueError:
        raise InvalidTypeError(
            f"{what}: op={op!r} is not a reduce op; use ringcomm.Sum, Average, Min, Max or Product"
        ) from None
    if rop is ReduceOp.ADASUM and dtype_name not in ("float16", "float32", "float64"):
        raise InvalidTypeError(
            f"{what}: op=Adasum reduces float16, float32 and float64 tensors, got {dtype_name}; "
            "convert to a float dtype (arr.astype(np.float32); a torch tensor: t.float()), or use Sum or Average"
        )
    if dtype_name == "bool" and rop is ReduceOp.AVERAGE:
        raise InvalidTypeError(
            f"{what}: op=Average is not defined for bool tensors; use Sum (logical or), "
            "Product or Min (logical and), or Max (logical or)"
        )
    return rop


_UFUNC = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVERAGE: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PRODUCT: np.multiply,
}
_BOOL_UFUNC = {
    ReduceOp.SUM: np.logical_or,
    ReduceOp.MIN: np.logical_and,
    ReduceOp.MAX: np.logical_or,
    ReduceOp.PRODUCT: np.logical_and,
}


def reduce_into(op: ReduceOp, dst: np.ndarray, src: np.ndarray) -> None:
    """``dst = dst (op) src`` elementwise, in place.  ``dst`` and ``src`` share dtype and length."""
    if dst.dtype.kind == "b":
        _BOOL_UFUNC[op](dst, src, out=dst)
    else:
        _UFUNC[op](dst, src, out=dst)


def combine(op: ReduceOp, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``out = a (op) b`` elementwise (``out`` may alias neither)."""
    if out.dtype.kind == "b":
        _BOOL_UFUNC[op](a, b, out=out)
    else:
        _UFUNC[op](a, b, out=out)


def identity_fill(op: ReduceOp, arr: np.ndarray) -> None:
    """Fill ``arr`` with the value that leaves ``op`` unchanged (what a joined rank contributes)."""
    if op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        arr.fill(0)
    elif op is ReduceOp.PRODUCT:
        arr.fill(1)
    elif arr.dtype == np.bool_:
        arr.fill(op is ReduceOp.MIN)
    elif arr.dtype.kind == "f":
        arr.fill(np.inf if op is ReduceOp.MIN else -np.inf)
    else:
        info = np.iinfo(arr.dtype)
        arr.fill(info.max if op is ReduceOp.MIN else info.min)


def scale_inplace(arr: np.ndarray, factor: float) -> None:
    """Multiply by ``factor`` in place, as Horovod does on CPU: integers in float64 (truncated), half in float32
    (rounded once), float32 and float64 in their own precision."""
    if factor == 1.0 or arr.size == 0 or arr.dtype == np.bool_:
        return
    if arr.dtype == np.float16:  # half: scaled in float32 and rounded once, as Horovod does on CPU
        arr[...] = (arr.astype(np.float32) * np.float32(factor)).astype(np.float16)
    elif arr.dtype.kind == "f":
        np.multiply(arr, arr.dtype.type(factor), out=arr)
    else:
        arr[...] = (arr.astype(np.float64) * factor).astype(arr.dtype)


def postscale(op: ReduceOp, size: int, postscale_factor: float) -> float:
    """The factor applied after the reduction: Average divides by the number of ranks."""
    return postscale_factor / size if op is ReduceOp.AVERAGE else postscale_factor


def is_integer(dtype_name: str) -> bool:
    return dtype_name in _INTEGER


def per_rank(items: Sequence[Any], size: int) -> bool:
    """Whether an alltoall's arrays (or outputs) came one per rank (rather than one array cut by
    the splits): with more than one rank, a list of ``size``.

    >>> per_rank([np.zeros(1)] * 3, 3), per_rank([np.zeros(3)], 3)
    (True, False)
    """
    return size > 1 and len(items) == size


def result_array(given: np.ndarray | None, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Where a result of ``shape`` and ``dtype`` goes: ``given`` (a caller's ``out=``) when it has that
    shape and dtype (and is C-contiguous and writeable), else a new array.  An allgather's shape is known only once every rank's first
    dimension is, so a caller's ``out`` that does not fit then is not an error: it gets a new array.

    >>> out = np.zeros((4, 2), np.float32)
    >>> result_array(out, (4, 2), np.dtype(np.float32)) is out, result_array(out, (5, 2), np.dtype(np.float32)) is out
    (True, False)
    """
    if (given is not None and given.shape == shape and given.dtype == dtype and given.flags.c_contiguous
            and given.flags.writeable):
        return given
    return np.empty(shape, dtype=dtype)
