"""Model and optimizer helpers: ``broadcast_parameters``, ``broadcast_optimizer_state``, objects.

What each rank sees (size 2, typical start of training)::

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)   # every rank: rank 0's weights, in place
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)       # every rank: rank 0's lr, momentum buffers...
    hvd.broadcast_object({"epoch": 3} if hvd.rank() == 0 else None)   # every rank: {"epoch": 3}
    hvd.allgather_object(hvd.rank())                            # every rank: [0, 1]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

import ringcomm as _rc
from ringcomm.errors import InvalidInputError, InvalidTypeError

from .basics import check_process_set, global_process_set, rank
from .collectives import broadcast_async_, core_name, refusing, synchronize
from .tracing import untraced

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]


def _broadcast_in_place(named: Sequence[tuple[str | None, torch.Tensor]], root_rank: int) -> None:
    """Broadcast every tensor in place, all in flight at once; waits for all before raising.

    A tensor refused at the call (every rank fails its op) does not keep the others from going out,
    so that every rank still submits the same ops (the first error is raised once all are done)."""
    handles = []
    error: BaseException | None = None
    for name, t in named:
        try:
            handles.append(broadcast_async_(t, root_rank, name=name))
        except (InvalidInputError, InvalidTypeError) as exc:
            error = error or exc
    for h in handles:
        try:
            synchronize(h)
        except BaseException as exc:
            error = error or exc
    if error is not None:
        raise error


@untraced
def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Overwrite ``params`` on every rank with ``root_rank``'s values, in place.

    ``params`` is a ``model.state_dict()`` (or any mapping name -> tensor), an
    iterable of ``(name, tensor)`` such as ``model.named_parameters()``, or an
    iterable of tensors such as ``model.parameters()``.  Named entries are
    broadcast in sorted name order, as Horovod does, under the names
    ``broadcast.<name>``.

    Example (size 2)::

        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        # every rank: model holds rank 0's parameters and buffers
    """
    if isinstance(params, Mapping):
        items: list[tuple[Any, Any]] = sorted(params.items(), key=lambda kv: str(kv[0]))
    elif isinstance(params, torch.Tensor):
        raise InvalidTypeError("broadcast_parameters: expected a state_dict or an iterable of (name, tensor) "
                               "or of tensors, got a single tensor; use hvd.broadcast_(tensor, root_rank)")
    else:
        try:
            items = [p if isinstance(p, tuple) else (None, p) for p in params]
        except TypeError:
            raise InvalidTypeError(f"broadcast_parameters: invalid params of type {type(params).__name__}; "
                                   "pass model.state_dict() or model.named_parameters()") from None
        if items and all(isinstance(n, str) for n, _ in items):
            items.sort(key=lambda kv: kv[0])
    named: list[tuple[str | None, Any]] = [(None if name is None else str(name), value) for name, value in items]
    with refusing("broadcast", None, global_process_set) as refusal:  # the other ranks broadcast every entry
        refusal.names = [core_name("broadcast", name) for name, _ in named]
        for name, value in items:
            if not isinstance(value, torch.Tensor):
                raise InvalidTypeError(
                    f"broadcast_parameters: entry {name!r} is a {type(value).__name__}, not a tensor; "
                    "broadcast it with hvd.broadcast_object")
    _broadcast_in_place(named, root_rank)


def _describe_value(value: Any, param: torch.Tensor) -> tuple[Any, ...]:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device == param.device)
    return ("value", value)


