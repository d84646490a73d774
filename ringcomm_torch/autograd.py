"""Differentiable collectives: ``allreduce``, ``allgather``, ``broadcast``, ``alltoall``, ``reducescatter``.

Each is a ``torch.autograd.Function`` whose backward is a collective too,
with Horovod's choice of gradient (``horovod/torch/mpi_ops.py``):

==================  ==========================================================
forward             backward (what each rank's input receives)
==================  ==========================================================
allreduce(op)       allreduce of the output gradient with the same op/scales
allgather           this rank's rows of the *averaged* output gradient
broadcast(root)     averaged output gradient on root, zeros elsewhere
alltoall(splits)    alltoall of the output gradient with the received splits
reducescatter(op)   allgather of the output gradient (/ size for Average)
==================  ==========================================================

Example (size 2, rank r holds ``x = torch.tensor([r + 1.], requires_grad=True)``)::

    y = hvd.allreduce(x, op=hvd.Sum)   # every rank: [3.]
    y.sum().backward()
    x.grad                             # every rank: [2.]  (Sum of the ones on both ranks)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .basics import global_process_set, set_rank, set_size
from .collectives import (
    Average, Sum, allgather_async, allreduce_async, alltoall_async, broadcast_async,
    core_name, grouped_allgather_async, grouped_allreduce_async, grouped_allreduce_names,
    grouped_reducescatter_async, reducescatter_async, refusing, resolve_op, synchronize,
)
from .compression import Compression
from .device_threads import caller_waits
from .tracing import untraced

__all__ = ["allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
           "alltoall", "reducescatter", "grouped_reducescatter"]


def _recorded(tensor: torch.Tensor) -> bool:
    """Whether autograd records an op on ``tensor`` (grad mode on and it requires grad).

    When it does not, the collectives below run without their ``Function``: the result is the
    same tensor, with no graph either way, and ``Function.apply``'s own 4-5 us per call are saved
    (a metric averaged every step, ``hvd.allreduce(torch.tensor(loss))``, is such a call).
    Not a tensor: False, and the collective refuses it (on every rank)."""
    return isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled()


class HorovodAllreduce(torch.autograd.Function):
    """Allreduce whose gradient is the allreduce of the output gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, average: Any, name: Any, op: Any, prescale_factor: float,
                postscale_factor: float, process_set: Any) -> torch.Tensor:
        ctx.average, ctx.op = average, op
        ctx.scales = (prescale_factor, postscale_factor)
        ctx.process_set = process_set
        return synchronize(allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor,
                                           process_set))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grad = allreduce(grad_output.contiguous(), average=ctx.average, op=ctx.op,
                         prescale_factor=ctx.scales[0], postscale_factor=ctx.scales[1],
                         process_set=ctx.process_set)
        return grad, None, None, None, None, None, None


