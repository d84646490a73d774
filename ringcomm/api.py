"""The public API: Horovod's names and semantics on NumPy arrays.

Module functions delegate to one :class:`Runtime` created by :func:`init`.
Every collective validates its input on the calling rank (so misuse raises
at the call, naming the fix), gives the op a name, hands it to the engine
and returns a :class:`Handle` (``*_async``) or waits for the result.

Example, on every rank of ``ringcomm-run -np 2``::

    >>> import numpy as np, ringcomm as rc
    >>> rc.init()
    >>> a = np.full(2, rc.rank() + 1.0)         # rank 0: [1, 1]   rank 1: [2, 2]
    >>> rc.allreduce(a, op=rc.Sum)              # every rank: [3, 3]
    >>> rc.allgather(np.arange(rc.rank() + 1))  # every rank: [0, 0, 1]
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from .core import adasum, ops, wire
from .core.coordinator import JOIN_NAME
from .core.ops import Average, ReduceOp
from .errors import InvalidInputError, InvalidSplitsError, InvalidTypeError, UnsupportedError
from .arguments import as_array as as_array, check_gather_out, check_out, check_set_root, scale
from .handles import GroupHandle, Handle, MappedHandle
from .objects import allgather_object as allgather_object, broadcast_object as broadcast_object
from .core.process_sets import ProcessSet, global_process_set
from .runtime import (  # re-exported: the public API is ringcomm.api's names
    Runtime,
    add_process_set as add_process_set,
    active,
    cross_rank as cross_rank,
    cross_size as cross_size,
    current,
    current_settings as current_settings,
    hostname as hostname,
    init as init,
    is_initialized as is_initialized,
    local_rank as local_rank,
    local_size as local_size,
    process_set_ids as process_set_ids,
    rank as rank,
    remove_process_set as remove_process_set,
    resolve_process_set as resolve_process_set,  # ringcomm_torch resolves through ringcomm.api
    shutdown as shutdown,
    size as size,
    start_timeline as start_timeline,
    stop_timeline as stop_timeline,
    timeline_active as timeline_active,
    timeline_span as timeline_span,
)

AnyHandle = Handle | GroupHandle | MappedHandle
log = logging.getLogger("ringcomm.api")


# ---------------------------------------------------------------------------
# collectives


def allreduce_async(
    arr: Any,
    op: ReduceOp = Average,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    out: np.ndarray | None = None,
    process_set: ProcessSet = global_process_set,
) -> Handle | MappedHandle:
    """Start an allreduce; ``synchronize(handle)`` returns the reduced array (``out`` if given)."""
    rt = current("allreduce")
    pset, members = rt.resolve_set(process_set, "allreduce")
    call = rt.name_op("allreduce", name, pset)
    with rt.refusing(call):  # an argument refused here fails the op on every member
        name = call.name
        what = f"allreduce {name!r}"
        a = as_array(arr, what)
        dt = ops.check_dtype(a.dtype, what)
        rop = ops.check_op(op, dt, what)
        pre, post = scale(prescale_factor, "prescale_factor", what), scale(postscale_factor, "postscale_factor", what)
        if rop is ReduceOp.ADASUM:
            return _adasum_async(rt, pset, len(members), name, [a], pre, post, [check_out(out, a, what)], what,
                                 grouped=False)
        req = wire.Request(name, wire.ALLREDUCE, dt, (a.shape,), int(rop), -1, pre, post, pset=pset)
        return rt.submit(req, [a], [check_out(out, a, what)])


def allreduce(arr: Any, op: ReduceOp = Average, name: str | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, out: np.ndarray | None = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Reduce ``arr`` across the ranks of ``process_set`` (default: all); each of them gets the result.

    Integer sums wrap around on overflow, as NumPy's (and Horovod's) do: an int8 Sum of 100 and 100
    is -56.  Use a wider dtype when the sum may not fit.

        rank 0: [1., 2.]   rank 1: [3., 4.]   ->   every rank: [2., 3.]   (Average, the default)
        with process_set=ProcessSet([0, 2]) of 4 ranks: ranks 0 and 2 call it and get the average of
        their two arrays; ranks 1 and 3 do not call it
    """
    return allreduce_async(arr, op, name, prescale_factor, postscale_factor, out, process_set).wait()


