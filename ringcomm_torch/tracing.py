"""Collectives that TorchDynamo (``torch.compile``) runs as they are, never traces.

A collective moves host arrays and waits for peers: nothing in it belongs in a compiled graph,
and TorchDynamo cannot trace it (NumPy calls on staging buffers, a process group's attributes).
So a compiled function that calls one breaks its graph there and runs the collective eagerly,
as it does for a C++ collective, and a process group method that torch calls from C++ inside a
compiled region (DDP's reducer) runs untraced.  Until some code imports TorchDynamo
(``torch.compile`` does) nothing can trace these functions, and importing it here would cost
every process about a second: it is asked for only once loaded::

    @untraced
    def allreduce(tensor, ...): ...          # a plain call while TorchDynamo is not loaded
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

__all__ = ["untraced", "untraced_methods"]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_eager: dict[Any, Any] = {}  # each function, as TorchDynamo's disable() wraps it


def untraced(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn``, run as it is by TorchDynamo (see the module docstring)."""
    @functools.wraps(fn)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is None:
            return fn(*args, **kwargs)
        eager = _eager.get(fn)
        if eager is None:
            eager = _eager[fn] = dynamo.disable(fn)
        return eager(*args, **kwargs)
    return run


def untraced_methods(cls: type, names: Sequence[str]) -> None:
    """Make each of ``cls``'s methods ``names`` :func:`untraced`."""
    for name in names:
        setattr(cls, name, untraced(getattr(cls, name)))