@untraced
@caller_waits
def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: Any = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks (default: average) and return a new tensor.  Differentiable.

    Example (size 2, rank r holds ``[r + 1.]``)::

        hvd.allreduce(t)                  # every rank: [1.5]
        hvd.allreduce(t, op=hvd.Max)      # every rank: [2.]
    """
    with refusing("allreduce", core_name("allreduce", name), process_set):
        resolve_op(op, average)  # validate the op/average combination before compressing
    compressed, cctx = compression.compress(tensor)
    if _recorded(compressed):
        reduced = HorovodAllreduce.apply(compressed, average, name, op, prescale_factor, postscale_factor,
                                         process_set)
    else:
        reduced = synchronize(allreduce_async(compressed, average, name, op, prescale_factor, postscale_factor,
                                              process_set))
    return compression.decompress(reduced, cctx)


class HorovodGroupedAllreduce(torch.autograd.Function):
    """Grouped allreduce; the gradients are a grouped allreduce of the output gradients."""

    @staticmethod
    def forward(ctx: Any, average: Any, name: Any, op: Any, prescale_factor: float, postscale_factor: float,
                process_set: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.average, ctx.op = average, op
        ctx.scales = (prescale_factor, postscale_factor)
        ctx.process_set = process_set
        return tuple(synchronize(grouped_allreduce_async(list(tensors), average, name, op, prescale_factor,
                                                         postscale_factor, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        reduced = grouped_allreduce([g.contiguous() for g in grads], average=ctx.average, op=ctx.op,
                                    prescale_factor=ctx.scales[0], postscale_factor=ctx.scales[1],
                                    process_set=ctx.process_set)
        return (None, None, None, None, None, None, *reduced)


@untraced
@caller_waits
def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = global_process_set) -> list[torch.Tensor]:
    """Reduce a list of tensors as one fused op; returns a list of new tensors.  Differentiable."""
    tensors = list(tensors)
    with refusing("grouped_allreduce", None, process_set) as refusal:
        refusal.names = lambda: grouped_allreduce_names(tensors, name)
        resolve_op(op, average, "grouped_allreduce")
    if not tensors:
        return []
    pairs = [compression.compress(t) for t in tensors]
    reduced = HorovodGroupedAllreduce.apply(average, name, op, prescale_factor, postscale_factor, process_set,
                                            *[p[0] for p in pairs])
    return [compression.decompress(r, p[1]) for r, p in zip(reduced, pairs)]


def _first_dims(counts: Sequence[int], process_set: Any) -> torch.Tensor:
    """Every rank's ``counts`` as a (size, len(counts)) int64 tensor (row r: rank r's first dims)."""
    mine = torch.tensor([list(counts)], dtype=torch.int64)
    return allgather(mine, process_set=process_set).view(set_size(process_set), len(counts))


class HorovodAllgather(torch.autograd.Function):
    """Allgather; each rank's gradient is its own rows of the averaged output gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Any, process_set: Any) -> torch.Tensor:
        ctx.dim = tensor.shape[0] if tensor.dim() else 1
        ctx.process_set = process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grad_reduced = allreduce(grad_output.contiguous(), op=Average, process_set=ctx.process_set)
        dims = _first_dims([ctx.dim], ctx.process_set)[:, 0]
        offset = int(dims[: set_rank(ctx.process_set)].sum())
        return grad_reduced.narrow(0, offset, ctx.dim), None, None


@untraced
@caller_waits
def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0 (sizes may differ there).  Differentiable.

    Example (size 2, rank 0 holds ``[[1, 2]]``, rank 1 holds ``[[3, 4], [5, 6]]``)::

        hvd.allgather(t)   # every rank: [[1, 2], [3, 4], [5, 6]]
    """
    if not _recorded(tensor):
        return synchronize(allgather_async(tensor, name, process_set))
    return HorovodAllgather.apply(tensor, name, process_set)


class HorovodGroupedAllgather(torch.autograd.Function):
    """Grouped allgather; gradients as for :class:`HorovodAllgather`, per tensor."""

    @staticmethod
    def forward(ctx: Any, name: Any, process_set: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.dims = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.process_set = process_set
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        reduced = grouped_allreduce([g.contiguous() for g in grads], op=Average, process_set=ctx.process_set)
        dims = _first_dims(ctx.dims, ctx.process_set)
        offsets = dims[: set_rank(ctx.process_set)].sum(dim=0)
        out = [g.narrow(0, int(off), d) for g, off, d in zip(reduced, offsets, ctx.dims)]
        return (None, None, *out)


@untraced
@caller_waits
def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: Any = global_process_set) -> list[torch.Tensor]:
    """Allgather a list of tensors as one op; returns a list.  Differentiable."""
    tensors = list(tensors)
    if not tensors:
        return []
    return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))


class HorovodBroadcast(torch.autograd.Function):
    """Broadcast; the root receives the averaged output gradient, other ranks zeros."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: Any, process_set: Any) -> torch.Tensor:
        ctx.root_rank = root_rank
        ctx.process_set = process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grad_reduced = allreduce(grad_output.contiguous(), op=Average, process_set=ctx.process_set)
        if set_rank(None) != ctx.root_rank:  # root_rank is a global rank
            grad_reduced = torch.zeros_like(grad_reduced)
        return grad_reduced, None, None, None