def grouped_allreduce_async(arrs: Sequence[Any], op: ReduceOp = Average, name: str | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            outs: Sequence[np.ndarray | None] | None = None,
                            process_set: ProcessSet = global_process_set) -> Handle | MappedHandle:
    """Reduce a list of arrays (one dtype) as one fused op; the result is a list (``outs`` if given)."""
    rt = current("grouped_allreduce")
    pset, members = rt.resolve_set(process_set, "grouped_allreduce")
    call = rt.name_op("grouped_allreduce", name, pset)
    with rt.refusing(call):  # an argument refused here fails the op on every member
        name = call.name
        what = f"grouped_allreduce {name!r}"
        if isinstance(arrs, np.ndarray) or not isinstance(arrs, Sequence) or len(arrs) == 0:
            raise InvalidTypeError(f"{what}: expected a non-empty list of arrays")
        arrays = [as_array(a, f"{what}[{i}]") for i, a in enumerate(arrs)]
        dtypes = {a.dtype.name for a in arrays}
        if len(dtypes) > 1:
            raise InvalidTypeError(f"{what}: all arrays of a group must share a dtype, got {sorted(dtypes)}")
        dt = ops.check_dtype(arrays[0].dtype, what)
        rop = ops.check_op(op, dt, what)
        pre, post = scale(prescale_factor, "prescale_factor", what), scale(postscale_factor, "postscale_factor", what)
        if outs is not None and len(outs) != len(arrays):
            raise InvalidInputError(f"{what}: outs= has {len(outs)} arrays for {len(arrays)} inputs")
        checked = [check_out(o, a, f"{what}[{i}]") for i, (o, a) in enumerate(zip(outs or [None] * len(arrays), arrays))]
        if rop is ReduceOp.ADASUM:
            return _adasum_async(rt, pset, len(members), name, arrays, pre, post, checked, what, grouped=True)
        req = wire.Request(name, wire.ALLREDUCE, dt, tuple(a.shape for a in arrays), int(rop), -1, pre, post, pset=pset)
        return rt.submit(req, arrays, checked, grouped=True)


def _adasum_async(rt: Runtime, pset: int, members: int, name: str, arrays: list[np.ndarray], pre: float, post: float,
                  outs: list[np.ndarray | None], what: str, grouped: bool) -> MappedHandle:
    """Adasum over an allgather: every rank reduces all ranks' buffers in VHDD order (:mod:`ringcomm.core.adasum`),
    so every rank holds bitwise the same result."""
    if not adasum.is_power_of_two(members):
        raise UnsupportedError(
            f"{what} on rank {rt.topo.rank}: op=Adasum needs a power-of-two number of ranks "
            f"(as Horovod's), this {'process set' if pset else 'job'} has {members}; "
            "run on 1, 2, 4, 8... ranks, reduce over a process set of such a size, or use op=Average"
        )
    flat = np.concatenate([a.reshape(-1) for a in arrays])  # a copy: the inputs stay as they are
    ops.scale_inplace(flat, pre)
    counts = [a.size for a in arrays]
    shapes = [a.shape for a in arrays]
    gathered = rt.submit(wire.Request(name, wire.ALLGATHER, ops.check_dtype(flat.dtype, what), ((1, flat.size),),
                                      pset=pset), [flat.reshape(1, -1)])

    def finish(rows: np.ndarray) -> Any:
        result = adasum.tree_reduce(list(rows), counts)
        ops.scale_inplace(result, post)
        parts, start = [], 0
        for shape, count, out in zip(shapes, counts, outs):
            part = result[start:start + count].reshape(shape)
            start += count
            if out is not None:
                out[...] = part
                part = out
            parts.append(part)
        return parts if grouped else parts[0]

    return MappedHandle(name, gathered, finish)


