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

from collections.abc import Sequence

import torch

import ringcomm as _rc
from ringcomm import api as _core_api
from ringcomm.errors import InvalidInputError
from ringcomm.core.process_sets import ProcessSet, global_process_set

add_process_set = _rc.add_process_set
remove_process_set = _rc.remove_process_set

__all__ = [
    "init", "shutdown", "is_initialized",
    "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "is_homogeneous",
    "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "check_process_set", "set_rank", "set_size",
]


def init(comm: Any = None, process_sets: Sequence[ProcessSet] | str | None = None) -> None:
    """Start (or join) the job: every rank must call it before any collective.

    Without a launcher environment this makes a one-process job (size 1).
    ``comm`` (an MPI communicator in Horovod) is accepted for signature
    compatibility only.  ``process_sets``: a list of :class:`ProcessSet` to
    register now (the same list on every rank), or ``"dynamic"`` to allow
    :func:`add_process_set` / :func:`remove_process_set` later::

        even = hvd.ProcessSet([0, 2])
        hvd.init(process_sets=[even])      # every rank: even.process_set_id == 1
    """
    if comm is not None and comm != []:
        raise InvalidInputError(
            "hvd.init(comm=...): ringcomm does not use MPI communicators; start the job with "
            "`ringcomm-run -np N python script.py` and call hvd.init() without arguments"
        )
    _rc.init(process_sets=process_sets)


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


def _enabled(library: str) -> bool:
    if not _rc.is_initialized():
        return False  # as Horovod: a library is enabled by init()
    settings = _core_api.current_settings()
    return library in (settings.controller.strip().lower(), settings.cpu_operations.strip().lower())


def mpi_enabled() -> bool:
    """True after ``init()`` in a job started for MPI (``horovodrun --mpi``, ``HOROVOD_CONTROLLER=mpi``), as
    Horovod answers there; ringcomm itself never uses MPI (:func:`mpi_built` is False)."""
    return _enabled("mpi")


def mpi_built() -> bool:
    """ringcomm does not use MPI: always False."""
    return False


def gloo_enabled() -> bool:
    """True after ``init()`` in a job started for Gloo (``horovodrun --gloo``, ``HOROVOD_CONTROLLER=gloo`` or
    ``HOROVOD_CPU_OPERATIONS=gloo``), as Horovod answers there; ringcomm's own controller and data plane take
    Gloo's place (:func:`gloo_built` is False)."""
    return _enabled("gloo")


def gloo_built() -> bool:
    """ringcomm does not use Gloo: always False (``ringcomm-run --check-build`` shows the same)."""
    return False


def nccl_built() -> int:
    """0, Horovod's answer without NCCL: CUDA tensors are reduced on the host, never with NCCL."""
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def cuda_built() -> bool:
    """True when PyTorch is built with CUDA: CUDA tensors are then supported (staged through pinned host memory).

    As in Horovod, this tells what the build supports, not whether a GPU is present now
    (``torch.cuda.is_available()``).
    """
    return bool(torch.backends.cuda.is_built())


def check_process_set(process_set: Any, what: str) -> None:
    """Raise unless ``process_set`` is registered and includes this rank (None: the global set)."""
    _rc.api.resolve_process_set(process_set, what)


def set_rank(process_set: Any) -> int:
    """This rank's index within ``process_set`` (the global rank for the global set)."""
    if process_set is None or process_set is global_process_set:
        return rank()
    return int(process_set.rank())


def set_size(process_set: Any) -> int:
    """Number of ranks in ``process_set`` (the job size for the global set)."""
    if process_set is None or process_set is global_process_set:
        return size()
    return int(process_set.size())