@untraced
@caller_waits
def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    """Return a new tensor holding ``root_rank``'s ``tensor`` on every rank.  Differentiable.

    Example (size 2, rank r holds ``[r]``)::

        hvd.broadcast(t, root_rank=1)   # every rank: [1]; t itself is unchanged
    """
    if not _recorded(tensor):
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


class HorovodAlltoall(torch.autograd.Function):
    """Alltoall; the gradient is sent back along the received splits."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: Any, process_set: Any) -> Any:
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.process_set = process_set
        ctx.recvsplits = received
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor, *dead: Any) -> tuple[Any, ...]:
        grad, _ = alltoall(grad_output.contiguous(), splits=ctx.recvsplits, process_set=ctx.process_set)
        return grad, None, None, None


@untraced
@caller_waits
def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: Any = global_process_set) -> Any:
    """Send ``splits[j]`` rows of ``tensor`` to rank j; receive every rank's rows for this rank.

    Returns the gathered tensor when ``splits`` is None (dim 0 split equally),
    else ``(tensor, received_splits)`` as Horovod does.  Differentiable.

    Example (size 2, rank r holds ``[10r, 10r + 1, 10r + 2]``)::

        hvd.alltoall(t, splits=[1, 2])   # rank 0: ([0, 10], [1, 1])   rank 1: ([1, 2, 11, 12], [2, 2])
    """
    return HorovodAlltoall.apply(tensor, splits, name, process_set)


def _scatter_grad_scale(op: Any, scales: tuple[float, float], process_set: Any) -> float:
    """The gradient of a reducescatter, as Horovod defines it: the allgathered output gradient, times the
    set size for Sum (every rank's loss counts, as for allreduce's Sum gradient), times 1 for Average."""
    factor = scales[0] * scales[1]
    return factor * set_size(process_set) if op == Sum else factor


class HorovodReducescatter(torch.autograd.Function):
    """Reducescatter; the gradient is the allgather of the output gradient (x size for Sum)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Any, op: Any, process_set: Any, prescale_factor: float,
                postscale_factor: float) -> torch.Tensor:
        ctx.op = op
        ctx.scales = (prescale_factor, postscale_factor)
        ctx.process_set = process_set
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grad = allgather(grad_output.contiguous(), process_set=ctx.process_set)
        factor = _scatter_grad_scale(ctx.op, ctx.scales, ctx.process_set)
        if factor != 1.0:
            grad = grad * factor
        return grad, None, None, None, None, None


@untraced
@caller_waits
def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = Compression.none,
                  op: Any = Average, process_set: Any = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over ranks and return this rank's part of dim 0.  Differentiable.

    Example (size 2, every rank holds ``[[1.], [2.], [3.]]``)::

        hvd.reducescatter(t, op=hvd.Sum)   # rank 0: [[2.], [4.]]   rank 1: [[6.]]
    """
    compressed, cctx = compression.compress(tensor)
    out = HorovodReducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, cctx)


class HorovodGroupedReducescatter(torch.autograd.Function):
    """Grouped reducescatter; gradients as for :class:`HorovodReducescatter`, per tensor."""

    @staticmethod
    def forward(ctx: Any, name: Any, op: Any, process_set: Any, prescale_factor: float, postscale_factor: float,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.op = op
        ctx.scales = (prescale_factor, postscale_factor)
        ctx.process_set = process_set
        return tuple(synchronize(grouped_reducescatter_async(list(tensors), name, op, process_set,
                                                             prescale_factor, postscale_factor)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        gathered = grouped_allgather([g.contiguous() for g in grads], process_set=ctx.process_set)
        factor = _scatter_grad_scale(ctx.op, ctx.scales, ctx.process_set)
        if factor != 1.0:
            gathered = [g * factor for g in gathered]
        return (None, None, None, None, None, *gathered)


@untraced
@caller_waits
def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Any = Compression.none, op: Any = Average,
                          process_set: Any = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reducescatter a list of tensors as one op; returns a list.  Differentiable."""
    tensors = list(tensors)
    if not tensors:
        return []
    pairs = [compression.compress(t) for t in tensors]
    outs = HorovodGroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor,
                                             *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]
