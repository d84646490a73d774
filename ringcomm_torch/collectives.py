"""The asynchronous and in-place collectives on torch tensors (no autograd).

Each ``*_async`` function validates its arguments on the calling thread,
stages the tensor as a host array (:mod:`.tensors`), submits it to the
ringcomm core and returns a :class:`~.handles.Handle`; ``synchronize(handle)``
returns the torch result.  The differentiable, blocking versions
(``allreduce``, ``allgather``...) live in :mod:`.autograd` and are built on these.

What each rank sees (size 2, rank r holds ``t = torch.full((2,), r + 1.)``)::

    hvd.synchronize(hvd.allreduce_async(t))              # every rank: [1.5, 1.5]
    hvd.allreduce_(t, op=hvd.Sum)                        # every rank: t is now [3., 3.]
    hvd.synchronize(hvd.allgather_async(t[:1]))          # every rank: [1., 2.]
    hvd.broadcast_(t, root_rank=1)                       # every rank: t is now [2., 2.]
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

import ringcomm as _rc
from ringcomm.arguments import check_root
from ringcomm.errors import InvalidInputError, InvalidSplitsError, InvalidTypeError, name_rank
from ringcomm.core.ops import ReduceOp
from ringcomm.handles import GroupHandle

from .basics import check_process_set, global_process_set, rank, set_size
from . import device_arena_ops
from .device_arena import arena_for, one_host_arena_for
from .device_threads import caller_waits
from .handles import Handle, completed, poll, synchronize
from .host_memory import HUGE_PAGE_MIN_BYTES, empty_host
from .tensors import Staged, begin, empty_result, stage, stageable_dtype
from .tracing import untraced

__all__ = [
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "ReduceOp", "resolve_op",
    "allreduce_async", "allreduce_async_", "allreduce_", "staged_allreduce", "staged_broadcast", "staged_op",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_allreduce_",
    "allgather_async", "grouped_allgather_async",
    "broadcast_async", "broadcast_async_", "broadcast_",
    "alltoall_async", "reducescatter_async", "grouped_reducescatter_async",
    "barrier", "join", "poll", "synchronize",
]

from ringcomm.core.ops import Adasum, Average, Max, Min, Product, Sum  # noqa: E402  (re-exported)


def resolve_op(op: Any, average: bool | None, what: str = "allreduce", stacklevel: int = 3) -> Any:
    """Horovod's legacy ``average=`` flag -> an op (``op`` wins; giving both is an error).

    ``stacklevel``: the deprecation warning's, counted from here (3: the caller's caller)."""
    if op is not None:
        if average is not None:
            raise InvalidInputError(
                f"{what}: the op parameter supersedes average; please provide only one of them"
            )
        return op
    if average is not None:
        warnings.warn(f"{what}: parameter `average` has been replaced with `op`; "
                      "use op=hvd.Average or op=hvd.Sum", DeprecationWarning, stacklevel=stacklevel)
        return Average if average else Sum
    return Average


def core_name(kind: str, name: str | None) -> str | None:
    """The name the core negotiates on: ``kind.name`` as Horovod does, so that e.g. an allreduce and
    an allgather may share a user name (the core's names form one namespace across kinds).
    None lets the core number the op (``allreduce.noname.N``)."""
    return None if name is None else f"{kind}.{name}"


class refusing:  # lower case: used as a function, like contextlib's managers
    """Within the block, a call's own argument checks, before it calls the core: an
    InvalidInputError or InvalidTypeError raised there is refused on every rank of the op(s) this
    rank would have submitted (the others fail them with ``MismatchError`` naming this rank, and
    this rank's unnamed ops stay numbered in step with theirs), then propagates unchanged.

    The block must not call the core (the core refuses its own errors: refused again, an unnamed
    op would take the next number).  It may set what it would submit as it learns it: ``names``
    (core names, None: numbered by the core; or a function giving them, called only on an error)
    and ``parts`` (one core op per tensor of a grouped allgather or reducescatter).  A class
    rather than a ``@contextmanager``: it runs once per op.
    """

    __slots__ = ("kind", "names", "parts", "process_set")

    def __init__(self, kind: str, core_name: str | None, process_set: Any) -> None:
        self.kind = kind  # the core API's kind, as it numbers unnamed ops: "allreduce", "grouped_allgather"...
        self.names: list[str | None] | Callable[[], list[str | None]] = [core_name]
        self.parts = 1
        self.process_set = process_set

    def __enter__(self) -> refusing:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if not isinstance(exc, (InvalidInputError, InvalidTypeError)) or exc.refused:
            return  # not a refusal, or refused already by a block inside this one: once per call
        exc.refused = True
        for name in self.names() if callable(self.names) else self.names:
            _rc.api.refuse_call(self.kind, name, self.process_set, str(exc), self.parts)
        self.name_rank(exc)

    def name_rank(self, exc: BaseException) -> None:
        """End the message with ``[raised on rank N]`` (this rank's, in the job), once initialized."""
        if _rc.is_initialized():
            name_rank(exc, _rc.rank())


def _group_names(base: str | None, dtypes: Sequence[str]) -> list[str | None]:
    """The core name of each op of a grouped allreduce split by dtype (one op per dtype, sorted)."""
    return [base if base is None or len(dtypes) == 1 else f"{base}.{dt}" for dt in dtypes]


def grouped_allreduce_names(tensors: Sequence[Any], name: str | None) -> list[str | None]:
    """The core names of the ops a grouped allreduce of ``tensors`` submits: one per dtype of the
    tensors this rank can stage (one when it can stage none of them; none for no tensors)."""
    base = core_name("allreduce", name)
    dtypes = sorted({dt for t in tensors if (dt := stageable_dtype(t, True)) is not None})
    return _group_names(base, dtypes) or ([base] if tensors else [])


def _start(staged: Sequence[Staged], core_kind: str, core_name: str | None, process_set: Any,
           start: Callable[[str | None], Any]) -> Any:
    """``start(core_name)`` submits the core op: now, or for CUDA tensors on the stager thread once
    their copies to the host are done (the caller does not wait for the GPU).  An unnamed op
    deferred so takes its ``core_kind.noname.N`` name now, in program order, as the others do; a
    named one claims its name now, so that a duplicate raises at its call."""
    if all(s.ready is None for s in staged):
        return start(core_name)
    if core_name is None:
        core_name = _rc.api.reserve_name(core_kind, process_set)
    else:  # a second op of this name raises at its call, as it does for ops submitted at once
        core_name = _rc.api.claim_name(core_kind, core_name, process_set)
    name: str = core_name

    def submit() -> Any:
        try:
            return start(name)
        except BaseException:
            _rc.api.drop_claim(core_kind, name, process_set)  # nothing if the core took the op
            raise
    try:
        return begin(staged, submit, name)
    except BaseException:
        _rc.api.drop_claim(core_kind, name, process_set)
        raise


def _nbytes(staged: Sequence[Staged]) -> int:
    return int(sum(s.array.nbytes for s in staged))


def _release_all(staged: Sequence[Staged]) -> Any:
    def cleanup() -> None:
        for s in staged:
            s.release()
    return cleanup


def _as_list(tensors: Any, what: str) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        raise InvalidTypeError(f"{what}: expected a list of tensors, got a single tensor; use the non-grouped op")
    return list(tensors)


# ---------------------------------------------------------------- allreduce

def _allreduce(tensor: torch.Tensor, output: torch.Tensor | None, name: str | None, op: Any, average: bool | None,
               prescale_factor: float, postscale_factor: float, process_set: Any) -> Handle:
    """Allreduce ``tensor`` into ``output`` (None: a new tensor; ``tensor`` itself: in place)."""
    what = "allreduce"
    check_process_set(process_set, what)
    cname = core_name("allreduce", name)
    with refusing("allreduce", cname, process_set):
        op = resolve_op(op, average, stacklevel=4)  # the warning names the caller of allreduce_async
        arena = arena_for(tensor, op, process_set)
        if arena is None:
            s = stage(tensor, reduce=True, what=what)
    if arena is not None:  # CUDA, on one host: reduced on the GPUs when every rank has room
        return device_arena_ops.allreduce(
            arena, tensor, in_place=output is tensor, core_name=cname or _rc.api.reserve_name("allreduce", process_set),
            name=name, average=op is Average, prescale=prescale_factor, postscale=postscale_factor,
            fallback=lambda nm: staged_allreduce(tensor, stage(tensor, reduce=True, what=what), output is tensor,
                                                 name, nm, op, prescale_factor, postscale_factor, process_set))
    return staged_allreduce(tensor, s, output is tensor, name, cname, op, prescale_factor, postscale_factor,
                            process_set)


def staged_allreduce(tensor: torch.Tensor, s: Staged, in_place: bool, name: str | None, cname: str | None, op: Any,
                     prescale_factor: float, postscale_factor: float, process_set: Any,
                     consumer: Any = None) -> Handle:
    """Allreduce ``tensor``, staged as ``s``, under core name ``cname`` (None: numbered by the
    core), into itself (``in_place``) or a new tensor; ``consumer``: the stream that uses a device
    result (default: the current one in ``synchronize()``)."""
    if consumer is not None:
        s.consumer = consumer
    out, result = _reduced_into(tensor, s, in_place)
    core = _start([s], "allreduce", cname, process_set,
                  lambda nm: _rc.allreduce_async(s.array, op=op, name=nm, prescale_factor=prescale_factor,
                                                 postscale_factor=postscale_factor, out=out, process_set=process_set))
    return Handle("allreduce", name, core, lambda _raw: result(), s.release, s.array.nbytes)


def staged_op(kind: str, s: Staged, cname: str | None, process_set: Any, start: Callable[[str | None], Any],
              finish: Callable[[Any], Any], consumer: Any = None) -> Handle:
    """One tensor's ``kind`` op through pinned host memory, staged as ``s``: ``start(core_name)``
    submits the core op (at once, or once the copies to the host are done), ``finish(raw)`` turns
    the core's result into the torch one in ``synchronize()``; ``consumer`` as for
    :func:`staged_allreduce`."""
    if consumer is not None:
        s.consumer = consumer
    return Handle(kind, None, _start([s], kind, cname, process_set, start), finish, s.release, s.array.nbytes)


def _reduced_into(tensor: torch.Tensor, s: Staged, in_place: bool) -> tuple[np.ndarray, Callable[[], torch.Tensor]]:
    """Where the core writes ``tensor``'s reduced values, and what then gives the torch result.

    In place, or from a private staging copy (non-contiguous, bfloat16, CUDA): into the staged
    array, then copied back where it is not the tensor itself.  Out of place from the tensor's own
    memory: straight into the new result tensor, so that nothing is copied afterwards."""
    if not in_place and s.direct:
        result_t = empty_result(tensor)
        return result_t.numpy(), lambda: result_t
    if in_place:
        return s.array, lambda: s.write_back(tensor)
    return s.array, lambda: s.write_back(empty_result(tensor))


@untraced
def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = global_process_set) -> Handle:
    """Start reducing ``tensor`` over all ranks; ``synchronize`` returns a new tensor.  Input unchanged.

    Example (size 2, rank r holds ``[r + 1.]``)::

        hvd.synchronize(hvd.allreduce_async(t))              # every rank: [1.5]
        hvd.synchronize(hvd.allreduce_async(t, op=hvd.Sum))  # every rank: [3.]
    """
    return _allreduce(tensor, None, name, op, average, prescale_factor, postscale_factor, process_set)


@untraced
def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = global_process_set) -> Handle:
    """In-place :func:`allreduce_async`: ``synchronize`` returns ``tensor`` itself, now reduced."""
    return _allreduce(tensor, tensor, name, op, average, prescale_factor, postscale_factor, process_set)


@untraced
@caller_waits
def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` in place over all ranks and return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                        process_set))


def _grouped_allreduce(tensors: Any, in_place: bool, name: str | None, op: Any, average: bool | None,
                       prescale_factor: float, postscale_factor: float, process_set: Any) -> Handle:
    what = "grouped_allreduce"
    check_process_set(process_set, what)
    base = core_name("allreduce", name)
    with refusing("grouped_allreduce", base, process_set) as refusal:
        tensors = _as_list(tensors, what)
        # refused: the op of each dtype of the tensors this rank can stage, as it would submit them;
        # another rank whose tensors have other dtypes splits its group otherwise, and its ops then
        # fail with a mismatch or a stall, as groups of different dtypes always have
        refusal.names = lambda: grouped_allreduce_names(tensors, name)
        op = resolve_op(op, average, what, stacklevel=4)
        if not tensors:
            return completed("allreduce", [])
        staged = [stage(t, reduce=True, what=f"{what} (tensor {i})") for i, t in enumerate(tensors)]
    # the core fuses one dtype per group: split a mixed group by dtype, one core op each
    by_dtype: dict[str, list[int]] = {}
    for i, s in enumerate(staged):
        by_dtype.setdefault(s.array.dtype.name, []).append(i)
    names = dict(zip(sorted(by_dtype), _group_names(base, sorted(by_dtype))))
    # the core writes each result where _reduced_into says: in place, the staged arrays (the
    # tensors themselves when contiguous in the wire dtype); out of place, new result tensors
    targets = [_reduced_into(t, s, in_place) for t, s in zip(tensors, staged)]

    def sub(dt: str) -> Any:
        arrays = [staged[i].array for i in by_dtype[dt]]
        outs = [targets[i][0] for i in by_dtype[dt]]
        return _start([staged[i] for i in by_dtype[dt]], "grouped_allreduce", names[dt], process_set,
                      lambda nm: _rc.grouped_allreduce_async(arrays, op=op, name=nm, prescale_factor=prescale_factor,
                                                             postscale_factor=postscale_factor, outs=outs,
                                                             process_set=process_set))
    core = GroupHandle(None, [sub(dt) for dt in sorted(by_dtype)])

    def finish(_raw: Any) -> list[torch.Tensor]:
        return [result() for _, result in targets]
    return Handle("allreduce", name, core, finish, _release_all(staged), _nbytes(staged))


@untraced
def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, process_set: Any = global_process_set) -> Handle:
    """Start reducing a list of tensors as one op; ``synchronize`` returns a list of new tensors."""
    return _grouped_allreduce(tensors, False, name, op, average, prescale_factor, postscale_factor, process_set)


@untraced
def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, process_set: Any = global_process_set) -> Handle:
    """In-place :func:`grouped_allreduce_async`: ``synchronize`` returns the same tensors, reduced."""
    return _grouped_allreduce(tensors, True, name, op, average, prescale_factor, postscale_factor, process_set)


@untraced
@caller_waits
def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: Any = global_process_set) -> list[torch.Tensor]:
    """Reduce a list of tensors in place as one op and return them."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


# ---------------------------------------------------------------- allgather

@untraced
def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: Any = global_process_set) -> Handle:
    """Start concatenating every rank's ``tensor`` along dim 0 (dim 0 may differ per rank).

    Example (size 2, rank r holds ``r + 1`` rows of ``[r]``)::

        hvd.synchronize(hvd.allgather_async(t))   # every rank: [[0], [1], [1]]
    """
    what = "allgather"
    check_process_set(process_set, what)
    cname = core_name("allgather", name)
    with refusing("allgather", cname, process_set):
        s = stage(tensor, reduce=False, what=what)
    guess = _gathered_guess(s, set_size(process_set))
    into = None if guess is None else guess.numpy()
    core = _start([s], "allgather", cname, process_set,
                  lambda nm: _rc.allgather_async(s.array, name=nm, process_set=process_set, out=into))

    def finish(raw: Any) -> torch.Tensor:
        if guess is not None and isinstance(raw, np.ndarray) and raw.ctypes.data == guess.data_ptr() \
                and raw.shape == tuple(guess.shape):
            return guess  # the core wrote the result straight into it
        return s.to_tensor(np.asarray(raw), tensor)
    return Handle("allgather", name, core, finish, s.release, s.array.nbytes)


def _gathered_guess(s: Staged, size: int) -> torch.Tensor | None:
    """A large host allgather's result tensor, made before the op on the guess that every rank
    gives as many rows as this one (the usual case), from the reused huge-page blocks of
    :func:`~ringcomm_torch.host_memory.empty_host`: the core writes the result straight into it.
    Where the guess is wrong the core makes its own array, and the block goes back unused.
    None for small or device tensors, and where the wire dtype is not the tensor's."""
    a = s.array
    if not s.direct or s.wire != s.dtype or s.device.type != "cpu" or a.ndim == 0 \
            or a.nbytes * size < HUGE_PAGE_MIN_BYTES:
        return None
    return empty_host((a.shape[0] * size, *a.shape[1:]), s.dtype, _rc.api.current_settings().host_cache_bytes)


@untraced
def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: Any = global_process_set) -> Handle:
    """Start allgathering a list of tensors as one op; ``synchronize`` returns a list."""
    what = "grouped_allgather"
    check_process_set(process_set, what)
    cname = core_name("allgather", name)
    with refusing("grouped_allgather", cname, process_set) as refusal:
        tensors = _as_list(tensors, what)
        if not tensors:
            return completed("allgather", [])
        refusal.parts = len(tensors)  # the core allgathers each tensor as an op of its own
        staged = [stage(t, reduce=False, what=f"{what} (tensor {i})") for i, t in enumerate(tensors)]
    core = _start(staged, "grouped_allgather", cname, process_set,
                  lambda nm: _rc.grouped_allgather_async([s.array for s in staged], name=nm,
                                                         process_set=process_set))

    def finish(raw: Any) -> list[torch.Tensor]:
        return [s.to_tensor(np.asarray(r), t) for t, s, r in zip(tensors, staged, raw)]
    return Handle("allgather", name, core, finish, _release_all(staged), _nbytes(staged))


# ---------------------------------------------------------------- broadcast

def _broadcast(tensor: torch.Tensor, root_rank: int, name: str | None, in_place: bool,
               process_set: Any) -> Handle:
    what = "broadcast_" if in_place else "broadcast"
    check_process_set(process_set, what)
    cname = core_name("broadcast", name)
    root = root_rank == rank()  # the other ranks' values are not read: not copied to the host
    with refusing("broadcast", cname, process_set):
        arena = one_host_arena_for(tensor, process_set)
        if arena is None:
            s = stage(tensor, reduce=False, what=what, values=root)
        else:  # the core would check the root: this op checks it here, refused on every rank alike
            root_rank = check_root(root_rank, f"broadcast {cname!r}" if cname else "broadcast", _rc.api.size())
    if arena is not None:  # CUDA, every rank on one host: copied from the root's arena on the GPUs
        return device_arena_ops.broadcast(
            arena, tensor, root=root_rank, in_place=in_place,
            core_name=cname or _rc.api.reserve_name("broadcast", process_set), name=name,
            fallback=lambda nm: staged_broadcast(tensor, stage(tensor, reduce=False, what=what, values=root), root_rank,
                                                 in_place, name, nm, process_set))
    return staged_broadcast(tensor, s, root_rank, in_place, name, cname, process_set)


def staged_broadcast(tensor: torch.Tensor, s: Staged, root_rank: int, in_place: bool, name: str | None,
                     cname: str | None, process_set: Any, consumer: Any = None) -> Handle:
    """Broadcast ``tensor``, staged as ``s``, under core name ``cname`` (None: numbered by the
    core), into itself (``in_place``) or a new tensor; ``consumer`` as for :func:`staged_allreduce`."""
    if consumer is not None:
        s.consumer = consumer
    if not in_place and s.direct:
        # the staged array aliases the caller's tensor: receive into a fresh tensor instead
        result_t = empty_result(tensor)
        out = stage(result_t, reduce=False, what="broadcast").array  # its wire view (bfloat16: int16 bits)

        def finish(_raw: Any) -> torch.Tensor:
            return result_t
    else:
        out = s.array  # received straight into the tensor (in place, CPU) or its staging copy
        kept = in_place and root_rank == rank()  # the root's own tensor holds the result already

        def finish(_raw: Any) -> torch.Tensor:
            return tensor if kept else s.write_back(tensor if in_place else empty_result(tensor))
    # the core checks root_rank after numbering the op: a bad root on one rank fails it on every rank
    core = _start([s], "broadcast", cname, process_set,
                  lambda nm: _rc.broadcast_async(s.array, root_rank, name=nm, process_set=process_set, out=out))
    return Handle("broadcast", name, core, finish, s.release, s.array.nbytes)


@untraced
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: Any = global_process_set) -> Handle:
    """Start copying ``root_rank``'s tensor to every rank; ``synchronize`` returns a new tensor."""
    return _broadcast(tensor, root_rank, name, False, process_set)


@untraced
def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: Any = global_process_set) -> Handle:
    """In-place :func:`broadcast_async`: ``synchronize`` returns ``tensor``, now holding root's values."""
    return _broadcast(tensor, root_rank, name, True, process_set)


@untraced
@caller_waits
def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: Any = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s values on every rank and return it.

    Example (size 2, rank r holds ``[r]``)::

        hvd.broadcast_(t, root_rank=1)   # every rank: t is now [1]
    """
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ---------------------------------------------------------------- alltoall

def _splits_array(splits: Any, what: str) -> np.ndarray | None:
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        if splits.is_floating_point() or splits.is_complex() or splits.dtype is torch.bool:
            raise InvalidSplitsError(f"{what} on rank {rank()}: splits must hold integers, got dtype {splits.dtype}; "
                                     "pass torch.tensor(splits, dtype=torch.int32)")
        return splits.detach().cpu().to(torch.int64).contiguous().numpy()
    arr = np.asarray(splits)
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidSplitsError(f"{what} on rank {rank()}: splits must hold integers, got {splits!r}; "
                                 "pass a list of ints or an int32 tensor")
    return arr.astype(np.int64).reshape(-1)


@untraced
def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: Any = global_process_set) -> Handle:
    """Start sending ``splits[j]`` rows of ``tensor`` to rank j (equal parts when ``splits`` is None).

    ``synchronize`` returns ``(output, received_splits)``: the rows every rank
    sent here, in rank order, and how many came from each rank (an int32 CPU
    tensor, or the dtype of ``splits`` when that is a tensor).

    Example (size 2, rank r holds ``[10r, 10r + 1]``)::

        out, recv = hvd.synchronize(hvd.alltoall_async(t))   # rank 0: [0, 10]  rank 1: [1, 11]; recv [1, 1]
    """
    what = "alltoall"
    check_process_set(process_set, what)
    cname = core_name("alltoall", name)
    with refusing("alltoall", cname, process_set):
        s = stage(tensor, reduce=False, what=what)
        split_arr = _splits_array(splits, what)
    splits_dtype = splits.dtype if isinstance(splits, torch.Tensor) else torch.int32
    core = _start([s], "alltoall", cname, process_set,
                  lambda nm: _rc.alltoall_async(s.array, splits=split_arr, name=nm, process_set=process_set))

    def finish(raw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        output, received = raw
        out_t = s.to_tensor(np.asarray(output), tensor)
        recv_t = torch.from_numpy(np.array(received, dtype=np.int64)).to(splits_dtype)
        return out_t, recv_t
    return Handle("alltoall", name, core, finish, s.release, s.array.nbytes)


# ---------------------------------------------------------------- reducescatter

@untraced
def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average,
                        process_set: Any = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> Handle:
    """Start reducing ``tensor`` over ranks and keeping this rank's part of dim 0.

    Dim 0 is split as evenly as possible, lower ranks getting the extra rows.

    Example (size 2, every rank holds ``[[1.], [2.], [3.]]``, op=Sum)::

        hvd.synchronize(hvd.reducescatter_async(t, op=hvd.Sum))   # rank 0: [[2.], [4.]]  rank 1: [[6.]]
    """
    what = "reducescatter"
    check_process_set(process_set, what)
    cname = core_name("reducescatter", name)
    with refusing("reducescatter", cname, process_set):
        s = stage(tensor, reduce=True, what=what)
    core = _start([s], "reducescatter", cname, process_set,
                  lambda nm: _rc.reducescatter_async(s.array, op=op, name=nm, prescale_factor=prescale_factor,
                                                     postscale_factor=postscale_factor, process_set=process_set))

    def finish(raw: Any) -> torch.Tensor:
        return s.to_tensor(np.asarray(raw), tensor)
    return Handle("reducescatter", name, core, finish, s.release, s.array.nbytes)


@untraced
def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None, op: Any = Average,
                                process_set: Any = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Handle:
    """Start a reducescatter of a list of tensors as one op; ``synchronize`` returns a list."""
    what = "grouped_reducescatter"
    check_process_set(process_set, what)
    cname = core_name("reducescatter", name)
    with refusing("grouped_reducescatter", cname, process_set) as refusal:
        tensors = _as_list(tensors, what)
        if not tensors:
            return completed("reducescatter", [])
        refusal.parts = len(tensors)  # the core reduces and scatters each tensor as an op of its own
        staged = [stage(t, reduce=True, what=f"{what} (tensor {i})") for i, t in enumerate(tensors)]
    core = _start(staged, "grouped_reducescatter", cname, process_set,
                  lambda nm: _rc.grouped_reducescatter_async([s.array for s in staged], op=op, name=nm,
                                                             prescale_factor=prescale_factor,
                                                             postscale_factor=postscale_factor,
                                                             process_set=process_set))

    def finish(raw: Any) -> list[torch.Tensor]:
        return [s.to_tensor(np.asarray(r), t) for t, s, r in zip(tensors, staged, raw)]
    return Handle("reducescatter", name, core, finish, _release_all(staged), _nbytes(staged))


# ---------------------------------------------------------------- control

@untraced
def barrier(process_set: Any = global_process_set) -> None:
    """Block until every rank (of ``process_set``) has called ``barrier()``."""
    check_process_set(process_set, "barrier")
    token = Handle("barrier", None, None, lambda _raw: None)
    _rc.barrier(process_set=process_set)
    token.wait()


@untraced
def join(device: int = -1) -> int:
    """Say this rank has no more data; blocks until every rank joins.  Returns the last rank to join.

    Until then, this rank contributes identity values (zeros for Sum/Average)
    to the other ranks' allreduces, as Horovod does.  ``device`` is accepted for
    Horovod compatibility and ignored.
    """
    return int(_rc.join())
