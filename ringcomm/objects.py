"""The object collectives: any picklable Python object, sent as two array collectives.

An object goes as its pickled bytes: first their length (``name.len``), then the bytes
(``name.data``), each a broadcast or an allgather of the process set.  A rank that cannot take
part (a bad root, an object that does not pickle) refuses ``name.len``, which the others wait on,
so the call fails on every rank.

Example, on every rank of ``ringcomm-run -np 2``::

    >>> rc.broadcast_object({"epoch": rc.rank()}, root_rank=1)   # every rank: {'epoch': 1}
    >>> rc.allgather_object(rc.rank() * "x")                     # every rank: ['', 'x']
"""

from __future__ import annotations

import pickle

try:  # Horovod pickles objects with cloudpickle (lambdas, local classes); use it when installed
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover - depends on the environment
    _pickler = pickle
from typing import Any

import numpy as np

from .arguments import check_set_root
from .core import ops, wire
from .core.process_sets import ProcessSet, global_process_set
from .errors import InvalidInputError, InvalidTypeError
from .runtime import Runtime, current


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Every rank (of ``process_set``) gets the root's Python object (pickled; only from ranks of this job).

    ``root_rank`` is a global rank that belongs to the set.
    """
    rt = current("broadcast_object")
    pset, ranks = rt.resolve_set(process_set, "broadcast_object")
    call = rt.name_op("broadcast_object", name, pset)
    name = call.name
    with rt.refusing(call.part("len")):  # the op the others wait on first
        root = check_set_root(root_rank, f"broadcast_object {name!r}", ranks, pset)
        payload = _pickled(obj, f"broadcast_object {name!r}") if rt.topo.rank == root_rank else None
    length = np.array([0 if payload is None else payload.size], dtype=np.int64)
    length = _broadcast(rt, length, root, f"{name}.len", pset)
    data = payload if payload is not None else np.empty(int(length[0]), dtype=np.uint8)
    data = _broadcast(rt, data, root, f"{name}.data", pset)
    return pickle.loads(data.tobytes())


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> list[Any]:
    """A list with the Python object of every rank (of ``process_set``), in rank order."""
    rt = current("allgather_object")
    pset, _ = rt.resolve_set(process_set, "allgather_object")
    call = rt.name_op("allgather_object", name, pset)
    name = call.name
    with rt.refusing(call.part("len")):  # the op the others wait on first
        payload = _pickled(obj, f"allgather_object {name!r}")
    sizes = _allgather(rt, np.array([payload.size], dtype=np.int64), f"{name}.len", pset)
    data = _allgather(rt, payload, f"{name}.data", pset)
    out, pos = [], 0
    for n in sizes.tolist():
        out.append(pickle.loads(data[pos:pos + n].tobytes()))
        pos += n
    return out


def _pickled(obj: Any, what: str) -> np.ndarray:
    """``obj``'s pickled bytes, or an InvalidInputError that says why it does not pickle (so that it is refused)."""
    try:
        return np.frombuffer(_pickler.dumps(obj), dtype=np.uint8)
    except (InvalidInputError, InvalidTypeError):
        raise
    except Exception as exc:
        raise InvalidInputError(f"{what}: cannot pickle the {type(obj).__name__} object: {exc}; "
                                "send something picklable (install cloudpickle for lambdas and local classes)") from exc


def _broadcast(rt: Runtime, arr: np.ndarray, root: int, name: str, pset: int) -> np.ndarray:
    """The root's ``arr`` (a 1-d array of bytes or lengths), on every member of ``pset``: the op
    ``ringcomm.broadcast`` submits for it."""
    req = wire.Request(name, wire.BROADCAST, ops.check_dtype(arr.dtype, name), (arr.shape,), 0, root, pset=pset)
    return np.asarray(rt.submit(req, [arr], [None]).wait())


def _allgather(rt: Runtime, arr: np.ndarray, name: str, pset: int) -> np.ndarray:
    """Every member's ``arr`` (a 1-d array of bytes or lengths), joined in rank order: the op
    ``ringcomm.allgather`` submits for it."""
    req = wire.Request(name, wire.ALLGATHER, ops.check_dtype(arr.dtype, name), (arr.shape,), pset=pset)
    return np.asarray(rt.submit(req, [arr]).wait())