def grouped_allreduce(arrs: Sequence[Any], op: ReduceOp = Average, name: str | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      outs: Sequence[np.ndarray | None] | None = None,
                      process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    """Reduce a list of arrays as one fused op over the ranks of ``process_set``; returns a list."""
    return grouped_allreduce_async(arrs, op, name, prescale_factor, postscale_factor, outs, process_set).wait()


def allgather_async(arr: Any, name: str | None = None, process_set: ProcessSet = global_process_set,
                    out: np.ndarray | None = None) -> Handle:
    """Start an allgather (dim 0 may differ between ranks; a 0-d array counts as one row).  With ``out``
    (C-contiguous, of ``arr``'s dtype and row shape) the result is written there when its first dimension
    is the sum of every rank's; otherwise, as without it, a new array holds the result."""
    rt = current("allgather")
    pset, _ = rt.resolve_set(process_set, "allgather")
    call = rt.name_op("allgather", name, pset)
    with rt.refusing(call):  # an argument refused here fails the op on every member
        name = call.name
        what = f"allgather {name!r}"
        a = as_array(arr, what)
        if a.ndim == 0:
            a = a.reshape(1)
        dt = ops.check_dtype(a.dtype, what)
        return rt.submit(wire.Request(name, wire.ALLGATHER, dt, (a.shape,), pset=pset), [a],
                         [check_gather_out(out, a, what)])


def allgather(arr: Any, name: str | None = None, process_set: ProcessSet = global_process_set,
              out: np.ndarray | None = None) -> np.ndarray:
    """Concatenate the arrays of the ranks of ``process_set`` (default: all) along dim 0, in rank order.

        rank 0: [[1, 2]]   rank 1: [[3, 4], [5, 6]]   ->   every rank: [[1, 2], [3, 4], [5, 6]]

    With ``out`` (a C-contiguous array of ``arr``'s dtype whose first dimension is every rank's rows
    together) the result is written there and returned, with no new array; ``arr`` may be this
    rank's own rows inside ``out``.  An ``out`` whose first dimension turns out not to fit gets a
    new array returned instead.
    """
    return allgather_async(arr, name, process_set, out).wait()


def grouped_allgather_async(arrs: Sequence[Any], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> GroupHandle:
    rt = current("grouped_allgather")
    pset, _ = rt.resolve_set(process_set, "grouped_allgather")
    name = rt.auto_name("grouped_allgather", name, pset)
    return GroupHandle(name, [allgather_async(a, f"{name}.{i}", process_set) for i, a in enumerate(arrs)])


def grouped_allgather(arrs: Sequence[Any], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    return grouped_allgather_async(arrs, name, process_set).wait()


def broadcast_async(arr: Any, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set, out: np.ndarray | None = None) -> Handle:
    """Start a broadcast; ``synchronize(handle)`` returns the root's values (in ``out`` if given)."""
    rt = current("broadcast")
    pset, ranks = rt.resolve_set(process_set, "broadcast")
    call = rt.name_op("broadcast", name, pset)
    with rt.refusing(call):  # an argument refused here fails the op on every member
        name = call.name
        what = f"broadcast {name!r}"
        a = as_array(arr, what)
        root = check_set_root(root_rank, what, ranks, pset)
        dt = ops.check_dtype(a.dtype, what)
        return rt.submit(wire.Request(name, wire.BROADCAST, dt, (a.shape,), 0, root, pset=pset), [a],
                         [check_out(out, a, what)])


def broadcast(arr: Any, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set, out: np.ndarray | None = None) -> np.ndarray:
    """Every rank (of ``process_set``) gets a copy of ``root_rank``'s array (same shape and dtype everywhere).

        rank 0: [1, 2]   rank 1: [0, 0]   broadcast(x, 0)  ->   every rank: [1, 2]

    ``root_rank`` is a global rank, also with a process set (as in Horovod).  With ``out`` the
    result is written there and returned (``out=arr`` broadcasts in place: no new array, and
    the data go straight from the wire into it).
    """
    return broadcast_async(arr, root_rank, name, process_set, out).wait()


def alltoall_async(arr: Any, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set, out: Any = None,
                   received_splits: Any = None) -> Handle | MappedHandle:
    """Start an alltoall (see :func:`alltoall`; ``out`` and ``received_splits`` as there)."""
    rt = current("alltoall")
    pset, ranks = rt.resolve_set(process_set, "alltoall")
    call = rt.name_op("alltoall", name, pset)
    with rt.refusing(call):  # an argument refused here fails the op on every member
        name = call.name
        what = f"alltoall {name!r}"
        n = len(ranks)
        arrays = _alltoall_arrays(arr, n, what)
        a = arrays[0]
        rows = sum(x.shape[0] for x in arrays)
        if isinstance(arr, (list, tuple)):  # one array per rank: their rows are the splits
            mine = [x.shape[0] for x in arrays]
            if splits is not None and _split_counts(splits, rows, n, what) != mine:
                raise InvalidInputError(f"{what}: splits {np.asarray(splits).tolist()} with one array per rank, "
                                        f"whose rows are {mine}; pass no splits")
            splits = mine
        split_list = _split_counts(splits, rows, n, what)
        received = None if received_splits is None else tuple(_split_counts(received_splits, None, n, what,
                                                                            "received_splits"))
        dt = ops.check_dtype(a.dtype, what)
        outs = _alltoall_outs(out, a, received, arrays, what)
        req = wire.Request(name, wire.ALLTOALL, dt, ((rows, *a.shape[1:]),), splits=tuple(split_list), pset=pset,
                           received_splits=received)
        handle = rt.submit(req, arrays, outs)
        if n == 1 and isinstance(out, (list, tuple)):  # one rank: its one output, as a list as given
            return MappedHandle(name, handle, lambda res: ([res[0]], res[1]))
        return handle


def _alltoall_arrays(arr: Any, n: int, what: str) -> list[np.ndarray]:
    """What an alltoall sends: one array, or a list of one array per rank (of one dtype and row shape)."""
    if not isinstance(arr, (list, tuple)):
        arrays = [as_array(arr, what)]
    else:
        if len(arr) != n:
            raise InvalidInputError(f"{what}: {len(arr)} arrays to send for {n} ranks; pass one array per rank, "
                                    "or one array and splits")
        arrays = [as_array(x, f"{what}[{j}]") for j, x in enumerate(arr)]
        kinds = {(x.dtype.str, x.shape[1:]) for x in arrays if x.ndim}
        if len(kinds) > 1:
            raise InvalidInputError(f"{what}: the arrays for each rank differ in dtype or in the dimensions after "
                                    f"the first: {sorted(kinds)}; only dim 0 may differ")
    if any(x.ndim == 0 for x in arrays):
        raise InvalidInputError(
            f"{what}: needs an array with at least one dimension, got a 0-d array; reshape it, e.g. x.reshape(1)"
        )
    return arrays


def _alltoall_outs(out: Any, a: np.ndarray, received: tuple[int, ...] | None, arrays: list[np.ndarray],
                   what: str) -> list[np.ndarray | None]:
    """Where an alltoall's rows go: ``[out]`` (one array, or None), or one output per rank, each of
    the rows ``received`` says that rank sends (checked: arrays of ``a``'s dtype and row shape, apart
    from what is sent)."""
    if isinstance(out, (list, tuple)):
        if received is None or len(out) != len(received):
            raise InvalidInputError(f"{what}: out= as a list needs one array per rank and received_splits= (the "
                                    "rows each of them takes)")
        outs = [check_gather_out(o, a, f"{what}: out[{j}]", f"{received[j]}, the rows rank {j} sends")
                for j, o in enumerate(out)]
        bad = [j for j, o in enumerate(outs) if o is not None and o.shape[0] != received[j]]
        if bad or any(o is None for o in outs):
            j = bad[0] if bad else 0
            raise InvalidInputError(f"{what}: out[{j}] must hold the {received[j]} rows of received_splits[{j}]")
    else:
        outs = [check_gather_out(out, a, what, "the rows this rank receives")]
    if any(o is not None and o.size and x.size and np.may_share_memory(o, x) for o in outs for x in arrays):
        raise InvalidInputError(f"{what}: out= shares memory with the array sent, whose rows it would "
                                f"overwrite while they go out; pass a separate array")
    return outs


def _split_counts(splits: Any, rows: int | None, n: int, what: str, label: str = "splits") -> list[int]:
    """``splits`` checked as one row count per rank (summing to ``rows`` unless it is None);
    None: ``rows`` shared evenly."""
    if type(splits) in (list, tuple) and len(splits) == n and all(type(v) is int and v >= 0 for v in splits) \
            and (rows is None or sum(splits) == rows):
        return list(splits)  # the common case (a training loop's, the backend's): nothing to convert
    if splits is None and rows is not None:
        if rows % n:
            raise InvalidInputError(
                f"{what}: dim 0 ({rows}) is not divisible by the job size ({n}); pass splits=[rows for each rank]"
            )
        return [rows // n] * n
    s = np.asarray(splits)
    if s.dtype.kind not in "iu":
        raise InvalidSplitsError(
            f"{what}: {label} must be integers, got dtype {s.dtype}; pass np.asarray({label}).astype(np.int64)"
        )
    if s.ndim != 1 or s.size != n:
        raise InvalidInputError(
            f"{what}: {label} must have one entry per rank ({n}), got shape {s.shape}; pass a list of {n} row counts"
        )
    if (s < 0).any():
        raise InvalidInputError(f"{what}: {label} must be >= 0, got {s.tolist()}; each is a row count")
    if rows is not None and int(s.sum()) != rows:
        raise InvalidInputError(
            f"{what}: {label} sum to {int(s.sum())} but dim 0 of the array is {rows}; they must match"
        )
    return [int(v) for v in s]


def alltoall(arr: Any, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set,
             out: Any = None, received_splits: Any = None) -> tuple[Any, np.ndarray]:
    """Rank i sends ``splits[j]`` rows to rank j; returns ``(received rows, received_splits)``.

        rank 0: [0, 1, 2] splits [1, 2]    rank 1: [7, 8] splits [1, 1]
        ->  rank 0: ([0, 7], [1, 1])        rank 1: ([1, 2, 8], [2, 1])

    With a process set, i and j are ranks within the set (``splits`` has one entry per member).
    With ``out`` (a C-contiguous array of ``arr``'s dtype and row shape, apart from ``arr``) the
    received rows are written there and returned when its first dimension turns out to be their
    number; otherwise, as without it, a new array holds them.
    With ``received_splits`` (the rows this rank expects from each rank, as torch's
    ``output_split_sizes``) the op fails on every rank, with a :class:`MismatchError` naming the
    counts, unless each rank sends this rank what it expects.

    ``arr`` may also be a list of one array per rank (rank j gets ``arr[j]``, sent from where it
    lies: no copy into one buffer; no ``splits``), and ``out`` (with ``received_splits``) a list
    of one array per rank, ``out[i]`` receiving the rows from rank i in place; the result's rows
    are then that list.
    """
    return alltoall_async(arr, splits, name, process_set, out, received_splits).wait()


def reducescatter_async(arr: Any, op: ReduceOp = Average, name: str | None = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        process_set: ProcessSet = global_process_set) -> Handle:
    rt = current("reducescatter")
    pset, _ = rt.resolve_set(process_set, "reducescatter")
    call = rt.name_op("reducescatter", name, pset)
    with rt.refusing(call):  # an argument refused here fails the op on every member
        name = call.name
        what = f"reducescatter {name!r}"
        a = as_array(arr, what)
        if a.ndim == 0:
            raise InvalidInputError(
                f"{what}: needs an array with at least one dimension, got a 0-d array; reshape it, e.g. x.reshape(1)"
            )
        if ops.is_adasum(op):
            raise UnsupportedError(
                f"{what} on rank {rt.topo.rank}: op=Adasum is not defined for reducescatter (Adasum combines "
                "whole tensors, not the blocks a rank keeps); use op=Sum or Average, or allreduce(op=Adasum)"
            )
        dt = ops.check_dtype(a.dtype, what)
        rop = ops.check_op(op, dt, what)
        req = wire.Request(name, wire.REDUCESCATTER, dt, (a.shape,), int(rop), -1,
                           scale(prescale_factor, "prescale_factor", what), scale(postscale_factor, "postscale_factor", what),
                           pset=pset)
        return rt.submit(req, [a])


def reducescatter(arr: Any, op: ReduceOp = Average, name: str | None = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Reduce across ranks, then rank r keeps rows block r of dim 0 (lower ranks get the extra rows).

        rank 0: [1, 2, 3]   rank 1: [10, 20, 30]   op=Sum  ->   rank 0: [11, 22]   rank 1: [33]

    With a process set, r is the rank within the set.
    """
    return reducescatter_async(arr, op, name, prescale_factor, postscale_factor, process_set).wait()


def grouped_reducescatter_async(arrs: Sequence[Any], op: ReduceOp = Average, name: str | None = None,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                                process_set: ProcessSet = global_process_set) -> GroupHandle:
    rt = current("grouped_reducescatter")
    pset, _ = rt.resolve_set(process_set, "grouped_reducescatter")
    name = rt.auto_name("grouped_reducescatter", name, pset)
    return GroupHandle(name, [reducescatter_async(a, op, f"{name}.{i}", prescale_factor, postscale_factor, process_set)
                              for i, a in enumerate(arrs)])


def grouped_reducescatter(arrs: Sequence[Any], op: ReduceOp = Average, name: str | None = None,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    return grouped_reducescatter_async(arrs, op, name, prescale_factor, postscale_factor, process_set).wait()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank (of ``process_set``) has called barrier()."""
    rt = current("barrier")
    pset, _ = rt.resolve_set(process_set, "barrier")
    rt.submit(wire.Request(rt.auto_name("barrier", None, pset), wire.BARRIER, pset=pset), []).wait()


def join() -> int:
    """This rank has run out of data: until every rank joins, its share of others' allreduces is zero.

    Returns the rank that joined last (the same on every rank).
    """
    rt = current("join")
    last = rt.submit(wire.Request(JOIN_NAME, wire.JOIN), []).wait()
    rt.after_join()
    return last


def poll(handle: AnyHandle) -> bool:
    """True once the op behind ``handle`` has finished (never blocks)."""
    return handle.done()


def synchronize(handle: AnyHandle) -> Any:
    """Wait for the op behind ``handle`` and return its result (or raise its error)."""
    return handle.wait()


# ---------------------------------------------------------------------------
# for layers above the core (ringcomm_torch)


def reserve_name(kind: str, process_set: Any) -> str:
    """Take the name the next unnamed ``kind`` op of ``process_set`` gets (``kind.noname.N``, the
    core op's own kind, e.g. ``"allreduce"`` or ``"grouped_allreduce"``), to submit it later.

    For layers above the core that hand an op to the core from another thread (ringcomm_torch
    once a CUDA tensor's copy is done): the name is taken in program order, as the others are.
    """
    rt = current(kind)
    pset, _ = rt.resolve_set(process_set, kind)
    return rt.auto_name(kind, None, pset)


def claim_name(kind: str, name: str, process_set: Any) -> str:
    """Take ``name`` for a ``kind`` op of ``process_set`` that is submitted later, from another
    thread (ringcomm_torch once a CUDA tensor's copy is done); returns the name to submit that op
    under.  Until the op is done, any other op of that name raises :class:`DuplicateNameError`
    at its call, as it does for ops submitted at once.  :func:`drop_claim` gives the name back if
    the op is never submitted."""
    rt = current(kind)
    pset, _ = rt.resolve_set(process_set, kind)
    return rt.claim_name(kind, name, pset)


def drop_claim(kind: str, name: str, process_set: Any) -> None:
    """Give back a name :func:`claim_name` took, whose op was not submitted (nothing if it was)."""
    rt = active()
    if rt is not None:
        pset, _ = rt.resolve_set(process_set, kind)
        rt.drop_claim(name, pset)


def refuse_call(kind: str, name: str | None, process_set: Any, reason: str, parts: int = 1) -> None:
    """For layers above the core whose own argument checks fail before they call it (ringcomm_torch):
    the ``kind`` op (a core API's kind, as for :func:`reserve_name`) named ``name`` (None: the next
    ``kind.noname.N``, as that call would take) fails on every member with ``reason``, and unnamed ops
    stay numbered in step; each of a grouped allgather's or reducescatter's ``parts`` is refused.
    Nothing happens before ``init()`` or with one rank; never raises (the caller raises its error)."""
    rt = active()
    if rt is None or rt.topo.size == 1:
        return
    try:
        pset, _ = current(kind).resolve_set(process_set, kind)
        call = rt.name_op(kind, name, pset)
        split = kind in ("grouped_allgather", "grouped_reducescatter")  # the core submits name.i per array
        for part in [call.part(str(i)) for i in range(parts)] if split else [call]:
            rt.refuse(part, reason)
    except Exception as exc:  # the caller's own error says what went wrong
        log.debug("rank %d: could not refuse the %s op %r: %r", rt.topo.rank, kind, name, exc)