@untraced
def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Make every rank's optimizer state equal to ``root_rank``'s, in place.

    Covers every ``torch.optim`` optimizer (and ``DistributedOptimizer``):
    hyper-parameters in ``param_groups`` (lr, betas tuples, momentum,
    ``initial_lr``...), per-parameter state tensors (momentum buffers, Adam's
    moments and its ``step`` tensor) broadcast in place, and non-tensor state
    (Python step counts, LBFGS lists) as objects.  A rank whose state is not
    initialized yet gets tensors created to match the root's; if the root's
    state is empty, every rank's becomes empty.  A rank whose optimizer has no
    state yet gives each trainable parameter that has no gradient a zero
    gradient, as Horovod does; no optimizer step is run, so parameters are
    never touched.

    Example (size 2, rank 0 resumed from a checkpoint, rank 1 is fresh)::

        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        # every rank: optimizer.state_dict() equals rank 0's
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidTypeError(
            f"broadcast_optimizer_state: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not optimizer.state:
        # A fresh optimizer: Horovod gives every trainable parameter without a gradient a zero one
        # (so code reading p.grad right after works); ringcomm does that too but runs no step.
        for p in params:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    desc = None
    if rank() == root_rank:
        groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        state: list[Any] = []
        for p in params:
            st = optimizer.state.get(p)
            state.append(None if not st else {k: _describe_value(v, p) for k, v in st.items()})
        desc = {"groups": groups, "state": state}
    counts = [len(group["params"]) for group in optimizer.param_groups]
    # one allgather brings the root's description and every rank's group sizes, so a mismatch
    # fails on all ranks alike (none is left waiting in a broadcast the others never start)
    everyone = _rc.allgather_object((counts, desc), name="broadcast_optimizer_state.desc")
    root_counts, desc = everyone[root_rank]
    differ = {r: c for r, (c, _) in enumerate(everyone) if c != root_counts}
    if differ:
        raise InvalidInputError(
            f"broadcast_optimizer_state: rank {rank()}: root rank {root_rank} has param groups of sizes "
            f"{root_counts} but " + ", ".join(f"rank {r} has {c}" for r, c in differ.items())
            + "; build the same optimizer (the same param groups, in the same order) on every rank")
    is_root = rank() == root_rank
    if not is_root:
        for group, options in zip(optimizer.param_groups, desc["groups"]):
            for key in [k for k in group if k != "params" and k not in options]:
                del group[key]
            group.update(options)
    tensors: list[tuple[str, torch.Tensor]] = []
    for index, (p, spec) in enumerate(zip(params, desc["state"])):
        if spec is None:
            if not is_root:
                optimizer.state.pop(p, None)
            continue
        st = optimizer.state[p]
        if not is_root:
            for key in [k for k in st if k not in spec]:
                del st[key]
        for key, entry in spec.items():
            if entry[0] == "value":
                if not is_root:
                    st[key] = entry[1]
                continue
            _, shape, dtype, on_param_device = entry
            current = st.get(key)
            if not is_root and not (isinstance(current, torch.Tensor) and tuple(current.shape) == shape
                                    and current.dtype == dtype):
                device = p.device if on_param_device else torch.device("cpu")
                current = st[key] = torch.zeros(shape, dtype=dtype, device=device)
            tensors.append((f"optimizer_state.{index}.{key}", current))
    _broadcast_in_place(tensors, root_rank)


@untraced
def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: Any = global_process_set) -> Any:
    """Return ``root_rank``'s Python object on every rank of ``process_set`` (pickled; others' ``obj`` is ignored).

    ``root_rank`` is a global rank; with a process set it must be one of the set's ranks.

    Example (size 2)::

        state = hvd.broadcast_object(checkpoint if hvd.rank() == 0 else None, root_rank=0)
    """
    check_process_set(process_set, "broadcast_object")
    return _rc.broadcast_object(obj, root_rank, name, process_set=process_set)


@untraced
def allgather_object(obj: Any, name: str | None = None, process_set: Any = global_process_set) -> list[Any]:
    """A list of the Python object of every rank (of ``process_set``), in rank order.

    Example (size 2)::

        hvd.allgather_object({"rank": hvd.rank()})   # every rank: [{"rank": 0}, {"rank": 1}]
    """
    check_process_set(process_set, "allgather_object")
    return _rc.allgather_object(obj, name, process_set=process_set)
