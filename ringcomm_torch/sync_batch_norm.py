"""``SyncBatchNorm``: batch normalization with statistics over every rank's batch.

A drop-in for ``horovod.torch.SyncBatchNorm`` / ``torch.nn.SyncBatchNorm`` on
CPU and CUDA tensors, for 1d, 2d and 3d inputs (``(N, C)``, ``(N, C, L)``,
``(N, C, H, W)``, ``(N, C, D, H, W)``).  In training mode the forward pass
allgathers each rank's ``(count, mean, biased var)`` per channel and combines
them, so ranks may hold batches of different sizes; the backward pass
allreduces ``sum(dy)`` and ``sum(dy * (x - mean))`` so that the input gradient
is the one of a single BatchNorm over the concatenated batch.  The weight and
bias gradients are this rank's share (as in ``torch.nn.SyncBatchNorm``): their
sum over ranks — what ``DistributedOptimizer`` with ``op=hvd.Sum`` gives, or
``size`` times its average — is the gradient of the whole batch.  In eval mode
the running statistics are used and nothing is communicated.

What each rank sees (2 ranks, rank 0 holds 3 samples, rank 1 holds 5)::

    bn = hvd.SyncBatchNorm(4)
    y = bn(x)                 # every rank: normalized with the mean/var of all 8 samples
    bn.running_mean           # every rank: the same, updated from those 8 samples (unbiased var)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ringcomm.core.ops import Sum

from .basics import global_process_set, set_size
from .collectives import allgather_async, allreduce_async
from .device_threads import caller_waits
from .handles import synchronize

__all__ = ["SyncBatchNorm"]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@caller_waits
def _sum_over_ranks(both: torch.Tensor, process_set: Any) -> torch.Tensor:
    """The sums of every rank's ``both``, blocking (a device tensor's op starts on this thread)."""
    return synchronize(allreduce_async(both, op=Sum, process_set=process_set))


class _SyncBatchNormFunction(torch.autograd.Function):
    """Forward: cross-rank batch statistics.  Backward: the matching cross-rank input gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, eps: float,
                factor: float, process_set: Any) -> torch.Tensor:
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        shape = [1, channels] + [1] * (x.dim() - 2)
        cdtype = _compute_dtype(x)
        xc = x.to(cdtype)
        count = x.numel() // channels if channels else 0
        if count:
            mean = xc.mean(dims)
            var = xc.var(dims, unbiased=False)
        else:  # an empty batch on this rank still takes part, with count 0
            mean = xc.new_zeros(channels)
            var = xc.new_zeros(channels)
        mine = torch.cat([mean.new_tensor([float(count)]), mean, var]).to(torch.float64).cpu().unsqueeze(0)
        gathered = synchronize(allgather_async(mine, process_set=process_set)).to(x.device)
        counts = gathered[:, :1]
        means, variances = gathered[:, 1:1 + channels], gathered[:, 1 + channels:]
        total = float(counts.sum())
        if total <= 1:
            raise ValueError(
                f"SyncBatchNorm: expected more than 1 value per channel when training, got {int(total)} in all "
                f"(input size {list(x.shape)} on this rank)"
            )
        gmean = (counts * means).sum(0) / total
        gvar = (counts * (variances + (means - gmean) ** 2)).sum(0) / total
        with torch.no_grad():
            if running_mean is not None:
                running_mean.mul_(1 - factor).add_(gmean.to(running_mean.dtype), alpha=factor)
            if running_var is not None:
                unbiased = gvar * (total / (total - 1))
                running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)
        mean_c = gmean.to(cdtype)
        invstd = torch.rsqrt(gvar + eps).to(cdtype)
        y = (xc - mean_c.view(shape)) * invstd.view(shape)
        if weight is not None:
            y = y * weight.to(cdtype).view(shape)
        if bias is not None:
            y = y + bias.to(cdtype).view(shape)
        ctx.save_for_backward(x, weight, mean_c, invstd)
        ctx.total = total
        ctx.process_set = process_set
        ctx.has_bias = bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        shape = [1, channels] + [1] * (x.dim() - 2)
        cdtype = mean.dtype
        dy = grad_output.to(cdtype)
        xmu = x.to(cdtype) - mean.view(shape)
        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * xmu).sum(dims)
        grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(weight.dtype if weight is not None else cdtype) \
            if ctx.has_bias and ctx.needs_input_grad[2] else None
        # every rank takes part, whatever it needs: the sums over all ranks' samples
        # on the tensors' device: a CUDA job's sums go through the device service (or, on one host
        # with RINGCOMM_DEVICE_IPC=1, the GPUs' shared arenas), not through a blocking copy here
        both = torch.cat([sum_dy, sum_dy_xmu]).to(torch.float64)
        both = _sum_over_ranks(both, ctx.process_set)
        mean_dy = (both[:channels] / ctx.total).to(cdtype)
        mean_dy_xmu = (both[channels:] / ctx.total).to(cdtype)
        grad_input = None
        if ctx.needs_input_grad[0]:
            scale = invstd if weight is None else invstd * weight.to(cdtype)
            grad_input = (dy - mean_dy.view(shape) - xmu * (invstd * invstd * mean_dy_xmu).view(shape)) \
                * scale.view(shape)
            grad_input = grad_input.to(x.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the batches of every rank of ``process_set`` (default: all ranks).

    Arguments as ``torch.nn.BatchNorm2d``; accepts inputs of 2 to 5 dimensions
    ``(N, C, ...)``.  With one rank (or a set of one) it is a plain BatchNorm.
    Every rank of the set must call it the same number of times in training
    mode, also with an empty batch (it then contributes no samples).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, device: Any = None, dtype: Any = None,
                 process_set: Any = global_process_set) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected an input of 2 or more dimensions (N, C, ...), "
                             f"got {input.dim()}D input of size {list(input.shape)}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm: expected {self.num_features} channels (dim 1), got input of "
                             f"size {list(input.shape)}")
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch_stats = self.training or self.running_mean is None
        if not use_batch_stats:  # eval with running statistics: no communication
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        running_mean = self.running_mean if self.training else None
        running_var = self.running_var if self.training else None
        if set_size(self.process_set) == 1:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, True, factor, self.eps)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean, running_var,
                                            self.eps, factor, self.process_set)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module, process_set: Any = global_process_set) -> torch.nn.Module:
        """A copy of ``module``'s structure with every ``BatchNorm*d`` replaced by a ``SyncBatchNorm``
        holding the same parameters and running statistics (as ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``)."""
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
            out = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats,
                      process_set=process_set)
            if module.affine:
                with torch.no_grad():
                    out.weight = module.weight
                    out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, process_set))
        return out
