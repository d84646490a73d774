"""Lifecycle, topology and build queries: Horovod's ``horovod.torch`` basics over ``ringcomm``.

Everything here delegates to the framework-agnostic core; nothing touches
tensors.  What each rank sees in a 2-process job started by
``ringcomm-run -np 2 python train.py``::

    hvd.init()
    hvd.rank()        # rank 0: 0        rank 1: 1
    hvd.size()        # every rank: 2
    hvd.local_rank()  # rank 0: 0        rank 1: 1   (both on one host)
    hvd.cross_size()  # every rank: 1    (number of hosts)
"""

from __future__ import annotations

from typing import Any

import torch

import ringcomm as _rc
from ringcomm.errors import InvalidInputError

__all__ = [
    "init", "shutdown", "is_initialized",
    "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "is_homogeneous",
    "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "check_process_set",
]


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start (or join) the job: every rank must call it before any collective.

    Without a launcher environment this makes a one-process job (size 1).
    ``comm`` (an MPI communicator in Horovod) and ``process_sets`` are accepted
    for signature compatibility; only their defaults are supported.
    """
    if comm is not None and comm != []:
        raise InvalidInputError(
            "hvd.init(comm=...): ringcomm does not use MPI communicators; start the job with "
            "`ringcomm-run -np N python script.py` and call hvd.init() without arguments"
        )
    if process_sets:
        raise InvalidInputError(
            "hvd.init(process_sets=...): process sets other than the global one are not supported yet"
        )
    _rc.init()


def shutdown() -> None:
    """Stop the background engine; pending ops fail with ``ShutdownError``.  Safe to call twice."""
    _rc.shutdown()


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()``."""
    return bool(_rc.is_initialized())


def rank() -> int:
    """This process's global rank, 0 .. size()-1."""
    return _rc.rank()


def size() -> int:
    """Number of processes in the job."""
    return _rc.size()


def local_rank() -> int:
    """Rank among the processes on this host (use it to pick a GPU)."""
    return _rc.local_rank()


def local_size() -> int:
    """Number of processes on this host."""
    return _rc.local_size()


def cross_rank() -> int:
    """Index of this host among the job's hosts."""
    return _rc.cross_rank()


def cross_size() -> int:
    """Number of hosts in the job."""
    return _rc.cross_size()


def is_homogeneous() -> bool:
    """True when every host runs the same number of processes."""
    return size() == local_size() * cross_size()


def mpi_threads_supported() -> bool:
    """ringcomm does not use MPI: always False."""
    return False


def mpi_enabled() -> bool:
    """ringcomm does not use MPI: always False."""
    return False


def mpi_built() -> bool:
    """ringcomm does not use MPI: always False."""
    return False


def gloo_enabled() -> bool:
    """True: ringcomm plays the role of Horovod's Gloo (CPU) controller and data plane."""
    return True


def gloo_built() -> bool:
    """True, see :func:`gloo_enabled`."""
    return True


def nccl_built() -> bool:
    """False: CUDA tensors are reduced on the host, never with NCCL."""
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def cuda_built() -> bool:
    """True when PyTorch sees a CUDA device (CUDA tensors are staged through pinned host memory)."""
    return bool(torch.cuda.is_available())


class ProcessSet:
    """A subset of ranks.  Only the global set (every rank) is supported for now.

    It exists so that Horovod signatures (``process_set=global_process_set``)
    keep working; any other set raises a clear error when used.
    """

    def __init__(self, ranks: list[int] | None = None) -> None:
        self.ranks = None if ranks is None else sorted(int(r) for r in ranks)
        self.process_set_id = 0 if ranks is None else None

    def _is_global(self) -> bool:
        return self.ranks is None or (is_initialized() and self.ranks == list(range(size())))

    def size(self) -> int:
        return size() if self.ranks is None else len(self.ranks)

    def rank(self) -> int:
        return rank() if self.ranks is None else self.ranks.index(rank())

    def included(self) -> bool:
        return self.ranks is None or rank() in self.ranks

    def __repr__(self) -> str:
        return "ProcessSet(global)" if self.ranks is None else f"ProcessSet(ranks={self.ranks})"


global_process_set = ProcessSet()


def check_process_set(process_set: Any, what: str) -> None:
    """Raise :class:`InvalidInputError` unless ``process_set`` is the global set (or None)."""
    if process_set is None or process_set is global_process_set:
        return
    if isinstance(process_set, ProcessSet) and process_set._is_global():
        return
    raise InvalidInputError(
        f"{what}: process_set={process_set!r} is not supported yet; only the global process set "
        "(every rank) is. Leave process_set at its default."
    )


def add_process_set(process_set: Any) -> ProcessSet:
    """Not supported yet: raises :class:`InvalidInputError`."""
    raise InvalidInputError(
        "hvd.add_process_set: process sets other than the global one are not supported yet"
    )


def remove_process_set(process_set: Any) -> bool:
    """Not supported yet: raises :class:`InvalidInputError`."""
    raise InvalidInputError(
        "hvd.remove_process_set: process sets other than the global one are not supported yet"
    )
