"""Sparse allreduce: every rank's (indices, values) of a sparse COO tensor allgathered, as Horovod does.

The result holds every rank's entries side by side (not coalesced: an index several
ranks touched appears once per rank; ``coalesce()`` sums them), so it equals the dense
sum (``op=Sum``) or average (``op=Average``, the values divided by the number of ranks)::

    # size 2; rank 0: {0: 1., 2: 5.}   rank 1: {2: 3.}        (index: value)
    h = hvd.sparse_allreduce_async(t, name="emb", op=hvd.Sum)
    h().coalesce()             # every rank: {0: 1., 2: 8.}   (also: hvd.synchronize(h))
"""

from __future__ import annotations

from typing import Any

import torch

from ringcomm.errors import InvalidTypeError
from ringcomm.handles import GroupHandle

from .basics import global_process_set, size
from .collectives import Average, Sum, allgather_async, core_name, refusing
from .handles import Handle
from .tensors import check_stageable
from .tracing import untraced

__all__ = ["SparseHandle", "sparse_allreduce_async"]


class SparseHandle(Handle):
    """A sparse allreduce in flight: ``handle()`` (Horovod's way) or ``hvd.synchronize(handle)`` returns it."""

    __slots__ = ()

    def __call__(self) -> torch.Tensor:
        return self.wait()


@untraced
def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average,
                           process_set: Any = global_process_set) -> SparseHandle:
    """Start reducing the sparse COO ``tensor`` over the ranks of ``process_set`` (``op`` Sum or Average).

    Indices and values are two allgathers, ``name.indices`` and ``name.values``; ranks may hold
    different numbers of entries.  The result is a sparse tensor of ``tensor``'s size.
    """
    what = f"sparse_allreduce {name!r}"
    parts = [core_name("allgather", None if name is None else f"{name}.{part}") for part in ("values", "indices")]
    with refusing("allgather", None, process_set) as refusal:
        refusal.names = parts  # both allgathers, as the other ranks submit them
        if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
            raise InvalidTypeError(f"{what}: expected a sparse COO tensor, got "
                                   f"{type(tensor).__name__ if not isinstance(tensor, torch.Tensor) else tensor.layout}; "
                                   "use hvd.allreduce for dense tensors")
        if op not in (Average, Sum):
            raise InvalidTypeError(f"{what}: op={op!r} cannot reduce sparse tensors by allgather; use hvd.Sum or "
                                   "hvd.Average, or densify the tensor (tensor.to_dense()) and use hvd.allreduce")
        indices = tensor._indices().transpose(0, 1).contiguous()  # one row per entry: allgather joins rows
        values = tensor._values().contiguous()
        check_stageable(values, "allgather")  # here, not in the first allgather: the second would be missing
    vh = allgather_async(values, name=None if name is None else f"{name}.values", process_set=process_set)
    ih = allgather_async(indices, name=None if name is None else f"{name}.indices", process_set=process_set)
    members = size() if process_set is None or process_set is global_process_set else process_set.size()

    def finish(raw: Any) -> torch.Tensor:
        all_values, all_indices = raw
        if op == Average:
            all_values = all_values / members
        return torch.sparse_coo_tensor(all_indices.transpose(0, 1), all_values, tensor.size(), check_invariants=False)

    return SparseHandle("sparse_allreduce", name, GroupHandle(None, [vh, ih]), finish)
