"""ringcomm_torch: a drop-in replacement for ``horovod.torch``, over the pure-Python ringcomm core.

Scripts written for Horovod run unchanged with::

    import ringcomm_torch as hvd

    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

and are started with ``ringcomm-run -np 4 python train.py``.

Modules: :mod:`.basics` (init, rank, size...), :mod:`.collectives` (async and
in-place ops), :mod:`.autograd` (differentiable ops), :mod:`.optimizer`
(``DistributedOptimizer``), :mod:`.functions` (parameter/optimizer/object
broadcast), :mod:`.sync_batch_norm` (``SyncBatchNorm``), :mod:`.elastic`,
:mod:`.compression`, :mod:`.timeline`, :mod:`.tensors` (torch <-> NumPy
staging, bfloat16, CUDA through pinned memory).
"""

from __future__ import annotations

import importlib.util
from typing import Any

try:  # before a submodule fails on it, deep inside
    _torch_found = importlib.util.find_spec("torch") is not None
except (ImportError, ValueError):  # hidden, or set to None in sys.modules
    _torch_found = False
if not _torch_found:
    raise ModuleNotFoundError("ringcomm_torch needs torch, which is not installed here: "
                              "pip install 'ringcomm[torch]' (any torch >= 2.1)", name="torch")

from ringcomm.errors import (
    DuplicateNameError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    InvalidInputError,
    InvalidTypeError,
    MismatchError,
    NotInitializedError,
    PeerLostError,
    RendezvousError,
    RendezvousTimeoutError,
    RingcommError,
    ShutdownError,
)

from .autograd import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from .basics import (
    ProcessSet,
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
)
from .collectives import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    allgather_async,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    barrier,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather_async,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter_async,
    synchronize,
)
from .compression import Compression
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .handles import Handle
from .optimizer import DistributedOptimizer, GradientsPendingError
from .sparse import sparse_allreduce_async
from .sync_batch_norm import SyncBatchNorm
from .timeline import start_timeline, stop_timeline

from . import elastic

from ringcomm import __version__ as __version__  # one version, the core's

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "DuplicateNameError",
    "GradientsPendingError",
    "Handle",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "InvalidInputError",
    "InvalidTypeError",
    "Max",
    "Min",
    "MismatchError",
    "NotInitializedError",
    "PeerLostError",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "RendezvousError",
    "RendezvousTimeoutError",
    "RingcommError",
    "ShutdownError",
    "Sum",
    "SyncBatchNorm",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]

# Horovod names that exist there but not (yet) here: a clear error instead of a bare AttributeError.
_NOT_YET: dict[str, str] = {}


def __getattr__(name: str) -> Any:
    if name in _NOT_YET:
        raise AttributeError(f"ringcomm_torch.{name}: {_NOT_YET[name]}")
    raise AttributeError(f"module 'ringcomm_torch' has no attribute {name!r}")
